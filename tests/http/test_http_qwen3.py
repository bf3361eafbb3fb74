"""`infer serve` over a real checkpoint (tiny synthetic Qwen3, fp32 on CPU): the official client gets
exactly the greedy tokens transformers generates from the same checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from gates.harness.hf_reference import hf_greedy, hf_model
from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.hf_tokenizer import HFTokenizer
from models.registry import ChatMessage, ModelOptions, load_model

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3_server(tiny_qwen3: Path) -> Iterator[str]:
    model = load_model(str(tiny_qwen3), ModelOptions(engine=EngineConfig(num_kv_pages=256), device="cpu"))
    app = create_app(model, ServerSettings(served_model_name="tiny-qwen3"))
    with BackgroundServer(app) as server:
        yield server.base_url


def _hf_greedy(checkpoint: Path, prompt: list[int]) -> list[int]:
    return hf_greedy(hf_model(checkpoint, torch.device("cpu"), torch.float32), prompt, NEW_TOKENS)


def test_chat_and_completion_match_transformers_greedy(qwen3_server: str, tiny_qwen3: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{qwen3_server}/v1", api_key="unused", max_retries=0, timeout=60)
    tokenizer = HFTokenizer(tiny_qwen3)
    text = "The quick brown fox jumps over the lazy dog"

    chat_prompt = tokenizer.render_chat([ChatMessage("user", text)])
    chat = client.chat.completions.create(
        model="tiny-qwen3",
        messages=[{"role": "user", "content": text}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_prompt)
    assert chat.usage.completion_tokens == NEW_TOKENS
    assert chat.choices[0].message.content == tokenizer.decode(_hf_greedy(tiny_qwen3, chat_prompt))

    plain_prompt = tokenizer.encode(text)
    stream = client.completions.create(
        model="tiny-qwen3",
        prompt=text,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == tokenizer.decode(_hf_greedy(tiny_qwen3, plain_prompt))
