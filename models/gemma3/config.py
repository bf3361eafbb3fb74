"""Gemma 3 text-tower config, parsed from `config.json` and failing closed on what this line does not run.

Two model types: `gemma3_text` is the tower alone (the 270M and 1B checkpoints); `gemma3` keeps it
under `text_config` beside a vision tower that is not served. What sets Gemma 3 apart from its
defaults must be in the file, named: the attention scale (`query_pre_attn_scalar`), the RoPE base
of each layer kind, the layer pattern and the window. transformers fills those in when a config
omits them, but a checkpoint that omits them says nothing about what it was trained with, so it is
refused rather than guessed.

RoPE has two spellings: `rope_parameters` keyed by layer type (transformers 5), or `rope_theta` (global
layers), `rope_local_base_freq` (sliding layers) and `rope_scaling` (global layers only). Two RoPE types are
implemented, `default` and `linear` (frequencies divided by `factor`: the 4B-27B checkpoints put
factor 8 on their global layers); any other is refused by name.
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
# The keys a `rope_parameters` entry may hold, per rope type: anything else would change the rotation.
_ROPE_KEYS = {"default": ("rope_type", "rope_theta"), "linear": ("rope_type", "rope_theta", "factor")}


@dataclass(frozen=True, slots=True)
class Rope:
    """One layer kind's rotary: full head dim, base `theta`, frequencies divided by `linear_factor`."""

    theta: float
    linear_factor: float = 1.0


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
    # Per layer kind: `rope_local_base_freq` on sliding layers, `rope_theta` (+ `rope_scaling`) on global ones.
    sliding_rope: Rope
    global_rope: Rope
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

    def rope(self, layer_type: str) -> Rope:
        return self.sliding_rope if layer_type == SLIDING else self.global_rope

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


def _linear_factor(reader: ConfigReader, key: str, kind: object, factor: object) -> float:
    """1 for `default`, `factor` for `linear`; any other RoPE type is refused, naming it."""
    if kind == "default":
        return 1.0
    if kind != "linear":
        raise reader.fail(key, f"RoPE type {kind!r} is not implemented (implemented: 'default', 'linear')")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
        raise reader.fail(key, f"linear RoPE needs a positive 'factor', got {factor!r}")
    return float(factor)


def _ropes(cfg: ConfigReader) -> tuple[Rope, Rope]:
    """(sliding, global), from either spelling (module doc)."""
    if cfg.has("rope_parameters"):
        params = cfg.sub("rope_parameters")
        ropes = []
        for layer_type in (SLIDING, GLOBAL):
            rope = params.sub(layer_type)
            kind = rope.get_str("rope_type")
            factor = _linear_factor(rope, "rope_type", kind, rope.data.get("factor"))
            extra = sorted(set(rope.data) - set(_ROPE_KEYS[kind]))
            if extra:
                raise rope.fail(extra[0], f"not supported in a {kind!r} rope entry (only {_ROPE_KEYS[kind]})")
            ropes.append(Rope(rope.get_float("rope_theta"), factor))
        return ropes[0], ropes[1]
    factor = 1.0
    scaling = cfg.raw("rope_scaling", None)
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise cfg.fail("rope_scaling", "expected a JSON object or null")
        scaling_kind = scaling.get("rope_type", scaling.get("type"))
        factor = _linear_factor(cfg, "rope_scaling", scaling_kind, scaling.get("factor"))
    return Rope(cfg.get_float("rope_local_base_freq")), Rope(cfg.get_float("rope_theta"), factor)


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
    sliding_rope, global_rope = _ropes(cfg)
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
        sliding_rope=sliding_rope,
        global_rope=global_rope,
        query_pre_attn_scalar=scalar,
        rms_norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        final_logit_softcapping=softcap,
        tie_word_embeddings=tied,
        max_position_embeddings=cfg.get_int("max_position_embeddings"),
        eos_token_ids=eos_token_ids(checkpoint, top, cfg),
        bos_token_id=cfg.get_int("bos_token_id", minimum=0) if cfg.has("bos_token_id") else None,
        dtype=checkpoint_dtype(top, cfg),
    )
