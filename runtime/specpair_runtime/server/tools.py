"""OpenAI tools: request shapes, rendering through the chat template, and enforcement.

The tools go to the model through its own chat template (``tools=``), as its
trainers rendered them; assistant turns with ``tool_calls`` and ``tool``
turns with results go through it too. The template writes tool definitions
and call arguments with ``tojson``, not as plain text, so a special token's
text inside them would become the token itself (and could forge a turn):
such a string is refused with a 400 that names where it is.

``tool_choice``:

- ``auto`` (the default with tools): the model decides; its output is parsed
  for calls (``tool_calls.py``). With ``parallel_tool_calls: false`` only the
  first call is kept.
- ``none``: the tools are rendered (the conversation may mention them), the
  open tag of a call is banned (logit bias -100), nothing is parsed.
- ``required`` / a named function: a grammar forces the output to be calls
  (one, or one or more with ``parallel_tool_calls``) whose JSON matches the
  tools' ``parameters`` schemas; for a named function, calls to it alone.

The call format is the Hermes one that Qwen2.5's template asks for,
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from specpair_runtime.engine.grammar import json_schema_for_lark
from specpair_runtime.server.request_model import RequestModel
from specpair_runtime.server.tool_calls import CLOSE_TAG, OPEN_TAG

# OpenAI's rule for function names.
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128


class ToolError(ValueError):
    """A tools request this model cannot serve; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="A JSON schema for the arguments (an object)."
    )
    strict: bool | None = Field(
        default=None, description="Accepted; the schema is enforced whenever calls are forced."
    )


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CallFunction(RequestModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class AssistantToolCall(RequestModel):
    """A call in an assistant turn of the conversation (and in a response)."""

    id: str
    type: Literal["function"] = "function"
    function: CallFunction


@dataclass(frozen=True)
class ToolFormat:
    """How the model writes a call: its tags, and whether each is one token."""

    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG
    open_token: int | None = None
    close_token: int | None = None


def tool_format(tokenizer: Any) -> ToolFormat:
    """The model's call format; ToolError when its chat template cannot render tools."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" not in template or OPEN_TAG not in template:
        raise ToolError(
            "tools", "the model's chat template does not render tools in the <tool_call> format"
        )
    added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
    return ToolFormat(open_token=added.get(OPEN_TAG), close_token=added.get(CLOSE_TAG))


def added_token_texts(tokenizer: Any) -> list[str]:
    return [token.content for token in tokenizer.added_tokens_decoder.values()]


def _strings(value: Any, path: str) -> Iterable[tuple[str, str]]:
    """Every string (keys included) inside a JSON value, with its field path."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", str(key)
            yield from _strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{path}[{index}]")


def refuse_special_text(value: Any, path: str, specials: Sequence[str]) -> None:
    """ToolError when a string in ``value`` holds a special token's text."""
    for where, text in _strings(value, path):
        for special in specials:
            if special and special in text:
                raise ToolError(
                    where, f"contains {special!r}, a special token of the model, which the chat "
                    "template would render as that token"
                )  # fmt: skip


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as the chat template receives them (OpenAI's shape, unset fields left out)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_tool_calls(calls: Sequence[AssistantToolCall], path: str) -> list[dict[str, Any]]:
    """An assistant turn's calls for the template, arguments as a JSON value (as vLLM does)."""
    rendered = []
    for index, call in enumerate(calls):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError as error:
            raise ToolError(f"{path}[{index}].function.arguments", f"not JSON: {error}") from None
        rendered.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return rendered


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for rendering, decoding and parsing."""

    render: list[dict[str, Any]] | None  # tools= for the chat template
    lark: str | None = None  # a grammar forcing calls (required / named)
    # auto: the rules of any calls, for a grammar that allows calls or an answer
    calls_rules: str | None = None
    banned: tuple[int, ...] = ()  # tokens given a -100 bias (tool_choice none)
    parse: bool = False  # parse the output for calls
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.lark is not None


NO_TOOLS = ToolPlan(render=None)


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    arguments = function.parameters if function.parameters is not None else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _tag(text: str, token: int | None) -> str:
    """A Lark terminal for a tag: the special token itself, or its text."""
    return text if token is not None else json.dumps(text)


def calls_rules(functions: Sequence[FunctionDefinition], parallel: bool, fmt: ToolFormat) -> str:
    """Lark rules whose rule ``calls`` is one call (or several, one per line) to ``functions``."""
    schemas = [_call_schema(f) for f in functions]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    return (
        f"{calls}\n"
        f'call: {_tag(fmt.open_tag, fmt.open_token)} "\\n" call_body "\\n" '
        f"{_tag(fmt.close_tag, fmt.close_token)}\n"
        f"call_body: %json {json_schema_for_lark(body)}\n"
    )


def calls_grammar(functions: Sequence[FunctionDefinition], parallel: bool, fmt: ToolFormat) -> str:
    """A Lark grammar: calls to ``functions`` and nothing else."""
    return "start: calls\n" + calls_rules(functions, parallel, fmt)


def plan_tools(
    tools: Sequence[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    tokenizer: Any,
) -> ToolPlan:
    """Check the tools against the model and decide how they are served."""
    if not tools:
        if choice is not None and choice != "none":
            raise ToolError("tool_choice", "needs tools")
        return NO_TOOLS
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    names = [tool.function.name for tool in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ToolError("tools", f"the function name {duplicate!r} appears twice")
    fmt = tool_format(tokenizer)
    rendered = template_tools(tools)
    refuse_special_text(rendered, "tools", added_token_texts(tokenizer))
    allow_many = parallel is not False
    functions = [tool.function for tool in tools]
    if choice is None or choice == "auto":
        rules = calls_rules(functions, allow_many, fmt)
        return ToolPlan(rendered, parse=True, parallel=allow_many, calls_rules=rules)
    if choice == "none":
        banned = (fmt.open_token,) if fmt.open_token is not None else ()
        return ToolPlan(rendered, banned=banned)
    if isinstance(choice, NamedToolChoice):
        chosen = [f for f in functions if f.name == choice.function.name]
        if not chosen:
            raise ToolError(
                "tool_choice.function.name",
                f"{choice.function.name!r} is not one of the tools ({', '.join(names)})",
            )
        return ToolPlan(rendered, lark=calls_grammar(chosen, False, fmt), parse=True,
                        parallel=False)  # fmt: skip
    return ToolPlan(
        rendered, lark=calls_grammar(functions, allow_many, fmt), parse=True, parallel=allow_many
    )
