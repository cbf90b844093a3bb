"""From a validated request body to queued generations, the cheap checks first.

In order: the server is ready and its queue has room, the model matches,
the API key allows the priority, the prompts fit (by characters before the
tokenizer runs, then by tokens), the output constraint compiles (on a
worker thread, cached per grammar: ``engine/grammar.py``), the penalties
are in range, and the sampling parameters are built: one generation per
prompt and choice (``choices.py``). Each refusal is an ``APIError`` that
names the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.constraint_processors import processor_factories
from specpair_runtime.engine.grammar import CompiledGrammar, GrammarError
from specpair_runtime.engine.penalties import BAN_BIAS, Penalties, PenaltyError
from specpair_runtime.server.chat_render import TemplateMessage, encode_conversation
from specpair_runtime.server.choices import Choice, abort_all
from specpair_runtime.server.errors import APIError
from specpair_runtime.server.gate import caller_of
from specpair_runtime.server.generation import Generation
from specpair_runtime.server.prompt_inputs import (
    PromptInput,
    PromptShapeError,
    choice_index,
    echo_text,
    prompt_inputs,
    sample_seed,
)
from specpair_runtime.server.prompts import encode_text, longest_token_chars, max_prompt_chars
from specpair_runtime.server.queueing import QueueFull
from specpair_runtime.server.scheduler import Scheduler
from specpair_runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from specpair_runtime.server.state import ServerState
from specpair_runtime.server.structured import ConstraintError, output_constraint
from specpair_runtime.server.token_pieces import TokenPieces, token_pieces
from specpair_runtime.server.tools import (
    NO_TOOLS,
    ToolError,
    ToolPlan,
    added_token_texts,
    plan_tools,
    refuse_special_text,
    template_tool_calls,
)

RequestBody = CompletionRequest | ChatCompletionRequest
# Choices of one request (n times its prompts): each is an engine request.
MAX_TOTAL_CHOICES = 64
# A grammar that takes longer than this to compile gets a 400 (llguidance bounds its
# work with fuel limits; this bounds the wait whatever the cause).
COMPILE_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class TokenizedPrompt:
    prompt: PromptInput  # where errors point, and what ``echo`` repeats
    ids: list[int]


@dataclass(frozen=True)
class Admitted:
    """A request whose choices the scheduler has queued."""

    choices: list[Choice]
    request_id: str
    created: int
    params: SamplingParams  # the first choice's (they differ only in their seeds)
    tools: ToolPlan = NO_TOOLS


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


def tokenize_prompts(state: ServerState, body: CompletionRequest) -> list[TokenizedPrompt]:
    """On a worker thread: each prompt, the cheap length bound before the tokenizer."""
    try:
        inputs = prompt_inputs(body.prompt, state.vocab_size or len(state.tokenizer))
    except PromptShapeError as error:
        raise APIError(400, str(error), param=error.field) from None
    prompts = []
    for item in inputs:
        if item.token_ids is not None:
            prompts.append(TokenizedPrompt(item, list(item.token_ids)))
            continue
        assert item.text is not None
        if len(item.text) > _prompt_chars_limit(state):
            raise _too_long(state, len(item.text), item.field)
        prompts.append(TokenizedPrompt(item, encode_text(state.tokenizer, item.text)))
    return prompts


def _template_messages(state: ServerState, body: ChatCompletionRequest) -> list[TemplateMessage]:
    specials = added_token_texts(state.tokenizer)
    messages = []
    for index, message in enumerate(body.messages):
        calls: list[dict[str, object]] = []
        if message.tool_calls:
            path = f"messages[{index}].tool_calls"
            calls = template_tool_calls(message.tool_calls, path)
            refuse_special_text(calls, path, specials)
        messages.append(
            TemplateMessage(
                message.template_role,
                message.text if message.content is not None else None,
                calls,
                message.tool_call_id,
                message.name,
            )
        )
    return messages


def tokenize_chat(
    state: ServerState, body: ChatCompletionRequest, tools: ToolPlan
) -> list[TokenizedPrompt]:
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(400, "messages: the model has no chat template", param="messages")
    chars = sum(len(m.text) for m in body.messages)
    if chars > _prompt_chars_limit(state):
        raise _too_long(state, chars, "messages")
    try:
        messages = _template_messages(state, body)
        ids = encode_conversation(state.tokenizer, messages, tools.render)
    except ToolError as error:
        raise APIError(400, str(error), param=error.field) from None
    except TemplateError as error:
        # The template's own words (e.g. "roles must alternate"), not ours: safe to pass on.
        raise APIError(
            400, f"messages: the chat template refused them: {error}", param="messages"
        ) from None
    return [TokenizedPrompt(PromptInput("messages"), ids)]


def tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    """How the request's tools are served; a 400 naming the field when they cannot be."""
    try:
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tokenizer)
    except ToolError as error:
        raise APIError(400, str(error), param=error.field) from None


