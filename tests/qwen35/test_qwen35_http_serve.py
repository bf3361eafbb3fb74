"""`infer serve` on the tiny Qwen3.5 checkpoint, run as a user runs it (a subprocess, default
options: `--gdn-backend auto`, torch on CPU, fp32), answers the official OpenAI client with exactly
the greedy tokens transformers `generate` gives: completions from text and from token ids, and a
chat through the checkpoint's template; streamed and not.

Token identity is checked token by token: the server's log-probs list each generated token's own
text (`decode([id])`), which must equal the reference ids' texts one for one, with the count in
`usage` and the whole text equal to the reference decoded at once. The tiny checkpoint's greedy
stream repeats one token (which one depends on the prompt), so the served log-prob of every token
is also held to transformers' teacher-forced log-prob of it: a decode step that carried the
recurrent state wrongly moves it even where the argmax stays."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gates.harness.hf_reference import hf_greedy, hf_logprobs, hf_model
from gates.harness.serving import random_prompt
from gates.harness.tolerances import FP32
from models.hf_tokenizer import HFTokenizer
from models.qwen35.config import parse_qwen35_config
from models.registry import ChatMessage

REPO = Path(__file__).resolve().parents[2]
URL = re.compile(r"(http://127\.0\.0\.1:\d+)/v1")
NAME = "tiny-qwen35"
NEW_TOKENS = 20
# Past two 64-token GDN chunks: the served prefill carries state across them.
ID_PROMPT = 133


@pytest.fixture(scope="module")
def server(tiny_qwen35: Path) -> Iterator[str]:
    command = [
        sys.executable, "-m", "infer_cli.main", "serve", "--port", "0",
        "--model", str(tiny_qwen35), "--served-model-name", NAME, "--num-kv-pages", "64",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        match = URL.search(line)
        assert match, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(tiny_qwen35: Path) -> Any:
    return hf_model(tiny_qwen35, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=600)


def _pieces(tokenizer: HFTokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def _assert_logprobs_match(
    label: str, reference: Any, prompt: list[int], want: list[int], got: list[float]
) -> None:
    """Served log-probs of the generated tokens against transformers' teacher-forced ones, within
    the fp32 bound the gates hold two infer runs to (tolerances.FP32; docs/models/qwen35.md
    measured infer against transformers on this checkpoint at ~1e-6)."""
    forced = hf_logprobs(reference, prompt + want)
    expected = [float(forced[len(prompt) - 1 + i, t]) for i, t in enumerate(want)]
    assert len(got) == len(expected), f"{label}: {len(got)} log-probs for {len(expected)} tokens"
    gap = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    print(f"{label}: max |served - transformers| log-prob {gap:.3g} (bound {FP32.stream_logprob})")
    assert gap <= FP32.stream_logprob, f"{label}: log-probs differ by {gap:.3g}"


def _completion_prompts(
    checkpoint: Path, tokenizer: HFTokenizer
) -> list[tuple[str, str | list[int], list[int]]]:
    config = parse_qwen35_config(checkpoint)
    # Special ids (the added tokens, EOS among them) are left out of a random prompt.
    specials = range(min(config.eos_token_ids), config.vocab_size)
    ids = list(random_prompt(ID_PROMPT, seed=151, vocab_size=config.vocab_size, avoid=specials))
    text = "The quick brown fox jumps over the lazy dog, and then"
    return [("text prompt", text, tokenizer.encode(text)), (f"{ID_PROMPT} token ids", ids, ids)]


def test_completions_match_transformers_generate(client: Any, tiny_qwen35: Path, reference: Any) -> None:
    tokenizer = HFTokenizer(tiny_qwen35)
    for label, prompt, prompt_ids in _completion_prompts(tiny_qwen35, tokenizer):
        want = hf_greedy(reference, prompt_ids, NEW_TOKENS)
        args: dict[str, Any] = dict(
            model=NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        done = client.completions.create(**args)
        assert done.usage.prompt_tokens == len(prompt_ids), label
        assert done.usage.completion_tokens == NEW_TOKENS, label
        choice = done.choices[0]
        assert choice.logprobs.tokens == _pieces(tokenizer, want), f"{label}: tokens differ"
        assert choice.text == tokenizer.decode(want), label
        _assert_logprobs_match(label, reference, prompt_ids, want, choice.logprobs.token_logprobs)

        pieces: list[str] = []
        values: list[float] = []
        text = ""
        for chunk in client.completions.create(**args, stream=True):
            for streamed in chunk.choices:
                text += streamed.text
                if streamed.logprobs is not None:
                    pieces.extend(streamed.logprobs.tokens)
                    values.extend(streamed.logprobs.token_logprobs)
        assert pieces == _pieces(tokenizer, want), f"{label} (streamed): tokens differ"
        assert text == tokenizer.decode(want), f"{label} (streamed)"
        _assert_logprobs_match(f"{label} (streamed)", reference, prompt_ids, want, values)


def test_chat_matches_transformers_generate(client: Any, tiny_qwen35: Path, reference: Any) -> None:
    tokenizer = HFTokenizer(tiny_qwen35)
    assert tokenizer.chat_template is not None, "the tiny checkpoint ships the Qwen chat template"
    question = "What does a Gated DeltaNet layer keep between tokens?"
    chat_ids = tokenizer.render_chat([ChatMessage("user", question)])
    want = hf_greedy(reference, chat_ids, NEW_TOKENS)
    args: dict[str, Any] = dict(
        model=NAME, messages=[{"role": "user", "content": question}], max_tokens=NEW_TOKENS,
        temperature=0, logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chat = client.chat.completions.create(**args)
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == NEW_TOKENS
    message = chat.choices[0]
    assert [e.token for e in message.logprobs.content] == _pieces(tokenizer, want)
    assert message.message.content == tokenizer.decode(want)
    _assert_logprobs_match("chat", reference, chat_ids, want, [e.logprob for e in message.logprobs.content])

    entries: list[Any] = []
    text = ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for streamed in chunk.choices:
            text += streamed.delta.content or ""
            if streamed.logprobs is not None and streamed.logprobs.content:
                entries.extend(streamed.logprobs.content)
    assert [e.token for e in entries] == _pieces(tokenizer, want), "streamed chat: tokens differ"
    assert text == tokenizer.decode(want)
    _assert_logprobs_match("chat (streamed)", reference, chat_ids, want, [e.logprob for e in entries])
