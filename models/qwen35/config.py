"""Qwen3.5 text-tower config, parsed from `config.json` and failing closed on what this line does
not run, before any weight is read.

Two model types: `qwen3_5_text` is the tower alone; `qwen3_5` keeps it under `text_config` beside
a vision tower (not served). Layers are `linear_attention` (Gated DeltaNet) or `full_attention`
(gated-Q attention), from `layer_types` or, without it, every `full_attention_interval`-th layer
full. The text tower's MRoPE gives every section the same position for text, so it is 1-D partial
RoPE; its sections must still cover the rotary dims exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kernels.gdn.base import GDNGeometry as KernelGDNGeometry
from models.config_fields import ConfigReader, eos_token_ids

TEXT_MODEL_TYPE = "qwen3_5_text"
OUTER_MODEL_TYPE = "qwen3_5"
MODEL_TYPES = (OUTER_MODEL_TYPE, TEXT_MODEL_TYPE)

LINEAR = "linear_attention"
FULL = "full_attention"
_LAYER_TYPES = (LINEAR, FULL)
_DEFAULT_FULL_EVERY = 4
# What the kernels cover: the conv width of every published Qwen3.5 (the GPU conv kernels are
# written for it); GDN head dims up to 256 (fla-core's chunk kernel bound, K ≤ 256); the
# attention-prep kernel needs a power-of-two head dim.
SUPPORTED_CONV_KERNEL = 4
MAX_GDN_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class GDNGeometry:
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim

    def kernel_geometry(self) -> KernelGDNGeometry:
        """The head layout as the GDN backends take it."""
        return KernelGDNGeometry(
            key_heads=self.num_key_heads,
            value_heads=self.num_value_heads,
            key_dim=self.key_head_dim,
            value_dim=self.value_head_dim,
        )


@dataclass(frozen=True, slots=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    gdn: GDNGeometry
    rms_norm_eps: float
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    dtype: str
    # The text tower sits under `text_config` and its tensors under `model.language_model.`.
    nested: bool

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _text_tower(outer: ConfigReader) -> tuple[ConfigReader, ConfigReader]:
    model_type = outer.require_value("model_type", MODEL_TYPES)
    if model_type == TEXT_MODEL_TYPE:
        return outer, outer
    text = outer.sub("text_config")
    text.require_value("model_type", (TEXT_MODEL_TYPE,), default=TEXT_MODEL_TYPE)
    return text, outer


def _layer_types(cfg: ConfigReader, num_layers: int) -> tuple[str, ...]:
    raw = cfg.raw("layer_types", None)
    if raw is None:
        every = cfg.get_int("full_attention_interval", _DEFAULT_FULL_EVERY)
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(num_layers))
    if not isinstance(raw, list) or len(raw) != num_layers:
        raise cfg.fail("layer_types", f"expected a list of {num_layers} layer types")
    bad = [t for t in raw if t not in _LAYER_TYPES]
    if bad:
        raise cfg.fail("layer_types", f"unsupported layer type {bad[0]!r} (supported: {_LAYER_TYPES})")
    if FULL not in raw:
        raise cfg.fail("layer_types", "a Qwen3.5 text tower needs at least one full_attention layer")
    return tuple(raw)


def _rope(cfg: ConfigReader, head_dim: int) -> tuple[float, float]:
    rope = cfg.sub("rope_parameters")
    rope.require_value("rope_type", ("default",), default="default")
    factor = rope.get_float("partial_rotary_factor", 0.25)
    rotary = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or rotary % 2:
        raise rope.fail(
            "partial_rotary_factor", f"must lie in (0, 1] and turn an even number of the {head_dim} dims"
        )
    if rope.has("mrope_section"):
        sections = rope.raw("mrope_section")
        if not isinstance(sections, list) or sum(int(s) for s in sections) != rotary // 2:
            raise rope.fail("mrope_section", f"must sum to the {rotary // 2} rotary frequencies")
    return rope.get_float("rope_theta"), factor


def _gdn(cfg: ConfigReader) -> GDNGeometry:
    key_heads = cfg.get_int("linear_num_key_heads", 16)
    value_heads = cfg.get_int("linear_num_value_heads", 32)
    if value_heads % key_heads:
        raise cfg.fail("linear_num_value_heads", f"must be a multiple of linear_num_key_heads ({key_heads})")
    dims = {}
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        dims[key] = cfg.get_int(key, 128)
        if dims[key] > MAX_GDN_HEAD_DIM:
            raise cfg.fail(key, f"GDN head dims up to {MAX_GDN_HEAD_DIM} are supported")
    kernel = cfg.get_int("linear_conv_kernel_dim", SUPPORTED_CONV_KERNEL)
    if kernel != SUPPORTED_CONV_KERNEL:
        raise cfg.fail(
            "linear_conv_kernel_dim", f"only a conv kernel of {SUPPORTED_CONV_KERNEL} is supported"
        )
    return GDNGeometry(
        key_heads, value_heads, dims["linear_key_head_dim"], dims["linear_value_head_dim"], kernel
    )


def _refuse_unsupported(cfg: ConfigReader) -> None:
    cfg.require_value("hidden_act", ("silu",), default="silu")
    if cfg.get_bool("attention_bias", False):
        raise cfg.fail("attention_bias", "attention projections with bias are not supported")
    if not cfg.get_bool("attn_output_gate", True):
        raise cfg.fail("attn_output_gate", "only gated full attention (q_proj twice as wide) is supported")
    # The recurrent state is kept in fp32 (as the checkpoints ask); another dtype is not built.
    cfg.require_value("mamba_ssm_dtype", ("float32",), default="float32")


def _dtype(text: ConfigReader, outer: ConfigReader) -> str:
    for reader in (outer, text):
        for key in ("dtype", "torch_dtype"):
            if reader.has(key):
                value = reader.get_str(key)
                if value not in ("bfloat16", "float16", "float32"):
                    raise reader.fail(key, "expected bfloat16, float16 or float32")
                return value
    return "bfloat16"


def parse_qwen35_config(checkpoint: Path) -> Qwen35Config:
    outer = ConfigReader.from_file(checkpoint / "config.json")
    cfg, top = _text_tower(outer)
    _refuse_unsupported(cfg)
    num_layers = cfg.get_int("num_hidden_layers")
    num_heads = cfg.get_int("num_attention_heads")
    num_kv_heads = cfg.get_int("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise cfg.fail("num_key_value_heads", f"must divide num_attention_heads ({num_heads})")
    head_dim = cfg.get_int("head_dim", 256)
    if head_dim & (head_dim - 1):
        raise cfg.fail("head_dim", "the attention-prep kernel needs a power-of-two head dim")
    theta, factor = _rope(cfg, head_dim)
    return Qwen35Config(
        vocab_size=cfg.get_int("vocab_size"),
        hidden_size=cfg.get_int("hidden_size"),
        intermediate_size=cfg.get_int("intermediate_size"),
        layer_types=_layer_types(cfg, num_layers),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        partial_rotary_factor=factor,
        gdn=_gdn(cfg),
        rms_norm_eps=cfg.get_float("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get_int("max_position_embeddings"),
        eos_token_ids=eos_token_ids(checkpoint, top, cfg),
        dtype=_dtype(cfg, top),
        nested=cfg is not top,
    )
