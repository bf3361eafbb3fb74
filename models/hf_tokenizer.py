"""A checkpoint's own tokenizer (tokenizer.json) and chat template, without transformers.

Prompts get the ids transformers' `AutoTokenizer` gives the same checkpoint:

- A completion prompt is encoded with the special tokens of tokenizer.json's post-processor (a
  Gemma prompt starts with `<bos>`). transformers 5 takes them from the post-processor alone: it
  drops `add_bos_token` / `add_eos_token` from tokenizer_config.json when a tokenizer.json exists,
  so a config that disagrees with the post-processor is logged and otherwise not followed. One
  deliberate difference: a prompt whose text already starts with the token the post-processor
  prepends (a chat prompt rendered by the client) keeps one of them, not two.
- A chat is rendered in a sandboxed Jinja environment the way Hugging Face renders it (trimmed
  blocks, `raise_exception`, `tojson`, `bos_token` and `eos_token` defined), and the text is
  encoded without adding special tokens: BOS comes from the template, so nothing adds a second one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

from models.registry import ChatMessage, ModelLoadError, PromptRenderError

log = logging.getLogger(__name__)


class ChatTemplateError(PromptRenderError):
    """The chat template refused the conversation (e.g. roles out of order); a client error."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@lru_cache(maxsize=8)
def _parsed(path: str, size: int, mtime_ns: int) -> FastTokenizer:
    """One parse per tokenizer.json version and process: a 262k-token file takes over a second,
    and gates load the same checkpoint many times. Only read-only methods are called on it."""
    return FastTokenizer.from_file(path)


class HFTokenizer:
    def __init__(self, checkpoint: Path) -> None:
        path = checkpoint / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{checkpoint}: no tokenizer.json")
        stat = path.stat()
        self._tok = _parsed(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        config_path = checkpoint / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        jinja_path = checkpoint / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: use the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        self._warn_on_config_disagreement(checkpoint, config)

    def _warn_on_config_disagreement(self, checkpoint: Path, config: dict[str, Any]) -> None:
        added = self._tok.encode("", add_special_tokens=True).ids
        for field, token in (("add_bos_token", self.bos_token), ("add_eos_token", self.eos_token)):
            wanted = config.get(field)
            if not isinstance(wanted, bool) or token is None:
                continue
            token_id = self._tok.token_to_id(token)
            adds = token_id is not None and token_id in added
            if adds != wanted:
                log.warning(
                    "%s: tokenizer_config.json has %s=%s but tokenizer.json's post-processor %s %s; "
                    "prompts follow the post-processor, as transformers does",
                    checkpoint,
                    field,
                    wanted,
                    "adds" if adds else "does not add",
                    token,
                )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, text: str) -> int | None:
        value = self._tok.token_to_id(text)
        return None if value is None else int(value)

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids: the text with the post-processor's special tokens."""
        encoding = self._tok.encode(text, add_special_tokens=True)
        ids, added = list(encoding.ids), encoding.special_tokens_mask
        # The text already starts with the token the post-processor prepends: keep one.
        if len(ids) > 1 and added[0] == 1 and added[1] == 0 and ids[0] == ids[1]:
            del ids[0]
        return ids

    def encode_text(self, text: str) -> list[int]:
        """The text's own ids, no special tokens added (a rendered chat carries its own)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def render_chat_text(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            raise ChatTemplateError("this checkpoint has no chat template; use /v1/completions")
        try:
            return str(
                self._template.render(
                    messages=[{"role": m.role, "content": m.content} for m in messages],
                    add_generation_prompt=True,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                )
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def render_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self.encode_text(self.render_chat_text(messages))
