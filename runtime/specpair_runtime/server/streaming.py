"""SSE bodies for ``stream: true``: one chunk per accept step and choice, then ``[DONE]``.

sse-starlette does the framing and closes the generator when the client
goes away, which aborts every choice's generation (see ``Generation.chunks``
and ``merge.py``). The choices of a request (``n``, several prompts) stream
side by side, each chunk naming its ``index``. A failed generation ends the
stream with an OpenAI-shaped error chunk, then ``[DONE]``, so clients always
see why a stream ended.

Usage goes out as OpenAI sends it: only with ``stream_options.include_usage``,
once, in a last chunk with empty ``choices`` (every other chunk then says
``"usage": null``); never on a ``finish_reason`` chunk, so a client that
sums usage over the chunks counts it once. Each choice's closing chunk
carries the extra ``speculation`` field.

Chat choices whose output is parsed for tool calls (``tools.py``) stream
them as OpenAI does: a delta with the call's ``index``, ``id``, ``type`` and
``function.name``, then deltas of ``function.arguments``; the choice ends with
``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from pydantic import BaseModel

from specpair_runtime.engine.api import FinishReason, TokenLogprob
from specpair_runtime.server.choices import Choice, combined_usage
from specpair_runtime.server.errors import ERROR_TYPES
from specpair_runtime.server.generation import GenerationError
from specpair_runtime.server.logprobs import CompletionLogprobsBuilder, chat_logprobs
from specpair_runtime.server.merge import merge_streams
from specpair_runtime.server.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatFinishReason,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    FunctionDelta,
    ToolCallDelta,
)
from specpair_runtime.server.token_pieces import TokenPieces
from specpair_runtime.server.tool_calls import ParsedOutput, ToolCallParser
from specpair_runtime.server.tools import ToolPlan

log = logging.getLogger("specpair.server")


class ChoiceRenderer(Protocol):
    """Turns one choice's chunks into response chunks."""

    def opening(self) -> list[BaseModel]: ...

    def piece(self, text: str, logprobs: Sequence[TokenLogprob]) -> list[BaseModel]: ...

    def closing(
        self, text: str, logprobs: Sequence[TokenLogprob], finish: FinishReason
    ) -> list[BaseModel]: ...


class CompletionRenderer:
    def __init__(
        self,
        choice: Choice,
        request_id: str,
        created: int,
        model: str,
        logprobs: CompletionLogprobsBuilder | None,
    ) -> None:
        self.choice = choice
        self.head = {"id": request_id, "created": created, "model": model}
        self.logprobs = logprobs

    def _chunk(
        self,
        text: str,
        entries: Sequence[TokenLogprob],
        finish: FinishReason | None = None,
        last: bool = False,
    ) -> BaseModel:
        built = self.logprobs.build(entries) if self.logprobs is not None and entries else None
        choice = CompletionChoice(
            index=self.choice.index, text=text, logprobs=built, finish_reason=finish
        )
        speculation = self.choice.generation.speculation if last else None
        return CompletionResponse(**self.head, choices=[choice], speculation=speculation)

    def opening(self) -> list[BaseModel]:
        # ``echo``: the prompt's text comes first.
        return [self._chunk(self.choice.echo, ())] if self.choice.echo else []

    def piece(self, text: str, logprobs: Sequence[TokenLogprob]) -> list[BaseModel]:
        return [self._chunk(text, logprobs)]

    def closing(
        self, text: str, logprobs: Sequence[TokenLogprob], finish: FinishReason
    ) -> list[BaseModel]:
        # The step that finishes may carry text: send it, then the closing chunk
        # (with the logprobs of tokens that have no text, such as EOS).
        if text:
            return [self._chunk(text, logprobs), self._chunk("", (), finish, True)]
        return [self._chunk("", logprobs, finish, True)]


