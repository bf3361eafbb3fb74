"""`infer serve` over the tiny synthetic Gemma 4 (fp32, CPU): the OpenAI client gets exactly the
greedy text transformers generates, for prompts inside and past the sliding window."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from gates.harness.hf_reference import hf_greedy, hf_model
from gates.harness.serving import random_prompt
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.hf_tokenizer import HFTokenizer
from models.registry import ChatMessage, ModelOptions, load_model


@pytest.fixture(scope="module")
def gemma4_server(tiny_gemma4: Path) -> Iterator[str]:
    model = load_model(str(tiny_gemma4), ModelOptions(engine=EngineConfig(num_kv_pages=128), device="cpu"))
    app = create_app(model, ServerSettings(served_model_name="tiny-gemma4"))
    with BackgroundServer(app) as server:
        yield server.base_url


def _hf_greedy(checkpoint: Path, prompt: list[int], new_tokens: int) -> list[int]:
    return hf_greedy(hf_model(checkpoint, torch.device("cpu"), torch.float32), prompt, new_tokens)


def test_served_greedy_matches_transformers_across_the_window(gemma4_server: str, tiny_gemma4: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{gemma4_server}/v1", api_key="unused", max_retries=0, timeout=60)
    tokenizer = HFTokenizer(tiny_gemma4)
    config = json.loads((tiny_gemma4 / "config.json").read_text())
    window = config["sliding_window"]
    new_tokens = window + 4

    text = "The quick brown fox jumps over the lazy dog"
    chat_prompt = tokenizer.render_chat([ChatMessage("user", text)])
    assert chat_prompt.count(config["bos_token_id"]) == 1, "BOS comes from the template, once"
    chat = client.chat.completions.create(
        model="tiny-gemma4",
        messages=[{"role": "user", "content": text}],
        max_tokens=new_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_prompt)
    want = tokenizer.decode(_hf_greedy(tiny_gemma4, chat_prompt, new_tokens))
    assert chat.choices[0].message.content == want

    for length in (window - 3, 3 * window + 5):
        prompt = list(random_prompt(length, seed=length, vocab_size=config["vocab_size"]))
        done = client.completions.create(
            model="tiny-gemma4",
            prompt=prompt,
            max_tokens=new_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert done.usage is not None and done.usage.completion_tokens == new_tokens
        want = tokenizer.decode(_hf_greedy(tiny_gemma4, prompt, new_tokens))
        assert done.choices[0].text == want, f"prompt of {length} tokens (W={window})"
