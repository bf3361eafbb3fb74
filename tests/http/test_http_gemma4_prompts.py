"""`/v1/completions` over the tiny synthetic Gemma 4 (fp32, CPU) with text prompts: the prompt is
encoded as transformers' AutoTokenizer encodes it (with its <bos>), and the served greedy text is
what transformers `generate` gives from those ids."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from gates.harness.hf_reference import hf_greedy, hf_model
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.registry import ModelOptions, load_model

NEW_TOKENS = 8
PROMPTS = ("The quick brown fox", "Hello, who are you?")


@pytest.fixture(scope="module")
def base_url(tiny_gemma4: Path) -> Iterator[str]:
    model = load_model(str(tiny_gemma4), ModelOptions(engine=EngineConfig(num_kv_pages=64), device="cpu"))
    with BackgroundServer(create_app(model, ServerSettings(served_model_name="tiny-gemma4"))) as server:
        yield server.base_url


@pytest.fixture(scope="module")
def hf(tiny_gemma4: Path) -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_gemma4)), hf_model(
        tiny_gemma4, torch.device("cpu"), torch.float32
    )


def test_served_completion_matches_transformers_generate_with_bos(base_url: str, hf: tuple[Any, Any]) -> None:
    import openai

    tokenizer, model = hf
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        assert prompt[0] == tokenizer.bos_token_id, prompt[:3]
        done = client.completions.create(
            model="tiny-gemma4",
            prompt=text,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert done.usage is not None and done.usage.prompt_tokens == len(prompt), (
            f"{text!r}: served {done.usage} for transformers' {len(prompt)} prompt tokens"
        )
        want = tokenizer.decode(hf_greedy(model, prompt, NEW_TOKENS), skip_special_tokens=True)
        assert done.choices[0].text == want, f"{text!r}"


def test_served_prompt_that_starts_with_bos_gets_one(base_url: str, hf: tuple[Any, Any]) -> None:
    """A client that renders Gemma's turns itself: one <bos>, so the same greedy text as the chat
    endpoint gives for that conversation."""
    import openai

    tokenizer, model = hf
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert prompt[0] == tokenizer.bos_token_id and prompt[1] != tokenizer.bos_token_id
    done = client.completions.create(
        model="tiny-gemma4",
        prompt=rendered,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chat = client.chat.completions.create(
        model="tiny-gemma4",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    want = tokenizer.decode(hf_greedy(model, prompt, NEW_TOKENS), skip_special_tokens=True)
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
    assert done.choices[0].text == chat.choices[0].message.content == want
