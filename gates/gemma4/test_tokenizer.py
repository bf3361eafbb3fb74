"""infer's tokenizer side agrees with transformers': special ids, EOS set and the chat template."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from models.gemma4.config import Gemma4Config
from models.hf_tokenizer import HFTokenizer
from models.registry import ChatMessage

_CONVERSATION = (
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "Name a prime number."),
    ChatMessage("assistant", "Seven."),
    ChatMessage("user", "Another one, past the window of a sliding layer?"),
)


def _hf_tokenizer(checkpoint: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


def test_special_token_ids_match_hf(checkpoint_path: Path, gemma4_config: Gemma4Config) -> None:
    from transformers import GenerationConfig

    hf = _hf_tokenizer(checkpoint_path)
    ours = HFTokenizer(checkpoint_path)
    assert ours.bos_token == hf.bos_token and ours.eos_token == hf.eos_token
    assert ours.bos_token is not None and ours.token_id(ours.bos_token) == hf.bos_token_id
    assert ours.eos_token is not None and ours.token_id(ours.eos_token) == hf.eos_token_id
    assert gemma4_config.bos_token_id in (None, hf.bos_token_id)
    generation = GenerationConfig.from_pretrained(str(checkpoint_path))
    eos = generation.eos_token_id
    want = set(eos if isinstance(eos, list) else [eos])
    assert set(gemma4_config.eos_token_ids) == want, (
        f"EOS {sorted(gemma4_config.eos_token_ids)} vs {sorted(want)}"
    )
    suppress = set(getattr(generation, "suppress_tokens", None) or ())
    assert set(gemma4_config.suppress_token_ids) == suppress


def test_chat_template_matches_hf(checkpoint_path: Path) -> None:
    """Same ids as transformers' apply_chat_template, with exactly one BOS (from the template)."""
    hf = _hf_tokenizer(checkpoint_path)
    ours = HFTokenizer(checkpoint_path)
    messages = [{"role": m.role, "content": m.content} for m in _CONVERSATION]
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf(rendered, add_special_tokens=False)["input_ids"]
    got = ours.render_chat(_CONVERSATION)
    assert got == want, f"infer {got}\ntransformers {want}"
    assert got[0] == hf.bos_token_id and got.count(hf.bos_token_id) == 1, got[:4]
