"""What a model family contributes to a synthetic checkpoint: presets, tokens, template and init rules.

Each family module (models/synth/families/) builds one `Family`; everything downstream (config
building, weights, tokenizer, writing) reads only these value objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

InitKind = Literal["normal", "centred", "uniform", "log_uniform", "head_scaled"]
TokenizerKind = Literal["real", "trained"]
# text: the text tower alone, flattened (`*_text` model type); published: the layout of the
# published multimodal checkpoint, the same text tower nested beside a vision tower.
CheckpointForm = Literal["text", "published"]
FORMS: tuple[CheckpointForm, ...] = ("text", "published")


@dataclass(slots=True, frozen=True)
class InitRule:
    """Tensors whose name ends with `suffix` draw from this distribution.

    normal: N(0, a); centred: a + N(0, b) (norm weights around their identity value);
    uniform: U(a, b); log_uniform: log U(a, b) (Gated DeltaNet's A_log);
    head_scaled: d^(-1/4) · (a + N(0, b)), d the tensor's last dimension (a head dim): Q and K norm
    weights that carry the 1/sqrt(d) a model attending at scale 1 leaves out of its scale.
    """

    suffix: str
    kind: InitKind
    a: float
    b: float = 0.0

    def matches(self, tensor_name: str) -> bool:
        return tensor_name.endswith(self.suffix)


@dataclass(slots=True, frozen=True)
class Preset:
    """One size of a family. `fields` is the full config.json body except token ids and dtype,
    spelled as the family's published config.json spells it."""

    name: str
    fields: Mapping[str, Any]
    default_dtype: str
    default_tokenizer: TokenizerKind
    # True for `tiny`: built on the CPU by default, so a CPU box and a GPU box write the same bits.
    small: bool = False

    @property
    def vocab_size(self) -> int:
        return int(self.fields["vocab_size"])


def tiny_preset(fields: Mapping[str, Any]) -> Preset:
    """The CPU-test size: float32, a trained tokenizer, drawn on the CPU."""
    return Preset("tiny", fields, default_dtype="float32", default_tokenizer="trained", small=True)


def published_preset(name: str, fields: Mapping[str, Any], tokenizer: TokenizerKind) -> Preset:
    """A published size: bfloat16, as the released checkpoints are."""
    return Preset(name, fields, default_dtype="bfloat16", default_tokenizer=tokenizer)


def preset_table(*presets: Preset) -> Mapping[str, Preset]:
    table = {preset.name: preset for preset in presets}
    if len(table) != len(presets):
        raise ValueError(f"duplicate preset names in {[preset.name for preset in presets]}")
    return MappingProxyType(table)


@dataclass(slots=True, frozen=True)
class SpecialToken:
    content: str
    # False for added tokens that decode as text (Qwen's <think>, <tool_call>): they survive
    # `skip_special_tokens`, as in the published tokenizers.
    special: bool = True


@dataclass(slots=True, frozen=True)
class TokenLayout:
    """Where special tokens sit in the id space.

    pinned: fixed ids (Gemma: <pad>=0, <eos>=1, <bos>=2, ...); an id at or past the vocabulary
    size is dropped, so a tiny vocabulary keeps only the low ones.
    appended: placed right after the ordinary vocabulary, in this order (Qwen: <|endoftext|>, ...).
    """

    pinned: Mapping[int, SpecialToken]
    appended: tuple[SpecialToken, ...]


@dataclass(slots=True, frozen=True)
class TokenRoles:
    """Token contents for the ids config.json, generation_config.json and tokenizer_config.json name."""

    # config.json
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    generation_bos: str | None
    generation_eos: tuple[str, ...]
    generation_pad: str | None
    # tokenizer_config.json (Qwen names no BOS there, though its config.json has a bos id, and a
    # pad token its config.json does not name)
    tokenizer_bos: str | None
    tokenizer_eos: str
    tokenizer_pad: str | None


@dataclass(slots=True, frozen=True)
class RealVocab:
    """A published vocabulary shipped by an installable package as tiktoken ranks."""

    package: str
    resource: str
    pip_name: str
    # The vocabulary size the published config pads the embedding table to.
    padded_vocab_size: int


@dataclass(slots=True, frozen=True)
class ProcessorClasses:
    """The transformers classes whose defaults the published form's processor files come from,
    as `module:Class` (each importable without torchvision, so a CPU box writes them too)."""

    # What transformers' AutoProcessor builds for the outer model type (nothing is written for it:
    # AutoProcessor finds it by model type).
    processor: str
    image_processor: str
    video_processor: str


@dataclass(slots=True, frozen=True)
class MultimodalForm:
    """A family's published multimodal layout (`--form published`, docs/synth.md "Forms").

    Invariant: the text tower is the text form's, unchanged: its config.json body under
    `text_config` and its tensors under `text_prefix` instead of `text_form_prefix`, drawn from
    the text form's tensor names, so one seed gives both forms the same text weights bit for bit.
    The vision tower is transformers' vision config with its defaults, except the fields a preset
    sets in `vision_fields` and `out_hidden_size`, always the text hidden size.
    """

    model_type: str
    architecture: str
    text_prefix: str
    text_form_prefix: str
    vision_prefix: str
    # `module:Class` of transformers' vision config.
    vision_config_class: str
    # Per preset name: the fields set over the vision config's defaults.
    vision_fields: Mapping[str, Mapping[str, Any]]
    # config.json keys naming special tokens → the token's content (its id comes from the tokenizer).
    token_fields: Mapping[str, str]
    # The vision tower's rules; text tensors keep the family's.
    vision_init_rules: tuple[InitRule, ...]
    processor: ProcessorClasses

    def seed_name(self, tensor_name: str) -> str:
        """The name a tensor's values are drawn by: a text tensor's name in the text form."""
        if tensor_name.startswith(self.text_prefix):
            return self.text_form_prefix + tensor_name[len(self.text_prefix) :]
        return tensor_name


@dataclass(slots=True, frozen=True)
class Family:
    name: str
    model_type: str
    architecture: str
    # Published Qwen3 files say "torch_dtype"; Gemma 4 and Qwen3.5 say "dtype".
    dtype_key: str
    presets: Mapping[str, Preset]
    tokens: TokenLayout
    roles: TokenRoles
    # Pre-tokenizer split regex; None: byte-level's built-in GPT-2 split.
    split_pattern: str | None
    # Whether plain `encode` prepends BOS (Gemma does; Qwen has no BOS).
    adds_bos: bool
    chat_template: str
    tokenizer_class: str
    init_rules: tuple[InitRule, ...]
    generation_defaults: Mapping[str, Any]
    real_vocab: RealVocab | None
    # The published multimodal layout, where `--form published` can write it.
    multimodal: MultimodalForm | None = None

    def preset(self, name: str) -> Preset:
        from models.synth.errors import UnknownPresetError

        try:
            return self.presets[name]
        except KeyError:
            raise UnknownPresetError(self.name, name, tuple(self.presets)) from None

    def forms(self) -> tuple[CheckpointForm, ...]:
        return FORMS if self.multimodal is not None else ("text",)
