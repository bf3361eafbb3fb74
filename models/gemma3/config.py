"""Gemma 3 text-tower config, parsed from `config.json` and failing closed on what this line does not run.

Two model types: `gemma3_text` is the tower alone (the 270M and 1B checkpoints); `gemma3` keeps it
under `text_config` beside a vision tower that is not served. What sets Gemma 3 apart from its
defaults must be in the file, named: the attention scale (`query_pre_attn_scalar`), the RoPE base
of each layer kind, the layer pattern and the window. transformers fills those in when a config
omits them, but a checkpoint that omits them says nothing about what it was trained with, so it is
refused rather than guessed.

RoPE has two spellings: `rope_parameters` keyed by layer type (transformers 5), or `rope_theta` (global
layers), `rope_local_base_freq` (sliding layers) and `rope_scaling` (global layers only). Only
unscaled (`default`) RoPE is implemented; the linear scaling the 4B-27B checkpoints put on their
global layers is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.config_fields import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ConfigReader,
    checkpoint_dtype,
    eos_token_ids,
    text_tower,
)

OUTER_MODEL_TYPES = ("gemma3",)
TEXT_MODEL_TYPES = ("gemma3_text",)
MODEL_TYPES = OUTER_MODEL_TYPES + TEXT_MODEL_TYPES

SLIDING = SLIDING_ATTENTION
GLOBAL = FULL_ATTENTION
LAYER_TYPES = (SLIDING, GLOBAL)
# The keys a `rope_parameters` entry may hold: anything else would change the rotation.
_ROPE_KEYS = ("rope_type", "rope_theta")


@dataclass(frozen=True, slots=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    # RoPE base per layer kind: `rope_local_base_freq` on sliding layers, `rope_theta` on global ones.
    sliding_rope_theta: float
    global_rope_theta: float
    query_pre_attn_scalar: float
    rms_norm_eps: float
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    dtype: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """`query_pre_attn_scalar ** -0.5`, as transformers computes it (not head_dim's)."""
        return float(self.query_pre_attn_scalar**-0.5)

    def rope_theta(self, layer_type: str) -> float:
        return self.sliding_rope_theta if layer_type == SLIDING else self.global_rope_theta

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)


def _layer_types(cfg: ConfigReader, num_layers: int) -> tuple[str, ...]:
    """`layer_types` when present (transformers reads nothing else then), else every
    `sliding_window_pattern`-th layer global."""
    raw = cfg.raw("layer_types", None)
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != num_layers:
            raise cfg.fail("layer_types", f"expected a list of {num_layers} layer types")
        bad = [t for t in raw if t not in LAYER_TYPES]
        if bad:
            raise cfg.fail("layer_types", f"unsupported layer type {bad[0]!r} (supported: {LAYER_TYPES})")
        return tuple(raw)
    if not cfg.has("sliding_window_pattern"):
        raise cfg.fail(
            "layer_types", "required (or sliding_window_pattern): the layer pattern is not guessed"
        )
    period = cfg.get_int("sliding_window_pattern")
    return tuple(GLOBAL if (i + 1) % period == 0 else SLIDING for i in range(num_layers))


def _unscaled(reader: ConfigReader, key: str, scaling: object) -> None:
    """Refuse any RoPE scaling but none / `default`, naming its kind."""
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
    if kind != "default":
        raise reader.fail(key, f"RoPE scaling {kind!r} is not implemented (only unscaled 'default' RoPE)")


def _rope_thetas(cfg: ConfigReader) -> tuple[float, float]:
    """(sliding theta, global theta), from either spelling (module doc)."""
    if cfg.has("rope_parameters"):
        params = cfg.sub("rope_parameters")
        thetas = []
        for kind in (SLIDING, GLOBAL):
            rope = params.sub(kind)
            extra = sorted(set(rope.data) - set(_ROPE_KEYS))
            if extra:
                raise rope.fail(
                    extra[0], "not supported (a rope entry may hold only rope_type and rope_theta)"
                )
            _unscaled(rope, "rope_type", rope.get_str("rope_type"))
            thetas.append(rope.get_float("rope_theta"))
        return thetas[0], thetas[1]
    _unscaled(cfg, "rope_scaling", cfg.raw("rope_scaling", None))
    return cfg.get_float("rope_local_base_freq"), cfg.get_float("rope_theta")


def _refuse_unsupported(cfg: ConfigReader) -> None:
    if cfg.get_bool("attention_bias", False):
        raise cfg.fail("attention_bias", "attention projections with bias are not supported")
    if cfg.has("attn_logit_softcapping"):
        raise cfg.fail("attn_logit_softcapping", "attention-score soft-capping is not implemented")
    if cfg.get_bool("use_bidirectional_attention", False):
        raise cfg.fail("use_bidirectional_attention", "only causal attention is supported")
    cfg.require_value("hidden_activation", ("gelu_pytorch_tanh",), default="gelu_pytorch_tanh")


def parse_gemma3_config(checkpoint: Path) -> Gemma3Config:
    outer = ConfigReader.from_file(checkpoint / "config.json")
    cfg, top = text_tower(outer, OUTER_MODEL_TYPES, TEXT_MODEL_TYPES)
    _refuse_unsupported(cfg)
    num_layers = cfg.get_int("num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    num_heads = cfg.get_int("num_attention_heads")
    num_kv_heads = cfg.get_int("num_key_value_heads")
    if num_heads % num_kv_heads:
        raise cfg.fail(
            "num_key_value_heads", f"{num_kv_heads} KV heads do not divide num_attention_heads ({num_heads})"
        )
    head_dim = cfg.get_int("head_dim")
    if head_dim % 2:
        raise cfg.fail("head_dim", "rotary embedding needs an even head dim")
    sliding_theta, global_theta = _rope_thetas(cfg)
    scalar = cfg.get_float("query_pre_attn_scalar")
    if scalar <= 0:
        raise cfg.fail("query_pre_attn_scalar", "must be positive (the attention scale is its inverse root)")
    softcap = cfg.get_float("final_logit_softcapping", 0.0) or None
    if softcap is not None and softcap < 0:
        raise cfg.fail("final_logit_softcapping", "must be positive")
    # A multimodal checkpoint's head is the outer model's: its flag governs (transformers reads it there).
    tied = top.get_bool("tie_word_embeddings", True)
    sliding_window = cfg.get_int("sliding_window") if SLIDING in layer_types else 0
    return Gemma3Config(
        vocab_size=cfg.get_int("vocab_size"),
        hidden_size=cfg.get_int("hidden_size"),
        intermediate_size=cfg.get_int("intermediate_size"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=layer_types,
        sliding_window=sliding_window,
        sliding_rope_theta=sliding_theta,
        global_rope_theta=global_theta,
        query_pre_attn_scalar=scalar,
        rms_norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        final_logit_softcapping=softcap,
        tie_word_embeddings=tied,
        max_position_embeddings=cfg.get_int("max_position_embeddings"),
        eos_token_ids=eos_token_ids(checkpoint, top, cfg),
        bos_token_id=cfg.get_int("bos_token_id", minimum=0) if cfg.has("bos_token_id") else None,
        dtype=checkpoint_dtype(top, cfg),
    )
