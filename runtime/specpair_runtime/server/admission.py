"""From a validated request body to a queued generation, the cheap checks first.

In order: the server is ready and its queue has room, the model matches,
the API key allows the priority, the prompt fits (by characters before the
tokenizer runs, then by tokens), and the sampling parameters are built.
Each refusal is an ``APIError`` that names the field.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.server.errors import APIError
from specpair_runtime.server.gate import caller_of
from specpair_runtime.server.generation import Generation
from specpair_runtime.server.prompts import (
    encode_chat,
    encode_text,
    longest_token_chars,
    max_prompt_chars,
)
from specpair_runtime.server.queueing import QueueFull
from specpair_runtime.server.scheduler import Scheduler
from specpair_runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from specpair_runtime.server.state import ServerState
from specpair_runtime.server.token_pieces import TokenPieces, token_pieces

RequestBody = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True)
class Admitted:
    """A request the scheduler has queued."""

    generation: Generation
    request_id: str
    created: int
    params: SamplingParams


@dataclass(frozen=True)
class PromptRule:
    """How one endpoint reads its prompt: the field errors name, and its length default."""

    field: str
    request_id_prefix: str
    default_max_tokens: int | None  # None: whatever room the max model length leaves


COMPLETION = PromptRule("prompt", "cmpl", default_max_tokens=16)
CHAT = PromptRule("messages", "chatcmpl", default_max_tokens=None)


def queue_full(error: QueueFull) -> APIError:
    return APIError(429, f"{error}; retry later", code="queue_full")


def serving(state: ServerState) -> Scheduler:
    """The scheduler, when ready and its queue has room (checked again on submit)."""
    readiness = state.readiness.state
    if not readiness.ready or state.scheduler is None:
        raise APIError(503, f"not ready: {readiness.phase}: {readiness.reason}", code="not_ready")
    try:
        # Before tokenizing: a full queue must not cost a prompt's CPU first.
        state.scheduler.check_room()
    except QueueFull as error:
        raise queue_full(error) from None
    return state.scheduler


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_id:
        raise APIError(
            404,
            f"model: {model!r} is not served here; use {state.model_id!r}",
            param="model",
            code="model_not_found",
        )


def priority_of(request: Request, asked: int | None) -> int:
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


def pieces_of(state: ServerState) -> TokenPieces:
    """The tokenizer's token pieces (for logprobs), built once."""
    if state.token_pieces is None:
        state.token_pieces = token_pieces(state.tokenizer)
    return state.token_pieces


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


def tokenize_prompt(state: ServerState, text: str) -> list[int]:
    """On a worker thread: the cheap length bound first, then the tokenizer."""
    if len(text) > _prompt_chars_limit(state):
        raise _too_long(state, len(text), "prompt")
    return encode_text(state.tokenizer, text)


def tokenize_chat(state: ServerState, messages: list[tuple[str, str]]) -> list[int]:
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


def _completion_room(state: ServerState, prompt_len: int, prompt_field: str) -> int:
    """Tokens the max model length leaves after the prompt; a 400 when none."""
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
    return limit - prompt_len


def _max_tokens(state: ServerState, body: RequestBody, prompt_len: int, rule: PromptRule) -> int:
    room = _completion_room(state, prompt_len, rule.field)
    max_tokens, field = body.token_limit()
    if max_tokens is None:
        default = rule.default_max_tokens
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise APIError(
            400,
            f"{field}: {max_tokens} is out of range; with a {prompt_len}-token prompt at "
            f"most {room} fit in the max model length of {state.max_model_length}",
            param=field,
            code="context_length_exceeded",
        )
    return max_tokens


def sampling(
    state: ServerState, body: RequestBody, prompt_len: int, rule: PromptRule
) -> SamplingParams:
    """Check the lengths against the max model length and build the params."""
    max_tokens = _max_tokens(state, body, prompt_len, rule)
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


async def admit(
    state: ServerState,
    request: Request,
    body: RequestBody,
    rule: PromptRule,
    tokenize: Callable[[], list[int]],
) -> Admitted:
    """Check, tokenize (on a worker thread) and queue the request; raises APIError."""
    scheduler = serving(state)
    check_model(state, body.model)
    priority = priority_of(request, body.priority)
    prompt_ids = await run_in_threadpool(tokenize)
    params = sampling(state, body, len(prompt_ids), rule)
    request_id = f"{rule.request_id_prefix}-{uuid.uuid4().hex}"
    generation = Generation(
        scheduler, state.output_filter, request_id, prompt_ids, params, priority
    )
    try:
        generation.submit()
    except QueueFull as error:
        raise queue_full(error) from None
    return Admitted(generation, request_id, int(time.time()), params)
