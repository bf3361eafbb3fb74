"""A prompt the model's tokenizer refuses (a chat template that raises) is the client's 400."""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import httpx

from infer_cli.http.app import ServerSettings, create_app
from infer_cli.http.server import BackgroundServer
from models.hf_tokenizer import ChatTemplateError, HFTokenizer
from models.registry import ChatMessage, LoadedModel, PromptRenderError
from models.sim import SimOptions, build_sim


class _StrictChatTokenizer:
    """The sim's tokenizer, except that its chat template refuses two user turns in a row."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)  # type: ignore[attr-defined, no-any-return]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.inner.decode(token_ids)  # type: ignore[attr-defined, no-any-return]

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        if any(a.role == b.role == "user" for a, b in itertools.pairwise(messages)):
            raise ChatTemplateError("Conversation roles must alternate user/assistant")
        return self.inner.render_chat(messages)  # type: ignore[attr-defined, no-any-return]


def test_template_refusal_is_a_400_naming_messages() -> None:
    sim = build_sim(SimOptions())
    model = LoadedModel(sim.name, sim.scheduler, _StrictChatTokenizer(sim.tokenizer), sim.max_model_len)
    app = create_app(model, ServerSettings(served_model_name="sim"))
    with BackgroundServer(app) as server:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        }
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "alternate" in error["message"]
        ok = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": "sim", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
            timeout=30,
        )
        assert ok.status_code == 200, ok.text


def test_hf_template_raise_exception_is_a_prompt_error(tiny_qwen3: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "tokenizer.json").write_bytes((tiny_qwen3 / "tokenizer.json").read_bytes())
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('a system turn must come first') }}{% endif %}ok"
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = HFTokenizer(checkpoint)
    try:
        tokenizer.render_chat([ChatMessage("user", "hi")])
    except PromptRenderError as exc:
        assert "system turn must come first" in str(exc)
    else:
        raise AssertionError("the template's raise_exception did not surface as a PromptRenderError")
    assert tokenizer.render_chat_text([ChatMessage("system", "s")]) == "ok"
