"""SSE bodies for ``stream: true``: one chunk per accept step, then ``[DONE]``.

sse-starlette does the framing and closes the generator when the client
goes away, which aborts the generation (see ``Generation.chunks``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel

from specpair_runtime.engine.api import FinishReason
from specpair_runtime.server.generation import Generation, GenerationError
from specpair_runtime.server.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
)

log = logging.getLogger("specpair.server")

# (text, finish_reason, is_last) -> the chunk body
ChunkBuilder = Callable[[str, FinishReason | None, bool], BaseModel]


def completion_chunks(
    generation: Generation, request_id: str, created: int, model: str
) -> AsyncIterator[str]:
    def build(text: str, finish: FinishReason | None, last: bool) -> BaseModel:
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[CompletionChoice(text=text, finish_reason=finish)],
            usage=generation.usage if last else None,
            speculation=generation.speculation if last else None,
        )

    return _events(generation, build, first=None)


def chat_chunks(
    generation: Generation, request_id: str, created: int, model: str
) -> AsyncIterator[str]:
    def build(text: str, finish: FinishReason | None, last: bool) -> BaseModel:
        return ChatCompletionChunk(
            id=request_id,
            created=created,
            model=model,
            choices=[ChatChunkChoice(delta=ChatDelta(content=text or None), finish_reason=finish)],
            usage=generation.usage if last else None,
            speculation=generation.speculation if last else None,
        )

    # OpenAI's first chat chunk announces the role with empty content.
    first = ChatCompletionChunk(
        id=request_id,
        created=created,
        model=model,
        choices=[
            ChatChunkChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None)
        ],
    )
    return _events(generation, build, first=first)


def _dump(chunk: BaseModel) -> str:
    """JSON without absent optional fields, but with OpenAI's explicit nulls per choice."""
    data = chunk.model_dump(exclude_none=True)
    for choice in data.get("choices", []):
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return json.dumps(data, ensure_ascii=False)


async def _events(
    generation: Generation, build: ChunkBuilder, first: BaseModel | None
) -> AsyncIterator[str]:
    if first is not None:
        yield _dump(first)
    try:
        async for chunk in generation.chunks():
            if chunk.finish_reason is None:
                yield _dump(build(chunk.text, None, False))
                continue
            # The step that finishes may carry text: send it, then the closing chunk.
            if chunk.text:
                yield _dump(build(chunk.text, None, False))
            yield _dump(build("", chunk.finish_reason, True))
    except GenerationError as error:
        log.error("request %s failed: %s", generation.request_id, error)
        detail = ErrorDetail(message=str(error), type="server_error")
        yield ErrorResponse(error=detail).model_dump_json()
    yield "[DONE]"
