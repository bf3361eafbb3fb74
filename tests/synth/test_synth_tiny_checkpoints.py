"""`infer synth FAMILY --preset tiny`: a checkpoint transformers loads offline, deterministic for a
seed, with every architectural feature of the family present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from infer_cli.main import app

FAMILIES = ("qwen3", "gemma3", "gemma4", "qwen35")
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def synth(family: str, out: Path, *extra: str) -> None:
    result = CliRunner().invoke(app, ["synth", family, "--preset", "tiny", "--out", str(out), *extra])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    """Per family: two runs with seed 7 and one with seed 8."""
    made: dict[str, tuple[Path, Path, Path]] = {}
    for family in FAMILIES:
        base = tmp_path_factory.mktemp(family)
        runs = (base / "seed7-a", base / "seed7-b", base / "seed8")
        for out, seed in zip(runs, ("7", "7", "8"), strict=True):
            synth(family, out, "--seed", seed)
        made[family] = runs
    return made


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                loaded[name] = handle.get_tensor(name)
    return loaded


def last_logits(checkpoint: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    batch = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.isfinite(logits).all()
    return logits[0, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_gives_identical_files_and_logits(
    checkpoints: dict[str, tuple[Path, Path, Path]], family: str
) -> None:
    first, second, other_seed = checkpoints[family]
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert torch.equal(last_logits(first), last_logits(second))
    # Another seed draws other weights.
    assert not torch.equal(
        tensors(first)["model.embed_tokens.weight"], tensors(other_seed)["model.embed_tokens.weight"]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoints_are_a_few_megabytes(
    checkpoints: dict[str, tuple[Path, Path, Path]], family: str
) -> None:
    size = sum(path.stat().st_size for path in checkpoints[family][0].iterdir())
    assert size < 4_000_000


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        (
            "qwen3",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "qwen35",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "gemma3",
            "<bos><start_of_turn>user\nBe brief.\n\nHello there!<end_of_turn>\n<start_of_turn>model\n",
        ),
        ("gemma4", "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHello there!<turn|>\n<|turn>model\n"),
    ],
)
def test_the_chat_template_renders(
    checkpoints: dict[str, tuple[Path, Path, Path]], family: str, expected: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family][0])
    assert tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == expected
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids) == expected


def test_generation_config_and_token_ids_agree_with_the_tokenizer(
    checkpoints: dict[str, tuple[Path, Path, Path]],
) -> None:
    from transformers import AutoTokenizer

    expected_eos = {
        "qwen3": ["<|im_end|>", "<|endoftext|>"],
        "qwen35": ["<|im_end|>", "<|endoftext|>"],
        "gemma3": ["<eos>", "<end_of_turn>"],
        "gemma4": ["<eos>", "<turn|>", "<|tool_response>"],
    }
    for family, tokens in expected_eos.items():
        checkpoint = checkpoints[family][0]
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        generation = json.loads((checkpoint / "generation_config.json").read_text())
        assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids(tokens)
    gemma = json.loads((checkpoints["gemma4"][0] / "config.json").read_text())
    assert (gemma["pad_token_id"], gemma["eos_token_id"], gemma["bos_token_id"]) == (0, 1, 2)
    gemma_tokenizer = AutoTokenizer.from_pretrained(checkpoints["gemma4"][0])
    assert gemma_tokenizer.convert_tokens_to_ids(["<|turn>", "<turn|>"]) == [105, 106]
    assert gemma_tokenizer("hi")["input_ids"][0] == 2  # Gemma prepends <bos> on plain encode


def test_tiny_gemma4_has_every_architectural_feature(checkpoints: dict[str, tuple[Path, Path, Path]]) -> None:
    from transformers import AutoConfig

    checkpoint = checkpoints["gemma4"][0]
    raw = json.loads((checkpoint / "config.json").read_text())
    assert raw["model_type"] == "gemma4_text"
    assert set(raw["layer_types"]) == {"sliding_attention", "full_attention"}
    assert raw["layer_types"][-1] == "full_attention"
    assert 8 <= raw["sliding_window"] <= 16
    assert raw["attention_k_eq_v"] is True and raw["tie_word_embeddings"] is True
    assert raw["final_logit_softcapping"] == 30.0
    assert raw["global_head_dim"] != raw["head_dim"]
    full_rope = raw["rope_parameters"]["full_attention"]
    assert full_rope["rope_type"] == "proportional" and full_rope["partial_rotary_factor"] == 0.25
    config = AutoConfig.from_pretrained(checkpoint)
    assert config.final_logit_softcapping == 30.0

    weights = tensors(checkpoint)
    assert "lm_head.weight" not in weights  # tied to the embedding
    for layer, kind in enumerate(raw["layer_types"]):
        prefix = f"model.layers.{layer}.self_attn"
        if kind == "full_attention":
            # K = V: no v_proj; one K head of the global head dim.
            assert f"{prefix}.v_proj.weight" not in weights
            assert weights[f"{prefix}.k_proj.weight"].shape == (
                raw["num_global_key_value_heads"] * raw["global_head_dim"],
                64,
            )
        else:
            assert weights[f"{prefix}.v_proj.weight"].shape == (
                raw["num_key_value_heads"] * raw["head_dim"],
                64,
            )
    scalars = [weights[f"model.layers.{i}.layer_scalar"].item() for i in range(len(raw["layer_types"]))]
    assert all(0.5 <= s <= 1.5 for s in scalars) and len(set(scalars)) == len(scalars)
    # Gemma 4 attends at scale 1: its Q and K norm weights centre on head_dim^(-1/4), so Q·K of
    # normalised heads has a standard deviation near 1 (family comment in models/synth/families/gemma4.py).
    for layer, kind in enumerate(raw["layer_types"]):
        head_dim = raw["global_head_dim"] if kind == "full_attention" else raw["head_dim"]
        for norm in ("q_norm", "k_norm"):
            weight = weights[f"model.layers.{layer}.self_attn.{norm}.weight"]
            assert weight.shape == (head_dim,)
            assert abs(float(weight.mean()) - head_dim**-0.25) < 0.1 * head_dim**-0.25, (layer, norm)
        assert abs(float(weights[f"model.layers.{layer}.input_layernorm.weight"].mean()) - 1) < 0.1


def test_tiny_qwen35_has_every_architectural_feature(checkpoints: dict[str, tuple[Path, Path, Path]]) -> None:
    checkpoint = checkpoints["qwen35"][0]
    raw = json.loads((checkpoint / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text"
    assert set(raw["layer_types"]) == {"linear_attention", "full_attention"}
    assert raw["attn_output_gate"] is True
    assert raw["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert raw["linear_num_value_heads"] > raw["linear_num_key_heads"]
    weights = tensors(checkpoint)
    full = raw["layer_types"].index("full_attention")
    linear = raw["layer_types"].index("linear_attention")
    heads, head_dim = raw["num_attention_heads"], raw["head_dim"]
    # The output gate doubles q_proj.
    assert weights[f"model.layers.{full}.self_attn.q_proj.weight"].shape == (
        2 * heads * head_dim,
        raw["hidden_size"],
    )
    assert (
        weights[f"model.layers.{linear}.linear_attn.conv1d.weight"].shape[-1] == raw["linear_conv_kernel_dim"]
    )
    # (1 + w) norms centre on 0, the gated DeltaNet norm (w) on 1; A_log is log of U(1, 16).
    assert weights["model.norm.weight"].mean().abs() < 0.1
    assert (weights[f"model.layers.{linear}.linear_attn.norm.weight"].mean() - 1).abs() < 0.1
    a_log = weights[f"model.layers.{linear}.linear_attn.A_log"]
    assert (a_log >= 0).all() and (a_log <= torch.log(torch.tensor(16.0))).all()


def test_tiny_qwen3_keeps_its_untied_head(checkpoints: dict[str, tuple[Path, Path, Path]]) -> None:
    checkpoint = checkpoints["qwen3"][0]
    raw = json.loads((checkpoint / "config.json").read_text())
    assert raw["tie_word_embeddings"] is False
    assert raw["num_attention_heads"] * raw["head_dim"] != raw["hidden_size"]
    weights = tensors(checkpoint)
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_sharded_bfloat16_output_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sharded"
    synth("qwen3", out, "--dtype", "bfloat16", "--shard-gb", "0.0002")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    weights = tensors(out)
    assert set(weights) == set(index["weight_map"])
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.dtype == torch.bfloat16 or str(model.config.dtype) == "bfloat16"


def test_a_non_empty_output_is_refused_unless_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(app, ["synth", "gemma4", "--preset", "tiny", "--out", str(out)])
    assert result.exit_code == 2 and "not empty" in result.output
    synth("gemma4", out, "--overwrite")
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "model.safetensors").is_file()


def test_unknown_family_and_preset_are_named() -> None:
    result = CliRunner().invoke(app, ["synth", "llama", "--preset", "tiny", "--out", "/nonexistent/x"])
    assert result.exit_code == 2 and "unknown family 'llama'" in result.output and "qwen35" in result.output
    result = CliRunner().invoke(app, ["synth", "gemma4", "--preset", "7b", "--out", "/nonexistent/x"])
    assert result.exit_code == 2 and "no preset '7b'" in result.output and "31b" in result.output


def test_a_missing_transformers_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def without_transformers(name: str, *args: object, **kwargs: object) -> object:
        return None if name == "transformers" else real_find_spec(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_transformers)
    result = CliRunner().invoke(app, ["synth", "qwen3", "--preset", "tiny", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "needs the 'transformers' package" in result.output and "pip install" in result.output
    assert not (tmp_path / "x").exists()


def test_too_little_disk_is_refused_before_any_weight_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))
    out = tmp_path / "full-disk"
    result = CliRunner().invoke(app, ["synth", "qwen35", "--preset", "tiny", "--out", str(out)])
    assert result.exit_code == 2
    assert "GB of disk" in result.output and "is free" in result.output
    assert list(out.glob("*.safetensors")) == []
