"""The FastAPI app: OpenAI-compatible routes, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specpair_runtime.engine.api import FinishReason, SamplingParams
from specpair_runtime.server.auth import authorized
from specpair_runtime.server.errors import (
    APIError,
    api_error_handler,
    error_response,
    http_error_handler,
    validation_error_handler,
)
from specpair_runtime.server.generation import Generation, GenerationError
from specpair_runtime.server.metrics import CONTENT_TYPE
from specpair_runtime.server.queueing import QueueFull
from specpair_runtime.server.scheduler import Scheduler
from specpair_runtime.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from specpair_runtime.server.state import ServerState
from specpair_runtime.server.streaming import chat_chunks, completion_chunks

log = logging.getLogger("specpair.server")


class GateMiddleware:
    """For /v1/*: 503 while draining, 401 without the key, and in-flight counting.

    A plain ASGI middleware (not BaseHTTPMiddleware) so that the count covers
    a streaming body until its last byte.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope["path"]).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        state = self.state
        if state.draining:
            response = error_response(503, "server is shutting down", code="shutting_down")
            await response(scope, receive, send)
            return
        headers = dict(scope["headers"])
        header = headers.get(b"authorization")
        if not authorized(header.decode("latin-1") if header else None, state.api_key):
            response = error_response(401, "missing or invalid API key", code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1
            if state.in_flight == 0 and state.idle is not None:
                state.idle.set()


def _serving(state: ServerState) -> Scheduler:
    readiness = state.readiness.state
    if not readiness.ready or state.scheduler is None:
        raise APIError(503, f"not ready: {readiness.phase}: {readiness.reason}", code="not_ready")
    return state.scheduler


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_id:
        raise APIError(
            404,
            f"model: {model!r} is not served here; use {state.model_id!r}",
            param="model",
            code="model_not_found",
        )


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text).input_ids]


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "messages: the model has no chat template", param="messages")
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes its own special tokens; don't add them twice.
    return [int(i) for i in tokenizer(rendered, add_special_tokens=False).input_ids]


def _sampling(
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    prompt_field: str,
    default_max_tokens: int | None,
) -> SamplingParams:
    """Check the lengths against the max model length and build the params."""
    limit = state.max_model_length
    if prompt_len == 0:
        raise APIError(400, f"{prompt_field}: encodes to zero tokens", param=prompt_field)
    if prompt_len >= limit:
        raise APIError(
            400,
            f"{prompt_field}: {prompt_len} tokens; the max model length is {limit} "
            f"(prompt + completion), leaving no room to generate",
            param=prompt_field,
            code="context_length_exceeded",
        )
    room = limit - prompt_len
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(
            400,
            f"max_tokens: {max_tokens} is out of range; with a {prompt_len}-token prompt at "
            f"most {room} fit in the max model length of {limit}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_sequences(),
    )


def _start(
    state: ServerState,
    scheduler: Scheduler,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    priority: int,
) -> Generation:
    generation = Generation(
        scheduler, state.output_filter, request_id, prompt_ids, params, priority
    )
    try:
        generation.submit()
    except QueueFull as error:
        raise APIError(
            429,
            f"{error}; retry later",
            code="queue_full",
        ) from None
    return generation


async def _watch_disconnect(request: Request, disconnected: asyncio.Event) -> None:
    while not disconnected.is_set():
        if await request.is_disconnected():
            disconnected.set()
            return
        await asyncio.sleep(0.1)


async def _collect(request: Request, generation: Generation) -> tuple[str, FinishReason]:
    disconnected = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_disconnect(request, disconnected))
    try:
        return await generation.collect(disconnected)
    except GenerationError as error:
        raise APIError(500, str(error)) from None
    finally:
        watcher.cancel()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specpair runtime", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GateMiddleware, state=state)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        readiness = state.readiness.state
        return JSONResponse(readiness.body(), status_code=200 if readiness.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        config = state.config
        card = ModelCard(
            id=state.model_id,
            created=int(time.time()),
            pair=config.pair.name,
            pair_version=config.pair.version,
            target=config.target.source,
            draft=config.draft.source,
        )
        return ModelList(data=[card])

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> CompletionResponse | EventSourceResponse:
        scheduler = _serving(state)
        _check_model(state, body.model)
        prompt_ids = await run_in_threadpool(_encode_text, state.tokenizer, body.prompt)
        params = _sampling(state, body, len(prompt_ids), "prompt", default_max_tokens=16)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = _start(state, scheduler, request_id, prompt_ids, params, body.priority)
        created = int(time.time())
        if body.stream:
            return EventSourceResponse(
                completion_chunks(generation, request_id, created, state.model_id)
            )
        text, finish = await _collect(request, generation)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=state.model_id,
            choices=[CompletionChoice(text=text, finish_reason=finish)],
            usage=generation.usage,
            speculation=generation.speculation,
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> ChatCompletionResponse | EventSourceResponse:
        scheduler = _serving(state)
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        prompt_ids = await run_in_threadpool(_encode_chat, state.tokenizer, messages)
        params = _sampling(state, body, len(prompt_ids), "messages", default_max_tokens=None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = _start(state, scheduler, request_id, prompt_ids, params, body.priority)
        created = int(time.time())
        if body.stream:
            return EventSourceResponse(chat_chunks(generation, request_id, created, state.model_id))
        text, finish = await _collect(request, generation)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=state.model_id,
            choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)],
            usage=generation.usage,
            speculation=generation.speculation,
        )

    return app
