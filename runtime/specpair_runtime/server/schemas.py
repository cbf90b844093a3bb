"""OpenAI-compatible request and response bodies.

Every request model derives from ``RequestModel``: unknown fields are refused
(a typo gets a 400 naming the field instead of being silently ignored), and
types are strict, as OpenAI's are: a string, a boolean or ``2.0`` where an
integer belongs is refused, never coerced (``"3"`` to 3, ``true`` to 1); a
number field takes any JSON number (``"temperature": 1``). ``null`` means
the default, as for OpenAI's nullable parameters. Requests accept what the
official SDKs and common frameworks send (``stream_options``,
``max_completion_tokens``, text content parts, the ``developer`` role, zero
penalties, ``seed``, ``user``, ``logprobs``) and vLLM's sampling extras
(``top_k``, ``stop_token_ids``, ``ignore_eos``). Responses are plain pydantic models
that serialize to the shapes OpenAI clients parse, plus one extra field,
``speculation``, with the request's own speculation stats.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specpair_runtime.engine.api import SEED_GUARANTEE, FinishReason
from specpair_runtime.engine.logprobs import MAX_TOP_LOGPROBS
from specpair_runtime.engine.penalties import MAX_LOGIT_BIAS
from specpair_runtime.server.prompt_inputs import MAX_CHOICES, PromptField
from specpair_runtime.server.request_model import RequestModel, Text
from specpair_runtime.server.structured import GuidedFields, ResponseFormat, StructuredOutputs
from specpair_runtime.server.tools import AssistantToolCall, Tool, ToolChoice

__all__ = ["RequestModel", "Text"]

MAX_STOP_SEQUENCES = 4
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
# The reasons a chat choice ends: the engine's, and "tool_calls" when it called tools.
ChatFinishReason = FinishReason | Literal["tool_calls"]


class StreamOptions(RequestModel):
    include_usage: bool = Field(
        default=False, description="Send a last chunk with usage and no choices before [DONE]."
    )


class _Request(RequestModel):
    model: Text | None = Field(default=None, description="Ignored beyond a match check.")
    max_tokens: int | None = Field(default=None, ge=1, description="Tokens to generate.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63, description=SEED_GUARANTEE)
    stop: Text | list[Text] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Bias] | None = Field(
        default=None,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description="Token id (as a string) to a bias in [-100, 100] added to its logit.",
    )
    # vLLM's extra: divides positive logits (multiplies negative ones) of tokens seen so far.
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    # Structured outputs (``structured.py``): OpenAI's response_format, vLLM's fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, object] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(default=None, min_length=1, max_length=1024)
    guided_grammar: Text | None = Field(default=None, description="A Lark grammar.")
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

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # As OpenAI and vLLM refuse it: without a stream the options would do nothing.
        # ``stream`` is declared first, so it is validated already.
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"key {key!r} is not a token id")
        return value

    def bias_by_token(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def guided(self) -> GuidedFields | None:
        """vLLM's top-level constraint fields, when any is set."""
        fields = {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }
        if all(v is None for v in fields.values()):
            return None
        return GuidedFields.model_validate(fields)

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


def _prompt_shape(value: object) -> str:
    """The prompt branch a raw value belongs to, named as pydantic names union branches
    (``field_path`` leaves such names out of the error's field path)."""
    if not isinstance(value, list) or not value:
        return "str" if not isinstance(value, list) else "list[str]"
    first = value[0]
    if isinstance(first, list):
        return "list[list[int]]"
    if isinstance(first, int) and not isinstance(first, bool):
        return "list[int]"
    return "list[str]"


# One branch is validated, chosen by the value's shape, so an error speaks of that
# branch (a lone surrogate in a string prompt, not "expected an array").
Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Tag("list[str]")]
    | Annotated[list[int], Tag("list[int]")]
    | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(_Request):
    prompt: Prompt = Field(
        description="A prompt, a list of prompts, token ids, or a list of token id lists."
    )
    echo: bool = Field(default=False, description="Put the prompt before each completion.")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Log-probabilities of the sampled tokens and this many most likely ones.",
    )

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_field(self) -> PromptField:
        return self.prompt


class ContentPart(RequestModel):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    # "developer" is OpenAI's newer name for system instructions.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    # An assistant turn's tool calls, and the call a tool turn answers.
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: Text | None = None
    # OpenAI's field of an assistant turn that declined; taken so a reply can be sent back.
    refusal: Text | None = None

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id: only a tool message answers a call")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required, except in an assistant message with tool_calls")
        return self

    @property
    def template_role(self) -> str:
        """The role chat templates know: they have no "developer"."""
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM does)."""
        if self.content is None:
            return ""
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
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

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
    content: str | None
    tool_calls: list[AssistantToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationStats


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: the first has its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None


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
