"""The two generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

Each admits its request (``admission.py``: one generation per prompt and
choice), then either streams the choices (``streaming.py``) or waits for all
of them and answers once. Chat output is parsed for tool calls when the
request's tools ask for it (``tools.py``, ``tool_calls.py``).
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
    Admitted,
    admit,
    pieces_of,
    tokenize_chat,
    tokenize_prompts,
    tool_plan,
)
from specpair_runtime.server.choices import (
    Choice,
    collect_all,
    combined_speculation,
    combined_usage,
)
from specpair_runtime.server.errors import APIError, error_response
from specpair_runtime.server.generation import GenerationError
from specpair_runtime.server.logprobs import CompletionLogprobsBuilder, chat_logprobs
from specpair_runtime.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatFinishReason,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from specpair_runtime.server.state import ServerState
from specpair_runtime.server.streaming import chat_chunks, completion_chunks
from specpair_runtime.server.tool_calls import parse
from specpair_runtime.server.tools import AssistantToolCall, CallFunction, ToolPlan

CompletionAnswer = CompletionResponse | EventSourceResponse | JSONResponse
ChatAnswer = ChatCompletionResponse | EventSourceResponse | JSONResponse


async def _watch_disconnect(request: Request, disconnected: asyncio.Event) -> None:
    while not disconnected.is_set():
        if await request.is_disconnected():
            disconnected.set()
            return
        await asyncio.sleep(0.1)


async def collect(
    request: Request, choices: list[Choice]
) -> list[tuple[str, FinishReason]] | JSONResponse:
    """Every choice's whole text, or the error answer when a generation failed."""
    disconnected = asyncio.Event()
    watcher = asyncio.ensure_future(_watch_disconnect(request, disconnected))
    try:
        return await collect_all(choices, disconnected)
    except GenerationError as error:
        # Counted and logged (with the detail) by the scheduler already.
        return error_response(error.status, error.public_message, code=error.code)
    finally:
        watcher.cancel()


async def complete(
    state: ServerState, body: CompletionRequest, request: Request
) -> CompletionAnswer:
    if body.echo and body.logprobs is not None:
        raise APIError(
            400,
            "echo: with logprobs it would need the prompt's log-probabilities, which this "
            "server does not compute; ask for one of the two",
            param="echo",
        )
    admitted = await admit(state, request, body, COMPLETION, partial(tokenize_prompts, state, body))
    choices, request_id, created = admitted.choices, admitted.request_id, admitted.created
    wants_logprobs = admitted.params.logprobs is not None
    logprobs = CompletionLogprobsBuilder(pieces_of(state)) if wants_logprobs else None
    if body.stream:
        return EventSourceResponse(
            completion_chunks(
                choices, request_id, created, state.model_id, body.include_usage, logprobs
            )
        )
    collected = await collect(request, choices)
    if isinstance(collected, JSONResponse):
        return collected
    answers = [
        CompletionChoice(
            index=choice.index,
            text=choice.echo + text,
            logprobs=logprobs.build(choice.generation.released_logprobs) if logprobs else None,
            finish_reason=finish,
        )
        for choice, (text, finish) in zip(choices, collected, strict=True)
    ]
    return CompletionResponse(
        id=request_id,
        created=created,
        model=state.model_id,
        choices=answers,
        usage=combined_usage(choices),
        speculation=combined_speculation(choices),
    )


def _message(
    text: str, finish: FinishReason, tools: ToolPlan
) -> tuple[AssistantMessage, ChatFinishReason]:
    """The assistant message of one choice, its tool calls parsed out when the tools ask."""
    if not tools.parse:
        return AssistantMessage(content=text), finish
    content, calls = parse(text)
    if not tools.parallel:
        calls = calls[:1]
    if not calls:
        return AssistantMessage(content=text), finish
    tool_calls = [
        AssistantToolCall(id=c.id, function=CallFunction(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    reason: ChatFinishReason = "tool_calls" if finish == "stop" else finish
    return AssistantMessage(content=content, tool_calls=tool_calls), reason


async def chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> ChatAnswer:
    tools = tool_plan(state, body)
    admitted: Admitted = await admit(
        state, request, body, CHAT, partial(tokenize_chat, state, body, tools), tools
    )
    choices, request_id, created = admitted.choices, admitted.request_id, admitted.created
    pieces = pieces_of(state) if admitted.params.logprobs is not None else None
    if body.stream:
        return EventSourceResponse(
            chat_chunks(
                choices, request_id, created, state.model_id, body.include_usage, pieces, tools
            )
        )
    collected = await collect(request, choices)
    if isinstance(collected, JSONResponse):
        return collected
    answers = []
    for choice, (text, finish) in zip(choices, collected, strict=True):
        message, reason = _message(text, finish, tools)
        released = choice.generation.released_logprobs
        answers.append(
            ChatChoice(
                index=choice.index,
                message=message,
                logprobs=chat_logprobs(released, pieces) if pieces else None,
                finish_reason=reason,
            )
        )
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=state.model_id,
        choices=answers,
        usage=combined_usage(choices),
        speculation=combined_speculation(choices),
    )


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> CompletionAnswer:
        return await complete(state, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatAnswer:
        return await chat(state, body, request)
