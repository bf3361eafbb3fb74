"""`infer serve` over a Gemma 3 checkpoint (fp32, CPU): the official OpenAI client gets exactly the
greedy text transformers generates, for a chat and for completion prompts inside and past the
sliding window. The real 270M weights infer ships by default (the directory `infer serve` loads
without --model); INFER_GEMMA3_CHECKPOINT names another HF-layout copy, or is `tiny` for the tiny
synthetic checkpoint (gates/runner/ci.py reads the same variable)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from gates.gemma3.conftest import prompt
from gates.harness.hf_reference import hf_greedy, hf_model
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.gemma3.config import Gemma3Config, parse_gemma3_config
from models.hf_tokenizer import HFTokenizer
from models.registry import ChatMessage, ModelOptions, load_model

NEW_TOKENS = 24
NAME = "gemma3"


@pytest.fixture(scope="module")
def checkpoint(request: pytest.FixtureRequest) -> Path:
    chosen = os.environ.get("INFER_GEMMA3_CHECKPOINT", "").strip() or "embedded"
    if chosen == "embedded":
        from models.gguf import embedded_gemma3_dir

        return embedded_gemma3_dir()
    if chosen == "tiny":
        return Path(request.getfixturevalue("tiny_gemma3"))
    return Path(chosen)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[str]:
    model = load_model(str(checkpoint), ModelOptions(engine=EngineConfig(num_kv_pages=128), device="cpu"))
    app = create_app(model, ServerSettings(served_model_name=NAME))
    with BackgroundServer(app) as live:
        yield live.base_url


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return hf_model(checkpoint, torch.device("cpu"), torch.float32)


def test_served_greedy_matches_transformers_across_the_window(
    server: str, checkpoint: Path, reference: Any
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=600)
    tokenizer = HFTokenizer(checkpoint)
    config: Gemma3Config = parse_gemma3_config(checkpoint)
    w = config.sliding_window
    if tokenizer.chat_template is not None:  # a checkpoint saved without a template skips the chat
        text = "The quick brown fox jumps over the lazy dog"
        chat_ids = tokenizer.render_chat([ChatMessage("user", text)])
        assert chat_ids.count(config.bos_token_id) == 1, "BOS comes from the template, once"
        chat = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": text}],
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
        assert chat.choices[0].message.content == tokenizer.decode(hf_greedy(reference, chat_ids, NEW_TOKENS))
    text_prompt = "The capital of France is"
    done = client.completions.create(
        model=NAME, prompt=text_prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    want = tokenizer.decode(hf_greedy(reference, tokenizer.encode(text_prompt), NEW_TOKENS))
    assert done.choices[0].text == want, "a text prompt, encoded by the server"
    for length in (w - 3, w + 5):
        ids = list(prompt(checkpoint, config, length, seed=length))
        done = client.completions.create(
            model=NAME, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert done.usage is not None and done.usage.completion_tokens == NEW_TOKENS
        want = tokenizer.decode(hf_greedy(reference, ids, NEW_TOKENS))
        assert done.choices[0].text == want, f"prompt of {length} tokens (W={w})"
