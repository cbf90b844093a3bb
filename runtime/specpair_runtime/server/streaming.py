"""SSE bodies for ``stream: true``: one chunk per accept step, then ``[DONE]``.

sse-starlette does the framing and closes the generator when the client
goes away, which aborts the generation (see ``Generation.chunks``). A failed
generation ends with an OpenAI-shaped error chunk, then ``[DONE]``, so
clients always see why a stream ended.

Usage goes out as OpenAI sends it: only with ``stream_options.include_usage``,
once, in a last chunk with empty ``choices`` (every other chunk then says
``"usage": null``); never on the ``finish_reason`` chunk, so a client that
sums usage over the chunks counts it once. The closing chunk carries the
extra ``speculation`` field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from pydantic import BaseModel

from specpair_runtime.engine.api import FinishReason, TokenLogprob
from specpair_runtime.server.errors import ERROR_TYPES
from specpair_runtime.server.generation import Generation, GenerationError
from specpair_runtime.server.logprobs import CompletionLogprobsBuilder, chat_logprobs
from specpair_runtime.server.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
)
from specpair_runtime.server.token_pieces import TokenPieces

log = logging.getLogger("specpair.server")

# (text, logprobs, finish_reason, is_last) -> the chunk body
ChunkBuilder = Callable[[str, Sequence[TokenLogprob], FinishReason | None, bool], BaseModel]


def completion_chunks(
    generation: Generation,
    request_id: str,
    created: int,
    model: str,
    include_usage: bool,
    logprobs: CompletionLogprobsBuilder | None = None,
) -> AsyncIterator[str]:
    """``logprobs``: set when the request asked for them (else every chunk says null)."""

    def build(
        text: str, entries: Sequence[TokenLogprob], finish: FinishReason | None, last: bool
    ) -> BaseModel:
        choice = CompletionChoice(
            text=text,
            logprobs=logprobs.build(entries) if logprobs is not None and entries else None,
            finish_reason=finish,
        )
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[choice],
            speculation=generation.speculation if last else None,
        )

    usage_only = CompletionResponse(id=request_id, created=created, model=model, choices=[])
    return _events(generation, build, None, usage_only if include_usage else None)


def chat_chunks(
    generation: Generation,
    request_id: str,
    created: int,
    model: str,
    include_usage: bool,
    pieces: TokenPieces | None = None,
) -> AsyncIterator[str]:
    """``pieces``: set when the request asked for logprobs (else every chunk says null)."""

    def build(
        text: str, entries: Sequence[TokenLogprob], finish: FinishReason | None, last: bool
    ) -> BaseModel:
        choice = ChatChunkChoice(
            delta=ChatDelta(content=text or None),
            logprobs=chat_logprobs(entries, pieces) if pieces and entries else None,
            finish_reason=finish,
        )
        return ChatCompletionChunk(
            id=request_id,
            created=created,
            model=model,
            choices=[choice],
            speculation=generation.speculation if last else None,
        )

    usage_only = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])

    # OpenAI's first chat chunk announces the role with empty content.
    first = ChatCompletionChunk(
        id=request_id,
        created=created,
        model=model,
        choices=[
            ChatChunkChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None)
        ],
    )
    return _events(generation, build, first, usage_only if include_usage else None)


def _dump(chunk: BaseModel, null_usage: bool) -> str:
    """JSON without absent optional fields, but with OpenAI's explicit nulls.

    ``null_usage``: the request asked for usage, so every chunk but the usage
    chunk says ``"usage": null`` (as OpenAI's do).
    """
    data = chunk.model_dump(exclude_none=True)
    for choice in data.get("choices", []):
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    if null_usage:
        data.setdefault("usage", None)
    return json.dumps(data, ensure_ascii=False)


async def _events(
    generation: Generation,
    build: ChunkBuilder,
    first: BaseModel | None,
    usage_only: BaseModel | None,
) -> AsyncIterator[str]:
    """``usage_only``: the empty-choices chunk to fill with the usage at the end, if asked."""
    asked = usage_only is not None
    if first is not None:
        yield _dump(first, asked)
    try:
        async for chunk in generation.chunks():
            if chunk.finish_reason is None:
                yield _dump(build(chunk.text, chunk.logprobs, None, False), asked)
                continue
            # The step that finishes may carry text: send it, then the closing chunk
            # (with the logprobs of tokens that have no text, such as EOS).
            closing = chunk.logprobs
            if chunk.text:
                yield _dump(build(chunk.text, chunk.logprobs, None, False), asked)
                closing = ()
            yield _dump(build("", closing, chunk.finish_reason, True), asked)
            if usage_only is not None:
                yield _dump(usage_only.model_copy(update={"usage": generation.usage}), False)
    except GenerationError as error:
        log.info("stream %s ended with error %s", generation.request_id, error.code)
        detail = ErrorDetail(
            message=error.public_message, type=ERROR_TYPES[error.status], code=error.code
        )
        yield ErrorResponse(error=detail).model_dump_json()
    yield "[DONE]"
