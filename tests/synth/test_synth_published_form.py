"""`infer synth qwen35 --form published`: the published `qwen3_5` layout (the text form's tower
nested beside a vision tower, with processor files), which transformers loads as
Qwen3_5ForConditionalGeneration and infer serves exactly as the text form of the same seed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from engine.contract import Request
from gates.harness.hf_reference import hf_greedy
from gates.harness.serving import drive, greedy, load_for_gate, random_prompt, score
from infer_cli.main import app
from models.synth.config_build import config_body, published_config_body
from models.synth.families import FAMILIES, get_family
from models.synth.multimodal import transformers_class, vision_config_body
from models.synth.tensors import plan_tensors
from models.synth.tokenizer_build import BuiltTokenizer
from models.synth.writer import SynthRequest, synthesize

BuildTokenizer = Callable[[str, str, int], BuiltTokenizer]
FORM = get_family("qwen35").multimodal
assert FORM is not None
SEED = 5
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, naïve café!"}]
# Files both forms write from the same tokenizer and roles: the same bytes.
SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def synth_cli(out: Path, *extra: str) -> Any:
    return CliRunner().invoke(
        app, ["synth", "qwen35", "--preset", "tiny", "--out", str(out), "--seed", str(SEED), *extra]
    )


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny preset at one seed: the text form, the published form through the CLI, and the
    published form again through the API."""
    base = tmp_path_factory.mktemp("qwen35-forms")
    result = synth_cli(base / "published", "--form", "published")
    assert result.exit_code == 0, result.output
    synthesize(SynthRequest(family="qwen35", preset="tiny", out=base / "text", seed=SEED, device="cpu"))
    synthesize(
        SynthRequest(
            family="qwen35", preset="tiny", out=base / "again", seed=SEED, device="cpu", form="published"
        )
    )
    return {"text": base / "text", "published": base / "published", "again": base / "again"}


