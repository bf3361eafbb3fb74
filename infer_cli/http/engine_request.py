"""From a validated request body to the engine's `Request`: tokenize, check the context length,
choose the default `max_tokens`, and build `SamplingParams`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from engine.contract import ContractError, Request, SamplingParams
from infer_cli.http.errors import APIError, bad_request
from infer_cli.http.schemas import CommonParams
from models.registry import PromptRenderError

_In = TypeVar("_In")


def _context_length_error(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_param: str
) -> APIError:
    if max_tokens is None:
        message = (
            f"the prompt is {prompt_tokens} tokens, which leaves no room to generate within this model's "
            f"maximum context length of {max_model_len} tokens"
        )
    else:
        message = (
            f"this model's maximum context length is {max_model_len} tokens, but {prompt_tokens + max_tokens} "
            f"were requested ({prompt_tokens} in the prompt, {max_tokens} to generate); shorten the prompt "
            "or lower max_tokens"
        )
    return bad_request(
        message, param="max_tokens" if max_tokens else prompt_param, code="context_length_exceeded"
    )


def engine_request(
    request_id: str,
    prompt: list[int] | tuple[int, ...],
    common: CommonParams,
    logprobs: int | None,
    max_model_len: int,
    prompt_param: str,
) -> Request:
    if not prompt:
        raise bad_request("the prompt encodes to no tokens", param=prompt_param)
    prompt_tokens = len(prompt)
    max_tokens = common.max_tokens
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise _context_length_error(prompt_tokens, None, max_model_len, prompt_param)
        max_tokens = max_model_len - prompt_tokens
    elif prompt_tokens + max_tokens > max_model_len:
        raise _context_length_error(prompt_tokens, max_tokens, max_model_len, prompt_param)
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=common.temperature,
            top_p=common.top_p,
            top_k=common.top_k,
            min_p=common.min_p,
            seed=common.seed,
            logprobs=logprobs,
            ignore_eos=common.ignore_eos,
        )
    except ContractError as exc:
        raise bad_request(str(exc), param=exc.field_name) from None
    return Request(request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling)


def tokenize(tokenize: Callable[[_In], list[int]], value: _In, param: str) -> list[int]:
    # JSON can carry strings no tokenizer can encode, such as a lone UTF-16 surrogate ("\ud800").
    try:
        return tokenize(value)
    except UnicodeError as exc:
        raise bad_request(f"the prompt is not valid Unicode text: {exc}", param=param) from None
    except PromptRenderError as exc:
        raise bad_request(str(exc), param=param) from None