class ChatRenderer:
    def __init__(
        self,
        choice: Choice,
        request_id: str,
        created: int,
        model: str,
        pieces: TokenPieces | None,
        tools: ToolPlan,
    ) -> None:
        self.choice = choice
        self.head = {"id": request_id, "created": created, "model": model}
        self.pieces = pieces
        self.parser = ToolCallParser() if tools.parse else None
        self.parallel = tools.parallel
        self.called = False

    def _chunk(
        self,
        delta: ChatDelta,
        entries: Sequence[TokenLogprob] = (),
        finish: ChatFinishReason | None = None,
        last: bool = False,
    ) -> BaseModel:
        logprobs = chat_logprobs(entries, self.pieces) if self.pieces and entries else None
        choice = ChatChunkChoice(
            index=self.choice.index, delta=delta, logprobs=logprobs, finish_reason=finish
        )
        speculation = self.choice.generation.speculation if last else None
        return ChatCompletionChunk(**self.head, choices=[choice], speculation=speculation)

    def _delta(self, parsed: ParsedOutput) -> ChatDelta | None:
        calls = [
            ToolCallDelta(
                index=c.index,
                id=c.id,
                type="function" if c.id is not None else None,
                function=FunctionDelta(name=c.name, arguments=c.arguments),
            )
            for c in parsed.calls
            if self.parallel or c.index == 0
        ]
        self.called = self.called or bool(calls)
        if not parsed.content and not calls:
            return None
        return ChatDelta(content=parsed.content or None, tool_calls=calls or None)

    def opening(self) -> list[BaseModel]:
        # OpenAI's first chunk of a choice announces the role with empty content.
        return [self._chunk(ChatDelta(role="assistant", content=""))]

    def piece(self, text: str, logprobs: Sequence[TokenLogprob]) -> list[BaseModel]:
        if self.parser is None:
            return [self._chunk(ChatDelta(content=text or None), logprobs)]
        delta = self._delta(self.parser.feed(text))
        if delta is None:
            return [self._chunk(ChatDelta(), logprobs)] if logprobs else []
        return [self._chunk(delta, logprobs)]

    def closing(
        self, text: str, logprobs: Sequence[TokenLogprob], finish: FinishReason
    ) -> list[BaseModel]:
        chunks = self.piece(text, logprobs) if text else []
        if self.parser is not None:
            delta = self._delta(self.parser.finish())
            if delta is not None:
                chunks.append(self._chunk(delta))
        reason: ChatFinishReason = "tool_calls" if self.called and finish == "stop" else finish
        left = () if text else logprobs
        chunks.append(self._chunk(ChatDelta(), left, reason, True))
        return chunks


def completion_chunks(
    choices: list[Choice],
    request_id: str,
    created: int,
    model: str,
    include_usage: bool,
    logprobs: CompletionLogprobsBuilder | None = None,
) -> AsyncIterator[str]:
    """``logprobs``: set when the request asked for them (else every chunk says null)."""
    renderers: list[ChoiceRenderer] = [
        CompletionRenderer(c, request_id, created, model, logprobs) for c in choices
    ]
    usage_only = CompletionResponse(id=request_id, created=created, model=model, choices=[])
    return _events(choices, renderers, usage_only if include_usage else None)


def chat_chunks(
    choices: list[Choice],
    request_id: str,
    created: int,
    model: str,
    include_usage: bool,
    pieces: TokenPieces | None,
    tools: ToolPlan,
) -> AsyncIterator[str]:
    """``pieces``: set when the request asked for logprobs (else every chunk says null)."""
    renderers: list[ChoiceRenderer] = [
        ChatRenderer(c, request_id, created, model, pieces, tools) for c in choices
    ]
    usage_only = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])
    return _events(choices, renderers, usage_only if include_usage else None)


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
    choices: list[Choice],
    renderers: list[ChoiceRenderer],
    usage_only: BaseModel | None,
) -> AsyncIterator[str]:
    """``usage_only``: the empty-choices chunk to fill with the usage at the end, if asked."""
    asked = usage_only is not None
    for renderer in renderers:
        for chunk in renderer.opening():
            yield _dump(chunk, asked)
    streams = [choice.generation.chunks() for choice in choices]
    try:
        async for index, piece in merge_streams(streams):
            renderer = renderers[index]
            if piece.finish_reason is None:
                built = renderer.piece(piece.text, piece.logprobs)
            else:
                built = renderer.closing(piece.text, piece.logprobs, piece.finish_reason)
            for chunk in built:
                yield _dump(chunk, asked)
        if usage_only is not None:
            yield _dump(usage_only.model_copy(update={"usage": combined_usage(choices)}), False)
    except GenerationError as error:
        log.info("stream %s ended with error %s", choices[0].generation.request_id, error.code)
        detail = ErrorDetail(
            message=error.public_message, type=ERROR_TYPES[error.status], code=error.code
        )
        yield ErrorResponse(error=detail).model_dump_json()
    yield "[DONE]"