def read_json(path: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def test_config_nests_the_text_config_beside_transformers_default_vision_tower(
    forms: dict[str, Path],
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    text = read_json(forms["text"] / "config.json")
    outer = read_json(forms["published"] / "config.json")
    assert outer["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert outer["model_type"] == "qwen3_5"
    # The text form's config.json, field for field, less what only the outer config carries.
    assert outer["text_config"] == {
        key: value for key, value in text.items() if key not in ("architectures", "transformers_version")
    }
    assert outer["text_config"]["model_type"] == "qwen3_5_text"
    assert (outer["tie_word_embeddings"], outer["dtype"]) == (text["tie_word_embeddings"], text["dtype"])

    vision = outer["vision_config"]
    assert vision["out_hidden_size"] == text["hidden_size"]
    tiny = dict(FORM.vision_fields["tiny"])
    assert {key: vision[key] for key in tiny} == tiny and tiny["depth"] <= 2
    defaults = transformers_class(FORM.vision_config_class)().to_dict()
    for key, value in vision.items():
        if key not in (*tiny, "out_hidden_size"):
            assert value == defaults[key], (
                f"vision_config.{key}: {value!r}, transformers' default {defaults[key]!r}"
            )

    tokenizer = AutoTokenizer.from_pretrained(forms["published"])
    for key, content in FORM.token_fields.items():
        assert outer[key] == tokenizer.convert_tokens_to_ids(content), key

    config = AutoConfig.from_pretrained(forms["published"])
    assert type(config).__name__ == "Qwen3_5Config"
    assert config.text_config.hidden_size == config.vision_config.out_hidden_size == text["hidden_size"]
    assert config.text_config.layer_types == text["layer_types"]


def test_text_tensors_are_the_text_form_s_bit_for_bit(forms: dict[str, Path]) -> None:
    text, published = tensors(forms["text"]), tensors(forms["published"])
    nested = {name.replace("model.", "model.language_model.", 1): t for name, t in text.items()}
    vision = {name: t for name, t in published.items() if name not in nested}
    assert set(nested) <= set(published)
    assert vision and all(name.startswith("model.visual.") for name in vision), sorted(vision)
    assert not any(name.startswith("mtp.") for name in published)
    assert "lm_head.weight" not in published  # tied, as the text form
    for name, tensor in nested.items():
        assert published[name].dtype == tensor.dtype and torch.equal(published[name], tensor), name
    for name in SHARED_FILES:
        assert (forms["text"] / name).read_bytes() == (forms["published"] / name).read_bytes(), name
    # Same seed, same bits: the CLI and the API write the same published checkpoint.
    for item in forms["published"].iterdir():
        assert item.read_bytes() == (forms["again"] / item.name).read_bytes(), item.name

    # The vision tower's LayerNorms scale by w (centred on 1); its biases are drawn, not zero.
    for name in ("model.visual.blocks.1.norm1.weight", "model.visual.merger.norm.weight"):
        assert abs(float(vision[name].mean()) - 1) < 0.1, name
    assert float(vision["model.visual.blocks.0.attn.qkv.bias"].abs().max()) > 0
    merger_out = vision["model.visual.merger.linear_fc2.weight"]
    assert merger_out.shape[0] == read_json(forms["text"] / "config.json")["hidden_size"]


def test_transformers_loads_it_offline_with_the_text_form_s_logits(forms: dict[str, Path]) -> None:
    from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoTokenizer

    model_class = transformers_class("transformers:" + FORM.architecture)
    model, info = model_class.from_pretrained(forms["published"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    text_model = AutoModelForCausalLM.from_pretrained(forms["text"])
    tokenizer = AutoTokenizer.from_pretrained(forms["published"])
    batch = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    # AutoModelForCausalLM (what the gates' references load) takes the text tower alone.
    tower_only = AutoModelForCausalLM.from_pretrained(forms["published"])
    assert type(tower_only).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        logits = model(**batch).logits
        assert torch.isfinite(logits).all()
        assert torch.equal(logits, text_model(**batch).logits)
        assert torch.equal(logits, tower_only(**batch).logits)

        # The image processor cuts the patches the tower's patch embedding takes, and the merger
        # hands the text tower its own width.
        from PIL import Image

        pixels = torch.rand(48, 80, 3, generator=torch.Generator().manual_seed(0))
        image = Image.fromarray((pixels * 255).to(torch.uint8).numpy())
        processed = AutoImageProcessor.from_pretrained(forms["published"])(
            images=[image], return_tensors="pt"
        )
        features = model.model.get_image_features(
            pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"]
        ).pooler_output
    merge = model.config.vision_config.spatial_merge_size
    expected_tokens = int(processed["image_grid_thw"][0].prod()) // merge**2
    assert features[0].shape == (expected_tokens, model.config.text_config.hidden_size)
    assert torch.isfinite(features[0]).all()


def test_processor_files_load_offline_through_transformers(forms: dict[str, Path]) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    published, text = forms["published"], forms["text"]
    vision = read_json(published / "config.json")["vision_config"]
    # transformers maps the model type to this processor, of these parts.
    processor_class = transformers_class(FORM.processor.processor)
    assert PROCESSOR_MAPPING_NAMES[FORM.model_type] == processor_class.__name__
    assert set(processor_class.get_attributes()) == {"image_processor", "tokenizer", "video_processor"}

    # The tokenizer transformers picks for `qwen3_5` (its own Qwen3.5 class) encodes and renders
    # exactly as the text form's.
    nested, flat = AutoTokenizer.from_pretrained(published), AutoTokenizer.from_pretrained(text)
    sample = "Héllo wörld, naïve café 12345 <|im_start|>user\nhi<|im_end|>\n<think>x</think>"
    assert nested(sample)["input_ids"] == flat(sample)["input_ids"]
    rendered = nested.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert rendered == flat.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert (published / "chat_template.jinja").read_text() == read_json(text / "tokenizer_config.json")[
        "chat_template"
    ]

    image = AutoImageProcessor.from_pretrained(published)
    video = transformers_class(FORM.processor.video_processor).from_pretrained(published)
    for loaded in (image, video):
        assert (loaded.patch_size, loaded.temporal_patch_size, loaded.merge_size) == (
            vision["patch_size"],
            vision["temporal_patch_size"],
            vision["spatial_merge_size"],
        )
    # Saved under the backend-neutral names AutoImageProcessor / AutoVideoProcessor resolve.
    assert (
        read_json(published / "preprocessor_config.json")["image_processor_type"] == "Qwen2VLImageProcessor"
    )
    assert (
        read_json(published / "video_preprocessor_config.json")["video_processor_type"]
        == "Qwen3VLVideoProcessor"
    )


def test_auto_processor_loads_it_offline(forms: dict[str, Path]) -> None:
    """transformers builds Qwen3VLProcessor's video part only with torchvision; the CPU test
    environment has none (its PyPI wheels need CUDA torch), so this runs where it is installed."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(forms["published"])
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.image_token_id == read_json(forms["published"] / "config.json")["image_token_id"]


def test_infer_serves_it_as_the_text_form_and_as_transformers_generates(forms: dict[str, Path]) -> None:
    published = load_for_gate(forms["published"], num_kv_pages=64)
    text = load_for_gate(forms["text"], num_kv_pages=64)
    vocab_size = read_json(forms["text"] / "config.json")["vocab_size"]
    tokens = random_prompt(40, seed=4, vocab_size=vocab_size)
    assert torch.equal(score(published, tokens), score(text, tokens))

    model_class = transformers_class("transformers:" + FORM.architecture)
    reference = model_class.from_pretrained(forms["published"]).eval()
    for i, length in enumerate((13, 70)):
        prompt = random_prompt(length, seed=20 + i, vocab_size=vocab_size)
        got = drive(published, [Request(f"p{i}", prompt, greedy(8))])[f"p{i}"].tokens
        assert got == hf_greedy(reference, prompt, 8), f"prompt {i}"


def test_form_is_refused_by_name_for_a_family_without_it(tmp_path: Path) -> None:
    out = tmp_path / "gemma4"
    result = CliRunner().invoke(
        app, ["synth", "gemma4", "--preset", "tiny", "--out", str(out), "--form", "published"]
    )
    assert result.exit_code == 2
    assert (
        "--form published" in result.output and "gemma4" in result.output and "forms: text" in result.output
    )
    assert not out.exists()


def test_overwriting_with_the_text_form_removes_the_processor_files(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    assert synth_cli(out, "--form", "published").exit_code == 0
    assert (out / "preprocessor_config.json").is_file()
    result = synth_cli(out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert read_json(out / "config.json")["model_type"] == "qwen3_5_text"
    assert not any(
        (out / name).exists() for name in ("preprocessor_config.json", "video_preprocessor_config.json")
    )


@pytest.mark.parametrize(("preset", "hidden", "untied"), [("4b", 2560, False), ("9b", 4096, True)])
def test_published_sizes_nest_the_published_text_tower(
    tokenizer_for: BuildTokenizer, tmp_path: Path, preset: str, hidden: int, untied: bool
) -> None:
    """Config and meta-device tensors only; the real vocabulary's tokenizer as transformers loads
    it for `qwen3_5` (what a server uses) encodes as the one written."""
    import transformers
    from transformers import AutoTokenizer

    family = get_family("qwen35")
    built = tokenizer_for("qwen35", "real", 248320)
    text = config_body(family, family.preset(preset), 248320, built, "bfloat16", transformers.__version__)
    vision = vision_config_body(FORM, preset, hidden)
    outer = published_config_body(family, FORM, text, vision, built)
    assert (outer["image_token_id"], outer["video_token_id"]) == (248056, 248057)
    assert (outer["vision_start_token_id"], outer["vision_end_token_id"]) == (248053, 248054)
    assert outer["tie_word_embeddings"] is not untied and outer["text_config"]["hidden_size"] == hidden
    defaults = transformers_class(FORM.vision_config_class)()
    assert vision["out_hidden_size"] == hidden and vision["depth"] == defaults.depth
    assert vision["hidden_size"] == defaults.hidden_size

    (tmp_path / "config.json").write_text(json.dumps(outer))
    specs = {spec.name: spec for spec in plan_tensors(tmp_path, torch.bfloat16)}
    assert specs["model.language_model.layers.31.self_attn.q_proj.weight"].shape == (2 * 16 * 256, hidden)
    assert specs["model.language_model.layers.0.linear_attn.A_log"].shape == (32,)
    assert specs["model.visual.merger.linear_fc2.weight"].shape[0] == hidden
    assert f"model.visual.blocks.{defaults.depth - 1}.attn.qkv.weight" in specs
    assert ("lm_head.weight" in specs) is untied
    assert {name.split(".")[1] for name in specs if name != "lm_head.weight"} == {"language_model", "visual"}

    (tmp_path / "tokenizer.json").write_text(built.to_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(built.config)))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for sample in (
        "Hello world, naïve café — 12345!",
        "ゆっくり 😀 العربية देवनागरी  \n\n  x",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert loaded(sample)["input_ids"] == built.tokenizer.encode(sample).ids, sample


def test_every_preset_of_a_family_with_the_form_has_its_vision_tower() -> None:
    for family in FAMILIES.values():
        form = family.multimodal
        assert family.forms() == (("text", "published") if form is not None else ("text",))
        if form is not None:
            assert set(form.vision_fields) == set(family.presets), family.name