async def compiled_constraint(
    state: ServerState, body: RequestBody, tools: ToolPlan
) -> CompiledGrammar | None:
    """The request's grammar, compiled off the event loop and the engine thread (or cached)."""
    try:
        field, spec = output_constraint(
            body.response_format, body.structured_outputs, body.guided(), tools
        )
    except (ConstraintError, ToolError) as error:
        raise APIError(400, str(error), param=error.field) from None
    if spec is None or field is None:
        return None
    if state.grammars is None:
        reason = state.grammars_unavailable or "the grammar compiler is not built"
        raise APIError(400, f"{field}: structured outputs are unavailable: {reason}", param=field)
    # Shielded: the compile is shared with every request for this spec, and a request
    # that gives up (timeout, disconnect) must not cancel it for the others.
    compiling = asyncio.shield(asyncio.wrap_future(state.grammars.compile_async(spec)))
    try:
        return await asyncio.wait_for(compiling, COMPILE_TIMEOUT_SECONDS)
    except GrammarError as error:
        raise APIError(
            400, f"{field}: cannot be compiled: {error}", param=field, code="invalid_grammar"
        ) from None
    except TimeoutError:
        raise APIError(
            400,
            f"{field}: did not compile within {COMPILE_TIMEOUT_SECONDS:g} seconds",
            param=field,
            code="invalid_grammar",
        ) from None


def penalties_of(state: ServerState, body: RequestBody, tools: ToolPlan) -> Penalties:
    bias = body.bias_by_token()
    for token in tools.banned:  # tool_choice "none": the call tag is never sampled
        bias.setdefault(token, BAN_BIAS)
    penalties = Penalties.of(
        body.presence_penalty, body.frequency_penalty, body.repetition_penalty, bias
    )
    try:
        penalties.validate(state.vocab_size or len(state.tokenizer))
    except PenaltyError as error:
        raise APIError(400, str(error), param=error.field) from None
    return penalties


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


def _max_tokens(
    state: ServerState, body: RequestBody, prompt_len: int, rule: PromptRule, prompt_field: str
) -> int:
    room = _completion_room(state, prompt_len, prompt_field)
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
    state: ServerState,
    body: RequestBody,
    prompt_len: int,
    rule: PromptRule,
    prompt_field: str | None = None,
) -> SamplingParams:
    """Check the lengths against the max model length and build the params.

    ``prompt_field``: where a length error points (the rule's field by default).
    """
    max_tokens = _max_tokens(state, body, prompt_len, rule, prompt_field or rule.field)
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
    tokenize: Callable[[], list[TokenizedPrompt]],
    tools: ToolPlan = NO_TOOLS,
) -> Admitted:
    """Check, tokenize (on a worker thread), compile and queue every choice; raises APIError."""
    scheduler = serving(state)
    check_model(state, body.model)
    priority = priority_of(request, body.priority)
    prompts = await run_in_threadpool(tokenize)
    if len(prompts) * body.n > MAX_TOTAL_CHOICES:
        raise APIError(
            400,
            f"n: {body.n} choices for each of {len(prompts)} prompts exceed the "
            f"{MAX_TOTAL_CHOICES} choices one request may ask for",
            param="n",
        )
    grammar = await compiled_constraint(state, body, tools)
    penalties = penalties_of(state, body, tools)
    echo = isinstance(body, CompletionRequest) and body.echo
    request_id = f"{rule.request_id_prefix}-{uuid.uuid4().hex}"
    many = len(prompts) * body.n > 1
    choices: list[Choice] = []
    first: SamplingParams | None = None
    try:
        for p, prompt in enumerate(prompts):
            base = sampling(state, body, len(prompt.ids), rule, prompt.prompt.field)
            base = dataclasses.replace(
                base, logits_processors=processor_factories(grammar, penalties, prompt.ids)
            )
            shown = echo_text(state.tokenizer, prompt.prompt) if echo else ""
            for sample in range(body.n):
                index = choice_index(p, sample, body.n)
                params = dataclasses.replace(base, seed=sample_seed(base.seed, sample))
                engine_id = f"{request_id}-{index}" if many else request_id
                generation = Generation(
                    scheduler, state.output_filter, engine_id, prompt.ids, params, priority
                )
                generation.submit()
                choices.append(Choice(index, p, generation, shown))
                first = first or params
    except QueueFull as error:
        abort_all(choices)
        raise queue_full(error) from None
    except BaseException:
        abort_all(choices)
        raise
    assert first is not None
    return Admitted(choices, request_id, int(time.time()), first, tools)
