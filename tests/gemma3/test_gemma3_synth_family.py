"""`infer synth gemma3 --preset tiny`: transformers loads it as Gemma3ForCausalLM with exactly the
tensors the line expects, and its chat template renders Gemma 3's turns."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.checkpoint import stored_tensors
from models.gemma3.config import parse_gemma3_config
from models.gemma3.weights import expected_tensors, text_prefix
from models.hf_tokenizer import HFTokenizer
from models.registry import ChatMessage

CHAT = [
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Hello there!"),
    ChatMessage("assistant", "Hi."),
]
RENDERED = (
    "<bos><start_of_turn>user\nBe brief.\n\nHello there!<end_of_turn>\n"
    "<start_of_turn>model\nHi.<end_of_turn>\n<start_of_turn>model\n"
)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_transformers_builds_the_tensors_the_line_expects(tiny_gemma3: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_gemma3, output_loading_info=True)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = stored_tensors(tiny_gemma3)
    expected = expected_tensors(parse_gemma3_config(tiny_gemma3), text_prefix(stored))
    assert {n: s.shape for n, s in stored.items()} == {n: s.shape for n, s in expected.items()}


def test_chat_template_renders_gemma3_turns_as_transformers_does(tiny_gemma3: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_gemma3)
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == RENDERED
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ours = HFTokenizer(tiny_gemma3).render_chat(CHAT)
    assert ours == list(want) and ours.count(hf.bos_token_id) == 1
