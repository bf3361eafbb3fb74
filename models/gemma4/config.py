"""Gemma 4 text-tower config, parsed from `config.json` and failing closed on what this line does not run.

Four model types: `gemma4` and `gemma4_unified` keep the text tower under `text_config` (their vision
and audio parts are not served); `gemma4_text` and `gemma4_unified_text` are the tower alone. The
global layers' geometry has two spellings: `global_head_dim` / `num_global_key_value_heads`, or
(newer transformers) `per_layer_config`, keyed by layer index or layer type. Both are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.config_fields import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ConfigReader,
    checkpoint_dtype,
    eos_token_ids,
    generation_token_ids,
    text_tower,
)

OUTER_MODEL_TYPES = ("gemma4", "gemma4_unified")
TEXT_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")
MODEL_TYPES = OUTER_MODEL_TYPES + TEXT_MODEL_TYPES

SLIDING = SLIDING_ATTENTION
GLOBAL = FULL_ATTENTION
_LAYER_TYPES = (SLIDING, GLOBAL)
# HF's layout when `layer_types` is absent: every 6th layer global (and the last, always).
_DEFAULT_GLOBAL_EVERY = 6
# Per-layer overrides a global layer may carry; anything else in `per_layer_config` is refused.
_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True, slots=True)
class AttentionGeometry:
    """One attention family: its heads and rotary. `proportional` rotary pairs (d, d + head_dim/2)
    and turns only the first `partial_rotary_factor` of the frequencies."""

    head_dim: int
    num_kv_heads: int
    rope_theta: float
    partial_rotary_factor: float
    proportional: bool


@dataclass(frozen=True, slots=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[str, ...]
    sliding: AttentionGeometry
    full: AttentionGeometry
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    suppress_token_ids: frozenset[int]
    bos_token_id: int | None
    dtype: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def geometry(self, layer_type: str) -> AttentionGeometry:
        return self.sliding if layer_type == SLIDING else self.full

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)


def _layer_types(cfg: ConfigReader, num_layers: int) -> tuple[str, ...]:
    raw = cfg.raw("layer_types", None)
    if raw is None:
        kinds = [GLOBAL if (i + 1) % _DEFAULT_GLOBAL_EVERY == 0 else SLIDING for i in range(num_layers)]
    else:
        if not isinstance(raw, list) or len(raw) != num_layers:
            raise cfg.fail("layer_types", f"expected a list of {num_layers} layer types")
        bad = [t for t in raw if t not in _LAYER_TYPES]
        if bad:
            raise cfg.fail("layer_types", f"unsupported layer type {bad[0]!r} (supported: {_LAYER_TYPES})")
        kinds = list(raw)
    if kinds[-1] != GLOBAL:
        # transformers forces the last layer global (with a warning); serving it otherwise would
        # silently differ from the reference, so the config must say what it means.
        raise cfg.fail("layer_types", "the last layer must be full_attention")
    if SLIDING not in kinds:
        raise cfg.fail("layer_types", "a Gemma 4 text tower needs at least one sliding_attention layer")
    return tuple(kinds)


def _rope(cfg: ConfigReader, layer_type: str, proportional: bool) -> tuple[float, float]:
    rope = cfg.sub("rope_parameters").sub(layer_type)
    expected = "proportional" if proportional else "default"
    rope.require_value("rope_type", (expected,))
    if rope.has("factor") and rope.get_float("factor") != 1.0:
        raise rope.fail("factor", "scaled rotary (factor != 1) is not supported")
    factor = rope.get_float("partial_rotary_factor", 1.0)
    if not 0.0 < factor <= 1.0:
        raise rope.fail("partial_rotary_factor", "must lie in (0, 1]")
    if not proportional and factor != 1.0:
        raise rope.fail("partial_rotary_factor", "partial rotary is only supported on global layers")
    return rope.get_float("rope_theta"), factor


def _global_overrides(cfg: ConfigReader, layer_types: tuple[str, ...]) -> dict[str, int]:
    """The head_dim / num_key_value_heads every global layer shares, from `per_layer_config`."""
    per_layer = cfg.sub("per_layer_config")
    found: dict[str, int] | None = None
    for key in per_layer.data:
        if key in _LAYER_TYPES:
            kind = key
        elif key.isdigit() and int(key) < len(layer_types):
            kind = layer_types[int(key)]
        else:
            raise per_layer.fail(key, "expected a layer index or a layer type")
        entry = per_layer.sub(key)
        extra = sorted(set(entry.data) - set(_PER_LAYER_FIELDS))
        if extra:
            raise entry.fail(
                extra[0], "per-layer override not supported (only head_dim, num_key_value_heads)"
            )
        if kind != GLOBAL:
            raise per_layer.fail(key, "overrides are only supported on full_attention layers")
        values = {f: entry.get_int(f) for f in _PER_LAYER_FIELDS if entry.has(f)}
        if found is not None and values != found:
            raise per_layer.fail(key, f"differs from another global layer's {found}: all must agree")
        found = values
    return found or {}


def _refuse_unsupported(cfg: ConfigReader) -> None:
    if cfg.get_int("num_kv_shared_layers", 0, minimum=0) > 0:
        raise cfg.fail("num_kv_shared_layers", "KV sharing across layers is not supported")
    if cfg.get_int("hidden_size_per_layer_input", 0, minimum=0) > 0:
        raise cfg.fail("hidden_size_per_layer_input", "per-layer input embeddings are not supported")
    if cfg.get_bool("enable_moe_block", False):
        raise cfg.fail("enable_moe_block", "MoE blocks are not supported")
    if cfg.get_bool("attention_bias", False):
        raise cfg.fail("attention_bias", "attention projections with bias are not supported")
    if not cfg.get_bool("attention_k_eq_v", False):
        raise cfg.fail("attention_k_eq_v", "only K = V global layers (no v_proj) are supported")
    cfg.require_value("hidden_activation", ("gelu_pytorch_tanh",), default="gelu_pytorch_tanh")
    cfg.require_value("use_bidirectional_attention", (None, "vision"), default=None)


def parse_gemma4_config(checkpoint: Path) -> Gemma4Config:
    outer = ConfigReader.from_file(checkpoint / "config.json")
    cfg, top = text_tower(outer, OUTER_MODEL_TYPES, TEXT_MODEL_TYPES)
    _refuse_unsupported(cfg)
    num_layers = cfg.get_int("num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    num_heads = cfg.get_int("num_attention_heads")
    hidden_size = cfg.get_int("hidden_size")
    sliding_kv = cfg.get_int("num_key_value_heads", num_heads)
    head_dim = cfg.get_int("head_dim", hidden_size // num_heads)
    overrides: dict[str, Any] = _global_overrides(cfg, layer_types) if cfg.has("per_layer_config") else {}
    global_dim = overrides.get("head_dim") or cfg.get_int("global_head_dim", 512)
    global_kv = overrides.get("num_key_value_heads") or cfg.get_int("num_global_key_value_heads", sliding_kv)
    for key, kv in (("num_key_value_heads", sliding_kv), ("num_global_key_value_heads", global_kv)):
        if num_heads % kv:
            raise cfg.fail(key, f"{kv} KV heads do not divide num_attention_heads ({num_heads})")
    for key, dim in (("head_dim", head_dim), ("global_head_dim", global_dim)):
        if dim % 2:
            raise cfg.fail(key, "rotary embedding needs an even head dim")
    sliding_theta, _ = _rope(cfg, SLIDING, proportional=False)
    global_theta, global_factor = _rope(cfg, GLOBAL, proportional=True)
    softcap = cfg.get_float("final_logit_softcapping", 0.0) or None
    if not cfg.get_bool("tie_word_embeddings", True) or not top.get_bool("tie_word_embeddings", True):
        raise cfg.fail("tie_word_embeddings", "Gemma 4's LM head is the tied embedding")
    bos = cfg.get_int("bos_token_id", minimum=0) if cfg.has("bos_token_id") else None
    return Gemma4Config(
        vocab_size=cfg.get_int("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=cfg.get_int("intermediate_size"),
        num_heads=num_heads,
        layer_types=layer_types,
        sliding=AttentionGeometry(head_dim, sliding_kv, sliding_theta, 1.0, proportional=False),
        full=AttentionGeometry(global_dim, global_kv, global_theta, global_factor, proportional=True),
        sliding_window=cfg.get_int("sliding_window"),
        rms_norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        final_logit_softcapping=softcap,
        max_position_embeddings=cfg.get_int("max_position_embeddings"),
        eos_token_ids=eos_token_ids(checkpoint, top, cfg),
        suppress_token_ids=generation_token_ids(checkpoint, "suppress_tokens"),
        bos_token_id=bos,
        dtype=checkpoint_dtype(top, cfg),
    )
