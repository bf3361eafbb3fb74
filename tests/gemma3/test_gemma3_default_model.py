"""`infer serve` without --model: the embedded Gemma 3 270M, with the Gemma turn template and
`<end_of_turn>` as an EOS added to its converted directory. No forward runs here: what is checked
is what the argument resolves to and what the directory states."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

import infer_cli.serve_cmd
from infer_cli.main import app
from models.chat_templates import GEMMA3
from models.gemma3.config import parse_gemma3_config
from models.gguf import GGUFError, embedded_gemma3_dir
from models.gguf.embedded import add_gemma3_chat
from models.hf_tokenizer import HFTokenizer
from models.registry import DEFAULT_MODEL, ChatMessage, ModelLoadError, ModelOptions, resolve_checkpoint


def test_serve_without_model_asks_for_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def refuse(spec: str, options: ModelOptions) -> None:
        asked.append(spec)
        raise ModelLoadError("stopped before loading")

    monkeypatch.setattr(infer_cli.serve_cmd, "load_model", refuse)
    result = CliRunner().invoke(app, ["serve", "--port", "0"])
    assert result.exit_code == 2, result.output
    assert asked == [DEFAULT_MODEL]


def test_the_default_resolves_to_the_embedded_gemma3_dir() -> None:
    resolved = resolve_checkpoint(DEFAULT_MODEL)
    assert resolved.path == embedded_gemma3_dir()
    assert resolved.name == DEFAULT_MODEL
    config = json.loads((resolved.path / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == (
        "gemma3_text",
        640,
        18,
    )
    raw = Tokenizer.from_file(str(resolved.path / "tokenizer.json"))
    end_of_turn = raw.token_to_id("<end_of_turn>")
    assert end_of_turn is not None
    assert parse_gemma3_config(resolved.path).eos_token_ids == frozenset({1, end_of_turn})
    tokenizer = HFTokenizer(resolved.path)
    assert tokenizer.chat_template == GEMMA3
    ids = tokenizer.render_chat([ChatMessage("user", "Hello")])
    assert (
        raw.decode(ids, skip_special_tokens=False)
        == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    )


def test_add_gemma3_chat_reads_the_id_and_keeps_the_files_eos(tiny_gemma3: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_gemma3, checkpoint)
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"})
    )
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 1}))
    add_gemma3_chat(checkpoint)
    end_of_turn = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id("<end_of_turn>")
    written = json.loads((checkpoint / "generation_config.json").read_text())
    assert written["eos_token_id"] == [1, end_of_turn]
    assert HFTokenizer(checkpoint).chat_template == GEMMA3
    add_gemma3_chat(checkpoint)  # the id is added once
    assert json.loads((checkpoint / "generation_config.json").read_text())["eos_token_id"] == [1, end_of_turn]


def test_add_gemma3_chat_refuses_a_tokenizer_without_end_of_turn(tiny_qwen3: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3, checkpoint)
    with pytest.raises(GGUFError, match="'<end_of_turn>'"):
        add_gemma3_chat(checkpoint)
