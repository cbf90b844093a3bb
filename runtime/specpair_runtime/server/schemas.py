"""OpenAI-compatible request and response bodies.

Requests forbid unknown fields so that a typo gets a 4xx naming the field
instead of being silently ignored. Responses are plain pydantic models that
serialize to the shapes OpenAI clients parse, plus one extra field,
``speculation``, with the request's own speculation stats.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specpair_runtime.engine.api import FinishReason

MAX_STOP_SEQUENCES = 4


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(default=None, description="Ignored beyond a match check.")
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: Literal[1] = Field(default=1, description="Only one choice per request.")
    stream: bool = False
    user: str | None = None
    # Higher runs first; FIFO within one priority (see scheduler.RequestQueue).
    priority: int = Field(default=0, ge=-1000, le=1000)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(not stop for stop in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    prompt: str = Field(description="The prompt text.")
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationStats(BaseModel):
    """The extra, non-OpenAI field: how speculation went for this request."""

    drafted: int
    accepted: int
    acceptance_rate: float
    steps: int  # accept steps in which this request speculated


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationStats | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: SpeculationStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specpair"
    pair: str
    pair_version: str
    target: str
    draft: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def field_path(loc: tuple[int | str, ...]) -> str:
    """`("messages", 0, "role")` -> `messages[0].role`; body/query prefixes dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query"):
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            # pydantic names the union branch it tried (e.g. "str", "list[str]"); skip it.
            if part in ("str", "list[str]"):
                continue
            path += f".{part}" if path else part
    return path
