"""OpenAI-compatible request and response bodies.

Requests forbid unknown fields so that a typo gets a 4xx naming the field
instead of being silently ignored. They accept what the official SDKs and
common frameworks send (``stream_options``, ``max_completion_tokens``,
text content parts, the ``developer`` role, zero penalties, ``seed``,
``user``, ``logprobs``) and vLLM's sampling extras (``top_k``,
``stop_token_ids``, ``ignore_eos``). Responses are plain pydantic models
that serialize to the shapes OpenAI clients parse, plus one extra field,
``speculation``, with the request's own speculation stats.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specpair_runtime.engine.api import SEED_GUARANTEE, FinishReason
from specpair_runtime.engine.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 64


def _valid_unicode(value: str) -> str:
    """Refuse lone surrogates: JSON can carry them, UTF-8 (and the tokenizer) cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"contains a lone UTF-16 surrogate at character {error.start}; "
            "text must be valid Unicode"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _zero_only(value: float) -> float:
    if value != 0:
        raise ValueError("only 0 is supported: this server applies no penalties")
    return value


Penalty = Annotated[float, Field(ge=-2.0, le=2.0), AfterValidator(_zero_only)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    include_usage: bool = Field(
        default=False, description="Send a last chunk with usage and no choices before [DONE]."
    )


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Text | None = Field(default=None, description="Ignored beyond a match check.")
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63, description=SEED_GUARANTEE)
    stop: Text | list[Text] | None = None
    n: Literal[1] = Field(default=1, description="Only one choice per request.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM's sampling extras, which its clients send (LangChain's VLLMOpenAI, benchmarks).
    top_k: int | None = Field(
        default=None, ge=-1, description="Sample among the k most likely tokens; 0 or -1: off."
    )
    ignore_eos: bool = Field(default=False, description="Decode past end-of-sequence tokens.")
    stop_token_ids: list[int] | None = Field(
        default=None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that end the output like EOS.",
    )
    # Higher runs first; FIFO within one priority (see scheduler.RequestQueue).
    # Capped by the API key's priority class; None = the key's own priority.
    priority: int | None = Field(default=None, ge=-1000, le=1000)

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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def token_limit(self) -> tuple[int | None, str]:
        """The requested completion length and the field it came from."""
        return self.max_tokens, "max_tokens"

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token for ``SamplingParams.logprobs``; None: no logprobs."""
        return None


class CompletionRequest(_Request):
    prompt: Text = Field(description="The prompt text.")
    echo: Literal[False] = False
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Log-probabilities of the sampled tokens and this many most likely ones.",
    )

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # "developer" is OpenAI's newer name for system instructions.
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]
    name: Text | None = None

    @property
    def template_role(self) -> str:
        """The role chat templates know: they have no "developer"."""
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM does)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="OpenAI's newer name for max_tokens."
    )
    logprobs: bool = Field(default=False, description="Log-probabilities of the output tokens.")
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="With logprobs: this many most likely tokens at each position.",
    )

    @model_validator(mode="after")
    def _one_length_field(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens; give one of the two")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # ``logprobs`` is declared first, so it is validated already.
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return value

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt tokens."""

    # Prompt tokens whose KV a slot still held (prefix reuse): not computed again.
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Always sent, 0 when nothing was reused: clients read it without a None check.
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class SpeculationStats(BaseModel):
    """The extra, non-OpenAI field: how speculation went for this request."""

    drafted: int
    accepted: int
    acceptance_rate: float
    steps: int  # accept steps in which this request speculated


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per output token."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs`` (the legacy parallel lists).

    ``top_logprobs``: per token, the chosen token and the most likely ones (as
    vLLM sends them); ``text_offset``: where each token's text starts in the
    completion text.
    """

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


def _is_union_branch(part: str) -> bool:
    # pydantic names the union branch it tried ("str", "list[str]", "list[ContentPart]",
    # "function-after[_valid_unicode(), str]").
    return part == "str" or "[" in part


def field_path(loc: tuple[int | str, ...]) -> str:
    """`("messages", 0, "role")` -> `messages[0].role`; body/query prefixes dropped."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query"):
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_union_branch(part):
            path += f".{part}" if path else part
    return path
