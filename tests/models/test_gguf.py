"""GGUF conversion on small files these tests write themselves with the gguf package's GGUFWriter.

The Gemma-3-shaped file holds a tensor of every supported type. Expected values are gguf's own
`dequantize` of the stored blocks (with Gemma's stored `1 + w` norm undone); expected names are
the Hugging Face names written out below; and transformers' own GGUF load of the same file must
hold the very same tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from typer.testing import CliRunner

from infer_cli.main import app
from models.checkpoint import TensorSpec, load_checked, stored_tensors
from models.gguf import (
    CACHE_ENV,
    SUPPORTED_TYPES,
    GGUFError,
    GGUFTensorsError,
    convert_gguf,
    converted_checkpoint,
)
from models.registry import ModelLoadError, load_model

Q = gguf.GGMLQuantizationType
HIDDEN = 256  # the K-quants pack 256 values per block: every row length is a multiple of it
FFN = 512

# Where each K-quant block keeps its float16 scales (the rest of a block is bit fields, valid
# whatever their value). The gguf package can dequantize these types but not quantize to them.
_K_QUANT_F16_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q2_K": (80, 82),  # scales[16] qs[64] d dmin
    "Q3_K": (108,),  # hmask[32] qs[64] scales[12] d
    "Q4_K": (0, 2),  # d dmin scales[12] qs[128]
    "Q5_K": (0, 2),  # d dmin scales[12] qh[32] qs[128]
    "Q6_K": (208,),  # ql[128] qh[64] scales[16] d
}


def _blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The stored bytes (or floats) of a tensor of `type_name` with row-major `shape`."""
    qtype = Q[type_name]
    if type_name in _K_QUANT_F16_OFFSETS or type_name in ("IQ4_NL", "TQ2_0"):
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = shape
        data = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
        scales = rng.uniform(1e-3, 2e-2, size=(rows, cols // block_elems)).astype(np.float16)
        for offset in _K_QUANT_F16_OFFSETS.get(type_name, (0,) if type_name == "IQ4_NL" else (64,)):
            data[..., offset : offset + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
        return data.reshape(rows, -1)
    values = rng.standard_normal(shape).astype(np.float32) * 0.05
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


@dataclass(slots=True)
class TinyArch:
    arch: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 2
    qk_norm: bool = False
    gemma_norms: bool = False
    # GGUF tensor-name suffix -> type, per layer; anything absent is F32.
    layer_types: list[dict[str, str]] = field(default_factory=list)
    embed_type: str = "F32"


GEMMA3 = TinyArch(
    "gemma3",
    heads=4,
    kv_heads=2,
    head_dim=64,
    qk_norm=True,
    gemma_norms=True,
    embed_type="Q8_0",
    layer_types=[
        {
            "attn_q": "Q4_0",
            "attn_k": "Q4_1",
            "attn_v": "Q5_0",
            "attn_output": "Q5_1",
            "ffn_gate": "Q2_K",
            "ffn_up": "Q3_K",
            "ffn_down": "Q4_K",
        },
        {
            "attn_q": "Q5_K",
            "attn_k": "Q6_K",
            "attn_v": "F16",
            "attn_output": "BF16",
            "ffn_gate": "Q8_0",
            "ffn_up": "F32",
            "ffn_down": "Q6_K",
        },
    ],
)
LLAMA = TinyArch(
    "llama",
    heads=4,
    kv_heads=2,
    head_dim=64,
    embed_type="Q8_0",
    layer_types=[{"attn_q": "Q4_K"}, {"attn_k": "Q6_K"}],
)
# transformers' Qwen3 GGUF config takes head_dim from Qwen3Config (128), as every Qwen3 has; its
# vocabulary is byte-level BPE, as in every Qwen3 GGUF.
QWEN3 = TinyArch(
    "qwen3", heads=2, kv_heads=1, head_dim=128, qk_norm=True, layer_types=[{"attn_q": "Q8_0"}, {}]
)


def _sentencepiece_vocab() -> dict[str, list]:
    """A Gemma/Llama-style vocabulary: specials, byte fallback tokens, scored pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = [
        "\u2581",
        *"abcdefghijklmnopqrstuvwxyz",
        "\u2581t",
        "he",
        "\u2581the",
        "\u2581a",
        "in",
        "\u2581in",
    ]
    return {
        "model": "llama",
        "tokens": specials + byte_tokens + pieces,
        "scores": [0.0] * (len(specials) + len(byte_tokens)) + [-float(i) for i in range(len(pieces))],
        "types": [3, 3, 3, 2] + [6] * len(byte_tokens) + [1] * len(pieces),  # control, unknown, byte, normal
        "ids": {"pad": 0, "eos": 1, "bos": 2, "unk": 3},
    }


def _byte_level_vocab() -> dict[str, list]:
    """A Qwen-style byte-level BPE: the 256 byte symbols, merged tokens, then the specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = [
        "\u0120 t",
        "h e",
        "\u0120t he",
        "\u0120 c",
        "a t",
        "\u0120c at",
        "i n",
        "\u0120 in",
        "\u0120 h",
        "\u0120h at",
    ]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = alphabet + merged + specials
    return {
        "model": "gpt2",
        "pre": "qwen2",
        "tokens": tokens,
        "merges": merges,
        "types": [1] * (len(alphabet) + len(merged)) + [3] * len(specials),
        "ids": {"eos": tokens.index("<|im_end|>"), "pad": tokens.index("<|endoftext|>")},
    }


def _layer_shapes(spec: TinyArch) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (HIDDEN,),
        "attn_q": (spec.heads * spec.head_dim, HIDDEN),
        "attn_k": (spec.kv_heads * spec.head_dim, HIDDEN),
        "attn_v": (spec.kv_heads * spec.head_dim, HIDDEN),
        "attn_output": (HIDDEN, spec.heads * spec.head_dim),
        "ffn_norm": (HIDDEN,),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    if spec.qk_norm:
        shapes |= {"attn_q_norm": (spec.head_dim,), "attn_k_norm": (spec.head_dim,)}
    if spec.gemma_norms:
        shapes |= {"post_attention_norm": (HIDDEN,), "post_ffw_norm": (HIDDEN,)}
    return shapes


def write_tiny_gguf(
    path: Path,
    spec: TinyArch,
    *,
    override: Callable[[str, str], str] = lambda _name, type_name: type_name,
    seed: int = 0,
) -> Path:
    """A complete small GGUF of `spec`: metadata llama.cpp writes, a sentencepiece vocabulary,
    and every tensor of the architecture (no output.weight: the LM head is tied)."""
    rng = np.random.default_rng(seed)
    vocab = _byte_level_vocab() if spec.arch == "qwen3" else _sentencepiece_vocab()
    tokens = vocab["tokens"]
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"tiny {spec.arch}")
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(spec.layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    if spec.arch == "gemma3":
        writer.add_sliding_window(64)
    writer.add_tokenizer_model(vocab["model"])
    if "pre" in vocab:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(tokens)
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    writer.add_token_types(vocab["types"])
    for kind, token_id in vocab["ids"].items():
        getattr(writer, f"add_{kind}_token_id")(token_id)

    def add(name: str, type_name: str, shape: tuple[int, ...]) -> None:
        type_name = override(name, type_name)
        if name.endswith("norm.weight"):  # near 1, as llama.cpp stores Gemma's (1 + w)
            data = (1.0 + rng.standard_normal(shape) * 0.1).astype(np.float32)
        else:
            data = _blocks(type_name, shape, rng)
        raw = None if type_name in ("F32", "F16") else Q[type_name]
        writer.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", spec.embed_type, (len(tokens), HIDDEN))
    for layer in range(spec.layers):
        types = spec.layer_types[layer] if layer < len(spec.layer_types) else {}
        for suffix, shape in _layer_shapes(spec).items():
            add(f"blk.{layer}.{suffix}.weight", types.get(suffix, "F32"), shape)
    add("output_norm.weight", "F32", (HIDDEN,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_HF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# Gemma 3 has four norms per layer; the Llama family two.
_GEMMA_LAYER_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LLAMA_LAYER_NORMS = {"ffn_norm": "post_attention_layernorm"}


def hf_name(spec: TinyArch, gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, suffix, _ = gguf_name.split(".")
    table = _HF_LAYER_NAMES | (_GEMMA_LAYER_NORMS if spec.gemma_norms else _LLAMA_LAYER_NORMS)
    return f"model.layers.{layer}.{table[suffix]}.weight"


def _written(out: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 — safe_open is not a mapping
                tensors[name] = handle.get_tensor(name)
    return tensors


@pytest.fixture(scope="module")
def gemma3_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", GEMMA3)


@pytest.fixture(scope="module")
def gemma3_dir(gemma3_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma3-hf")
    convert_gguf(gemma3_file, out, overwrite=True)
    return out


def test_the_tiny_file_holds_every_supported_type(gemma3_file: Path) -> None:
    held = {tensor.tensor_type.name for tensor in gguf.GGUFReader(str(gemma3_file)).tensors}
    assert held == set(SUPPORTED_TYPES)


def test_round_trip_names_shapes_and_values(gemma3_file: Path, gemma3_dir: Path) -> None:
    written = _written(gemma3_dir)
    reader = gguf.GGUFReader(str(gemma3_file))
    assert set(written) == {hf_name(GEMMA3, t.name) for t in reader.tensors}
    own_float = {"F16": torch.float16, "BF16": torch.bfloat16}
    for tensor in reader.tensors:
        name = hf_name(GEMMA3, tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        expected = torch.from_numpy(
            np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        ).reshape(shape)
        if tensor.name.endswith("norm.weight"):
            expected = expected - 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        dtype = own_float.get(tensor.tensor_type.name, torch.float32)
        got = written[name]
        assert got.dtype == dtype, name
        assert tuple(got.shape) == shape, name
        # Exact: the converter writes gguf's own dequantized numbers in the tensor's own type.
        assert torch.equal(got, expected.to(dtype)), f"{name} ({tensor.tensor_type.name})"


def test_the_checked_loader_accepts_the_result(gemma3_file: Path, gemma3_dir: Path) -> None:
    reader = gguf.GGUFReader(str(gemma3_file))
    expected = {
        hf_name(GEMMA3, t.name): TensorSpec(tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors
    }
    weights = load_checked(
        gemma3_dir, expected, stored_tensors(gemma3_dir), torch.device("cpu"), torch.float32
    )
    assert set(weights) == set(expected)


def _hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("spec", [GEMMA3, LLAMA, QWEN3], ids=lambda s: s.arch)
def test_same_model_as_transformers_own_gguf_load(spec: TinyArch, tmp_path: Path) -> None:
    """Every tensor and the logits of the converted directory equal transformers' GGUF load
    (Llama's q/k rows are stored interleaved: this is where their order is checked)."""
    file = write_tiny_gguf(tmp_path / f"tiny-{spec.arch}.gguf", spec, seed=1)
    out = tmp_path / "hf"
    convert_gguf(file, out)
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=file.name, dtype=torch.float32
    )
    mine, reference = _hf_state(ours), _hf_state(theirs)
    assert set(mine) == set(reference)
    differing = [name for name in reference if not torch.equal(mine[name], reference[name])]
    assert differing == []
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    text = "the cat in the hat"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tokenizer(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_dtype_choice_casts_every_tensor(gemma3_file: Path, tmp_path: Path) -> None:
    result = convert_gguf(gemma3_file, tmp_path / "bf16", dtype=torch.bfloat16)
    written = _written(tmp_path / "bf16")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert result.dtypes == {"bfloat16": len(written)}


def test_shards_and_overwrite(gemma3_file: Path, gemma3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    (out / "model.safetensors").write_bytes(b"stale")
    with pytest.raises(GGUFError, match="not empty"):
        convert_gguf(gemma3_file, out)
    result = convert_gguf(gemma3_file, out, overwrite=True, shard_bytes=1 << 20)
    assert len(result.weight_files) > 1
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    assert (out / "notes.txt").read_text() == "kept"
    sharded, whole = _written(out), _written(gemma3_dir)
    assert set(sharded) == set(whole)
    assert all(torch.equal(sharded[name], whole[name]) for name in whole)


def test_unsupported_types_refused_by_name_before_writing(tmp_path: Path) -> None:
    refused = {"blk.0.attn_q.weight": "IQ4_NL", "blk.1.ffn_up.weight": "TQ2_0"}
    file = write_tiny_gguf(
        tmp_path / "bad.gguf", GEMMA3, override=lambda name, type_name: refused.get(name, type_name)
    )
    out = tmp_path / "out"
    with pytest.raises(GGUFTensorsError) as caught:
        convert_gguf(file, out)
    message = str(caught.value)
    for name, type_name in refused.items():
        assert f"{name}: GGUF type {type_name} is not supported" in message
    assert len(caught.value.problems) == len(refused)
    assert not out.exists()


def test_unsupported_architecture_refused_by_name(tmp_path: Path) -> None:
    file = write_tiny_gguf(tmp_path / "phi.gguf", TinyArch("phi3", heads=4, kv_heads=2, head_dim=64))
    with pytest.raises(GGUFError, match=r"general\.architecture 'phi3' is not supported"):
        convert_gguf(file, tmp_path / "out")


def test_a_tensor_with_no_hf_counterpart_is_named(tmp_path: Path) -> None:
    # A Gemma-shaped layer in a Llama file: the extra norms stand for no Llama tensor.
    spec = TinyArch("llama", heads=4, kv_heads=2, head_dim=64, gemma_norms=True)
    file = write_tiny_gguf(tmp_path / "extra.gguf", spec)
    with pytest.raises(GGUFTensorsError) as caught:
        convert_gguf(file, tmp_path / "out")
    assert any(
        p.startswith("blk.0.post_ffw_norm.weight: no Hugging Face tensor") for p in caught.value.problems
    )
    assert len(caught.value.problems) == 2 * spec.layers  # two extra norms per layer
    assert list((tmp_path / "out").iterdir()) == []  # the config written before the check is gone


class _Recorder:
    def __init__(self) -> None:
        self.tasks: list[str] = []
        self.advanced = 0

    def start(self, label: str, total: float) -> None:
        self.tasks.append(label)

    def advance(self, detail: str = "", amount: float = 1) -> None:
        self.advanced += 1

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        pass


def test_cache_converts_a_file_once(
    gemma3_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    recorder = _Recorder()
    target = converted_checkpoint(gemma3_file, recorder)
    assert target.parent == tmp_path / "cache" / "gguf"
    assert recorder.tasks == [f"converting {gemma3_file.name}"]
    assert recorder.advanced == len(stored_tensors(target))
    again = _Recorder()
    assert converted_checkpoint(gemma3_file, again) == target
    assert again.tasks == []
    # Leftover staging directories would mean a conversion was not renamed into place (the lock file
    # beside the directory stays, as huggingface-hub's do).
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, f".{target.name}.lock"])
    stat = gemma3_file.stat()
    os.utime(gemma3_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert converted_checkpoint(gemma3_file) != target


def test_load_model_serves_a_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    file = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", QWEN3)
    loaded = load_model(str(file))
    assert loaded.max_model_len == 1024  # the file's qwen3.context_length
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("the cat")).endswith("the cat")
    bad = write_tiny_gguf(
        tmp_path / "bad.gguf", QWEN3, override=lambda name, t: "IQ4_NL" if "attn_q." in name else t
    )
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight: GGUF type IQ4_NL"):
        load_model(str(bad))


def test_convert_command(gemma3_file: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "cli"
    result = runner.invoke(
        app, ["convert", "gguf", str(gemma3_file), "--out", str(out), "--dtype", "float16"]
    )
    assert result.exit_code == 0, result.output
    assert {t.dtype for t in _written(out).values()} == {torch.float16}
    again = runner.invoke(app, ["convert", "gguf", str(gemma3_file), "--out", str(out)])
    assert again.exit_code == 2
    assert "not empty" in again.output
