"""One request's run through the engine, as the HTTP layer sees it.

`Generation` submits a `Request`, consumes its `RequestStream`, and turns the updates into pieces of
output text (`Delta`s) ready to render: it detokenizes incrementally, matches stop strings (aborting
the request in the engine when one appears), keeps the usage tally, maps terminals to finish reasons
or OpenAI errors, and records the request's metrics exactly once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, RequestStream
from engine.contract import Failed, Finished, Rejected, RejectReason, Request, RequestUpdate, TokenLogprob
from infer_cli.http.detokenizer import IncrementalDetokenizer
from infer_cli.http.errors import SERVER_ERROR, ErrorInfo
from infer_cli.http.metrics import ServerMetrics
from infer_cli.http.stop_strings import OutputText
from models.registry import Tokenizer


@dataclass(frozen=True, slots=True)
class Delta:
    """Output ready to send: new text, and the tokens (with log-probs when asked) it came from.
    `finish_reason` is set on the last delta of a request that ended normally."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None = None


def rejection_error(rejected: Rejected, prompt_param: str = "prompt") -> ErrorInfo:
    if rejected.reason is RejectReason.CONTEXT_LENGTH:
        return ErrorInfo(400, rejected.message, param=prompt_param, code="context_length_exceeded")
    if rejected.reason is RejectReason.KV_BUDGET:
        # The scheduler rejects only a request that could never fit the KV cache, even empty: a
        # property of the request, as with vLLM's over-long prompts, so 400 and not a retryable 503.
        return ErrorInfo(
            400,
            f"the request needs more KV-cache memory than this server has: {rejected.message}",
            code="kv_cache_capacity_exceeded",
        )
    return ErrorInfo(400, rejected.message, code="invalid_value")


class Generation:
    def __init__(
        self,
        engine: AsyncEngine,
        request: Request,
        tokenizer: Tokenizer,
        metrics: ServerMetrics,
        *,
        stop: tuple[str, ...] = (),
        want_logprobs: bool = False,
        prompt_param: str = "prompt",
    ) -> None:
        self.request = request
        self._prompt_param = prompt_param
        self._engine = engine
        self._metrics = metrics
        self._want_logprobs = want_logprobs
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self._output = OutputText(stop)
        self._pending_logprobs: list[TokenLogprob] = []
        self._stream: RequestStream | None = None
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None

        self.prompt_tokens = len(request.prompt_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.admitted = False
        self.finish_reason: str | None = None
        self.error: ErrorInfo | None = None
        self.aborted = False
        self._final_sent = False
        self._recorded = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None or self.aborted

    @property
    def text(self) -> str:
        return self._output.final_text

    # -- control -------------------------------------------------------------------------------

    def start(self) -> None:
        """Submit to the engine; raises `EngineDeadError` when the engine cannot take it."""
        self._stream = self._engine.generate(self.request)

    def abort(self) -> None:
        """The client went away: free the request's engine resources now."""
        if self.done:
            return
        self._engine.abort(self.request_id)
        self.aborted = True
        self._record_end("abort")

    async def wait_admitted(self) -> None:
        """Consume updates until the engine admits the request or ends it, whichever comes first.
        Anything generated meanwhile is kept for `next_delta`."""
        while not self.admitted and not self.done:
            await self._absorb_next()

    async def next_delta(self) -> Delta | None:
        """The next output to send, or None once the request has ended and everything was sent."""
        while True:
            delta = self._take_delta()
            if delta is not None:
                return delta
            if self.done:
                return None
            await self._absorb_next()

    # -- internals -----------------------------------------------------------------------------

    async def _absorb_next(self) -> None:
        assert self._stream is not None, "start() first"
        try:
            batch = await anext(self._stream)
        except StopAsyncIteration:
            # The stream ended with no terminal: aborted (by a disconnect, or after a stop string).
            if not self.done:
                self.aborted = True
                self._record_end("abort")
            return
        for update in batch:
            if self.done:
                break
            self._absorb(update)

    def _absorb(self, update: RequestUpdate) -> None:
        if update.admission is not None:
            self.admitted = True
            self._metrics.admitted(
                update.admission.prompt_tokens,
                update.admission.scheduled_time - update.admission.queued_time,
            )
        if update.cached_tokens is not None:
            self.cached_tokens = update.cached_tokens
        if update.new_token_ids:
            self._absorb_tokens(update)
            if self._output.stopped:
                return
        terminal = update.terminal
        if terminal is None:
            return
        if isinstance(terminal, Finished):
            self._output.append(self._detokenizer.flush())
            self.finish_reason = "stop" if self._output.stopped else terminal.reason.value
            self._record_end(self.finish_reason)
        elif isinstance(terminal, Rejected):
            self.error = rejection_error(terminal, self._prompt_param)
            self._metrics.errored(f"rejected_{terminal.reason.value}")
        elif isinstance(terminal, Failed):
            self.error = ErrorInfo(500, terminal.message, type=SERVER_ERROR, code="engine_failure")
            self._metrics.errored("failed")

    def _absorb_tokens(self, update: RequestUpdate) -> None:
        now = time.monotonic()
        if self._last_token_time is None:
            self._metrics.first_token(now - self._arrival)
        logprobs = update.logprobs
        counted = 0
        for i, token_id in enumerate(update.new_token_ids):
            counted += 1
            if self._want_logprobs and logprobs is not None:
                self._pending_logprobs.append(logprobs[i])
            if self._output.append(self._detokenizer.add(token_id)):
                # A stop string: cut here, and stop the engine spending steps on text nobody gets.
                self.finish_reason = "stop"
                self._engine.abort(self.request_id)
                break
        self.completion_tokens += counted
        self._metrics.tokens(counted, None if self._last_token_time is None else now - self._last_token_time)
        self._last_token_time = now
        if self.finish_reason is not None:
            self._record_end(self.finish_reason)

    def _take_delta(self) -> Delta | None:
        if self._final_sent or self.error is not None or self.aborted:
            return None
        final = self.finish_reason is not None
        text = self._output.take(final)
        if not text and not self._pending_logprobs and not final:
            return None
        logprobs = tuple(self._pending_logprobs)
        self._pending_logprobs.clear()
        if final:
            self._final_sent = True
        return Delta(text=text, logprobs=logprobs, finish_reason=self.finish_reason)

    def _record_end(self, finished_reason: str) -> None:
        if self._recorded:
            return
        self._recorded = True
        self._metrics.ended(finished_reason, time.monotonic() - self._arrival)
