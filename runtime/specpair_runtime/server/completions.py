"""The two generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

Each admits its request (``admission.py``), then either streams it
(``streaming.py``) or waits for the whole text and answers once.
"""

from __future__ import annotations

import asyncio
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from specpair_runtime.engine.api import FinishReason
from specpair_runtime.server.admission import (
    CHAT,
    COMPLETION,
    admit,
    pieces_of,
    tokenize_chat,
    tokenize_prompt,
)
from specpair_runtime.server.errors import error_response
from specpair_runtime.server.generation import Generation, GenerationError
from specpair_runtime.server.logprobs import CompletionLogprobsBuilder, chat_logprobs
from specpair_runtime.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from specpair_runtime.server.state import ServerState
from specpair_runtime.server.streaming import chat_chunks, completion_chunks

CompletionAnswer = CompletionResponse | EventSourceResponse | JSONResponse
ChatAnswer = ChatCompletionResponse | EventSourceResponse | JSONResponse


async def _watch_disconnect(request: Request, disconnected: asyncio.Event) -> None:
    while not disconnected.is_set():
        if await request.is_disconnected():
            disconnected.set()
            return
        await asyncio.sleep(0.1)


async def collect(
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


async def complete(
    state: ServerState, body: CompletionRequest, request: Request
) -> CompletionAnswer:
    admitted = await admit(
        state, request, body, COMPLETION, partial(tokenize_prompt, state, body.prompt)
    )
    generation, request_id, created = admitted.generation, admitted.request_id, admitted.created
    wants_logprobs = admitted.params.logprobs is not None
    logprobs = CompletionLogprobsBuilder(pieces_of(state)) if wants_logprobs else None
    if body.stream:
        return EventSourceResponse(
            completion_chunks(
                generation, request_id, created, state.model_id, body.include_usage, logprobs
            )
        )
    collected = await collect(request, generation)
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


async def chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> ChatAnswer:
    messages = [(m.template_role, m.text) for m in body.messages]
    admitted = await admit(state, request, body, CHAT, partial(tokenize_chat, state, messages))
    generation, request_id, created = admitted.generation, admitted.request_id, admitted.created
    pieces = pieces_of(state) if admitted.params.logprobs is not None else None
    if body.stream:
        return EventSourceResponse(
            chat_chunks(generation, request_id, created, state.model_id, body.include_usage, pieces)
        )
    collected = await collect(request, generation)
    if isinstance(collected, JSONResponse):
        return collected
    text, finish = collected
    choice = ChatChoice(
        message=AssistantMessage(content=text),
        logprobs=chat_logprobs(generation.released_logprobs, pieces) if pieces else None,
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


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> CompletionAnswer:
        return await complete(state, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatAnswer:
        return await chat(state, body, request)
