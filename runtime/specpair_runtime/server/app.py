"""The FastAPI app: OpenAI-compatible routes, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from specpair_runtime.engine.api import FinishReason, SamplingParams
from specpair_runtime.server.errors import APIError, error_response, install_error_handlers
from specpair_runtime.server.gate import GateMiddleware, caller_of
from specpair_runtime.server.generation import Generation, GenerationError
from specpair_runtime.server.logprobs import CompletionLogprobsBuilder, chat_logprobs, token_texts
from specpair_runtime.server.metrics import CONTENT_TYPE
from specpair_runtime.server.prompts import (
    encode_chat,
    encode_text,
    longest_token_chars,
    max_prompt_chars,
)
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


def _queue_full(error: QueueFull) -> APIError:
    return APIError(429, f"{error}; retry later", code="queue_full")


def _serving(state: ServerState) -> Scheduler:
    """The scheduler, when ready and its queue has room (checked again on submit)."""
    readiness = state.readiness.state
    if not readiness.ready or state.scheduler is None:
        raise APIError(503, f"not ready: {readiness.phase}: {readiness.reason}", code="not_ready")
    try:
        # Before tokenizing: a full queue must not cost a prompt's CPU first.
        state.scheduler.check_room()
    except QueueFull as error:
        raise _queue_full(error) from None
    return state.scheduler


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_id:
        raise APIError(
            404,
            f"model: {model!r} is not served here; use {state.model_id!r}",
            param="model",
            code="model_not_found",
        )


def _priority(request: Request, asked: int | None) -> int:
    """The request's priority: its key's class, or lower when it asks for lower."""
    caller = caller_of(request.scope)
    if asked is None:
        return caller.max_priority
    if asked > caller.max_priority:
        raise APIError(
            403,
            f"priority: {asked} is above the {caller.max_priority} this API key may use; "
            "a request may lower its priority, never raise it",
            param="priority",
            code="priority_not_allowed",
        )
    return asked


def _prompt_chars_limit(state: ServerState) -> int:
    if state.max_prompt_chars is None:
        token_chars = longest_token_chars(state.tokenizer)
        state.max_prompt_chars = max_prompt_chars(state.max_model_length, token_chars)
    return state.max_prompt_chars


def _too_long(state: ServerState, chars: int, field: str) -> APIError:
    return APIError(
        400,
        f"{field}: {chars} characters cannot fit the max model length of "
        f"{state.max_model_length} tokens",
        param=field,
        code="context_length_exceeded",
    )


def _tokenize_prompt(state: ServerState, text: str) -> list[int]:
    """On a worker thread: the cheap length bound first, then the tokenizer."""
    if len(text) > _prompt_chars_limit(state):
        raise _too_long(state, len(text), "prompt")
    return encode_text(state.tokenizer, text)


def _tokenize_chat(state: ServerState, messages: list[tuple[str, str]]) -> list[int]:
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(400, "messages: the model has no chat template", param="messages")
    chars = sum(len(text) for _, text in messages)
    if chars > _prompt_chars_limit(state):
        raise _too_long(state, chars, "messages")
    try:
        return encode_chat(state.tokenizer, messages)
    except TemplateError as error:
        # The template's own words (e.g. "roles must alternate"), not ours: safe to pass on.
        raise APIError(
            400, f"messages: the chat template refused them: {error}", param="messages"
        ) from None


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
    max_tokens, field = body.token_limit()
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise APIError(
            400,
            f"{field}: {max_tokens} is out of range; with a {prompt_len}-token prompt at "
            f"most {room} fit in the max model length of {limit}",
            param=field,
            code="context_length_exceeded",
        )
    vocab = len(state.tokenizer)
    outside = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
    if outside:
        raise APIError(
            400,
            f"stop_token_ids: token id {outside[0]} is outside the vocabulary [0, {vocab})",
            param="stop_token_ids",
        )
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k or 0, 0),  # vLLM's -1 and 0 both mean off
        seed=body.seed,
        stop=body.stop_sequences(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs_wanted(),
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
        raise _queue_full(error) from None
    return generation


async def _watch_disconnect(request: Request, disconnected: asyncio.Event) -> None:
    while not disconnected.is_set():
        if await request.is_disconnected():
            disconnected.set()
            return
        await asyncio.sleep(0.1)


async def _collect(
    request: Request, generation: Generation
) -> tuple[str, FinishReason] | JSONResponse:
    """The whole text, or the error answer when the generation failed."""
    disconnected = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_disconnect(request, disconnected))
    try:
        return await generation.collect(disconnected)
    except GenerationError as error:
        # Counted and logged (with the detail) by the scheduler already.
        return error_response(error.status, error.public_message, code=error.code)
    finally:
        watcher.cancel()


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specpair runtime", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(GateMiddleware, state=state)
    install_error_handlers(app, state.metrics)

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

    def card() -> ModelCard:
        config = state.config
        return ModelCard(
            id=state.model_id,
            created=int(time.time()),
            pair=config.pair.name,
            pair_version=config.pair.version,
            target=config.target.source,
            draft=config.draft.source,
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        _check_model(state, model_id)
        return card()

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> CompletionResponse | EventSourceResponse | JSONResponse:
        scheduler = _serving(state)
        _check_model(state, body.model)
        priority = _priority(request, body.priority)
        prompt_ids = await run_in_threadpool(_tokenize_prompt, state, body.prompt)
        params = _sampling(state, body, len(prompt_ids), "prompt", default_max_tokens=16)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation = _start(state, scheduler, request_id, prompt_ids, params, priority)
        created = int(time.time())
        logprobs = (
            CompletionLogprobsBuilder(token_texts(state.tokenizer))
            if params.logprobs is not None
            else None
        )
        if body.stream:
            return EventSourceResponse(
                completion_chunks(
                    generation, request_id, created, state.model_id, body.include_usage, logprobs
                )
            )
        collected = await _collect(request, generation)
        if isinstance(collected, JSONResponse):
            return collected
        text, finish = collected
        choice = CompletionChoice(
            text=text,
            logprobs=logprobs.build(generation.released_logprobs) if logprobs else None,
            finish_reason=finish,
        )
        return CompletionResponse(
            id=request_id,
            created=created,
            model=state.model_id,
            choices=[choice],
            usage=generation.usage,
            speculation=generation.speculation,
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> ChatCompletionResponse | EventSourceResponse | JSONResponse:
        scheduler = _serving(state)
        _check_model(state, body.model)
        priority = _priority(request, body.priority)
        messages = [(m.template_role, m.text) for m in body.messages]
        prompt_ids = await run_in_threadpool(_tokenize_chat, state, messages)
        params = _sampling(state, body, len(prompt_ids), "messages", default_max_tokens=None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation = _start(state, scheduler, request_id, prompt_ids, params, priority)
        created = int(time.time())
        token_text = token_texts(state.tokenizer) if params.logprobs is not None else None
        if body.stream:
            return EventSourceResponse(
                chat_chunks(
                    generation, request_id, created, state.model_id, body.include_usage, token_text
                )
            )
        collected = await _collect(request, generation)
        if isinstance(collected, JSONResponse):
            return collected
        text, finish = collected
        choice = ChatChoice(
            message=AssistantMessage(content=text),
            logprobs=chat_logprobs(generation.released_logprobs, token_text)
            if token_text
            else None,
            finish_reason=finish,
        )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=state.model_id,
            choices=[choice],
            usage=generation.usage,
            speculation=generation.speculation,
        )

    return app
