"""Qwen3 dense config, parsed from `config.json` and failing closed on what this line does not run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.config_fields import ConfigReader, eos_token_ids

MODEL_TYPES = ("qwen3",)


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: frozenset[int]
    dtype: str

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_theta(cfg: ConfigReader) -> float:
    """Accept both spellings: `rope_theta` + `rope_scaling` (transformers < 5) and
    `rope_parameters` (transformers >= 5). Only unscaled (default) RoPE is implemented."""
    if cfg.has("rope_parameters"):
        rope = cfg.sub("rope_parameters")
        rope.require_value("rope_type", ("default",), default="default")
        if rope.has("partial_rotary_factor") and rope.get_float("partial_rotary_factor") != 1.0:
            raise rope.fail("partial_rotary_factor", "partial rotary is not supported for Qwen3")
        return rope.get_float("rope_theta")
    if cfg.has("rope_scaling"):
        scaling = cfg.raw("rope_scaling")
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise cfg.fail("rope_scaling", f"rope scaling {kind!r} is not implemented (only unscaled RoPE)")
    return cfg.get_float("rope_theta", 10000.0)


def parse_qwen3_config(checkpoint: Path) -> Qwen3Config:
    cfg = ConfigReader.from_file(checkpoint / "config.json")
    cfg.require_value("model_type", MODEL_TYPES)
    cfg.require_value("hidden_act", ("silu",), default="silu")
    if cfg.get_bool("attention_bias", False):
        raise cfg.fail("attention_bias", "attention projections with bias are not supported")
    if cfg.get_bool("use_sliding_window", False):
        raise cfg.fail("use_sliding_window", "sliding-window attention is not supported for Qwen3")
    layer_types = cfg.raw("layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise cfg.fail("layer_types", "only full_attention layers are supported for Qwen3")
    num_heads = cfg.get_int("num_attention_heads")
    num_kv_heads = cfg.get_int("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise cfg.fail("num_key_value_heads", f"must divide num_attention_heads ({num_heads})")
    hidden_size = cfg.get_int("hidden_size")
    head_dim = cfg.get_int("head_dim", hidden_size // num_heads)
    if head_dim % 2:
        raise cfg.fail("head_dim", "rotary embedding needs an even head dim")
    dtype = str(cfg.raw("torch_dtype", cfg.raw("dtype", "bfloat16")))
    if dtype not in ("bfloat16", "float16", "float32"):
        raise cfg.fail("torch_dtype", "expected bfloat16, float16 or float32")
    return Qwen3Config(
        vocab_size=cfg.get_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=cfg.get_int("intermediate_size"),
        num_layers=cfg.get_int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=cfg.get_int("max_position_embeddings"),
        tie_word_embeddings=cfg.get_bool("tie_word_embeddings", False),
        eos_token_ids=eos_token_ids(checkpoint, cfg),
        dtype=dtype,
    )
