"""The OpenAI-compatible app: routes, auth, and the mapping of every failure to an OpenAI error.

`create_app` builds one FastAPI app around one loaded model. Its lifespan starts the AsyncEngine (and
with it the driver thread) on the serving event loop and stops it on shutdown. The routes are plain
module-level functions; each reads what it shares with the others from `server_state(request.app)`.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine, EngineDeadError
from infer_cli.http.body import DEFAULT_MAX_BODY_BYTES, read_json_body
from infer_cli.http.engine_request import engine_request, tokenize
from infer_cli.http.errors import (
    NOT_FOUND,
    SERVER_ERROR,
    UNAVAILABLE,
    APIError,
    ErrorInfo,
    unknown_route,
)
from infer_cli.http.generation import Generation
from infer_cli.http.metrics import CONTENT_TYPE, ServerMetrics
from infer_cli.http.render import ChatRenderer, CompletionRenderer
from infer_cli.http.responders import Renderer, error_response, respond_full, respond_streaming
from infer_cli.http.schemas import ChatSpec, CommonParams, CompletionSpec, parse_chat, parse_completion
from models.registry import LoadedModel

log = logging.getLogger("infer.http")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass(slots=True)
class ServerState:
    """What the routes share; reachable from tests as `server_state(app)`."""

    model: LoadedModel
    settings: ServerSettings
    engine: AsyncEngine
    metrics: ServerMetrics
    created: int


def server_state(app: FastAPI) -> ServerState:
    state: ServerState = app.state.infer
    return state


# --- error handlers ------------------------------------------------------------------------------


async def _api_error(_: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc.info)


async def _http_error(request: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(unknown_route(exc.status_code, request.url.path, request.method))


async def _validation_error(_: HTTPRequest, exc: Exception) -> Response:
    return error_response(ErrorInfo(400, str(exc), code="invalid_value"))


async def _unexpected(_: HTTPRequest, exc: Exception) -> Response:
    log.exception("unhandled error in a request handler", exc_info=exc)
    return error_response(ErrorInfo(500, "internal server error", type=SERVER_ERROR, code="internal_error"))


def _install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)


# --- what the routes share -----------------------------------------------------------------------


def require_api_key(request: HTTPRequest) -> None:
    """The /v1/* routes' dependency: with an API key set, every request must bear it."""
    key = server_state(request.app).settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
        )


def _check_model(settings: ServerSettings, name: str | None) -> None:
    if name is not None and name != settings.served_model_name:
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {settings.served_model_name!r}",
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )


def _start(gen: Generation) -> None:
    try:
        gen.start()
    except EngineDeadError as exc:
        raise APIError(
            503,
            f"the engine is not running: {_client_line(exc.reason)}",
            type=UNAVAILABLE,
            code="engine_dead",
        ) from None


async def _generate(
    http_request: HTTPRequest,
    request_id: str,
    prompt: list[int] | tuple[int, ...],
    common: CommonParams,
    logprobs: int | None,
    renderer: Renderer,
    prompt_param: str,
) -> Response:
    state = server_state(http_request.app)
    model = state.model
    request = engine_request(request_id, prompt, common, logprobs, model.max_model_len, prompt_param)
    gen = Generation(
        state.engine,
        request,
        model.tokenizer,
        state.metrics,
        stop=common.stop,
        want_logprobs=logprobs is not None,
        prompt_param=prompt_param,
    )
    _start(gen)
    if common.stream:
        return await respond_streaming(gen, renderer, common.include_usage, http_request)
    return await respond_full(gen, renderer, http_request)


# --- routes --------------------------------------------------------------------------------------


async def completions(http_request: HTTPRequest) -> Response:
    state = server_state(http_request.app)
    settings, tokenizer = state.settings, state.model.tokenizer
    spec: CompletionSpec = parse_completion(await read_json_body(http_request, settings.max_body_bytes))
    _check_model(settings, spec.common.model)
    prompt = (
        spec.prompt if isinstance(spec.prompt, tuple) else tokenize(tokenizer.encode, spec.prompt, "prompt")
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    renderer = CompletionRenderer(request_id, settings.served_model_name, tokenizer, spec.logprobs)
    return await _generate(http_request, request_id, prompt, spec.common, spec.logprobs, renderer, "prompt")


async def chat_completions(http_request: HTTPRequest) -> Response:
    state = server_state(http_request.app)
    settings, tokenizer = state.settings, state.model.tokenizer
    spec: ChatSpec = parse_chat(await read_json_body(http_request, settings.max_body_bytes))
    _check_model(settings, spec.common.model)
    prompt = tokenize(tokenizer.render_chat, spec.messages, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    renderer = ChatRenderer(
        request_id, settings.served_model_name, tokenizer, spec.logprobs, spec.top_logprobs
    )
    logprobs = spec.top_logprobs if spec.logprobs else None
    return await _generate(http_request, request_id, prompt, spec.common, logprobs, renderer, "messages")


async def list_models(http_request: HTTPRequest) -> dict[str, Any]:
    state = server_state(http_request.app)
    return {
        "object": "list",
        "data": [
            {
                "id": state.settings.served_model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "infer",
                "root": state.model.name,
                "max_model_len": state.model.max_model_len,
            }
        ],
    }


async def health(http_request: HTTPRequest) -> Response:
    engine = server_state(http_request.app).engine
    if engine.healthy:
        return JSONResponse({"status": "ok"})
    reason = engine.fatal_error or "the engine is not running"
    return error_response(ErrorInfo(503, _client_line(reason), type=UNAVAILABLE, code="engine_unhealthy"))


def _client_line(reason: str) -> str:
    """A client gets one line of an engine failure: the driver logged the whole of it (traceback
    included) when it happened, and a client is owed what failed, not where."""
    return reason.strip().partition("\n")[0]


async def prometheus_metrics(http_request: HTTPRequest) -> Response:
    state = server_state(http_request.app)
    return Response(state.metrics.render(state.engine.load), media_type=CONTENT_TYPE)


# --- the app -------------------------------------------------------------------------------------


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = server_state(app).engine
    engine.start()
    try:
        yield
    finally:
        await engine.shutdown()


def create_app(model: LoadedModel, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(settings.served_model_name)
    engine = AsyncEngine(
        model.scheduler, name=f"infer-driver-{settings.served_model_name}", on_step=metrics.engine_step
    )
    app = FastAPI(title="infer", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.infer = ServerState(
        model=model, settings=settings, engine=engine, metrics=metrics, created=int(time.time())
    )
    _install_error_handlers(app)
    auth = [Depends(require_api_key)]
    app.add_api_route("/v1/completions", completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    return app
