"""Structured-output fields of a request, and the one grammar they ask for.

Accepted, one source per request:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}`` (any JSON object) and ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. The schema
  is enforced by the grammar whether or not ``strict`` is set.
- vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``,
  ``grammar`` as a Lark grammar, ``json_object``; exactly one of them).
- vLLM's older top-level fields, which many clients still send:
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

With tools (``tools.py``), forced calls (``tool_choice`` required or a named
function) take the tools' grammar; with ``auto``, a JSON answer format is
combined with the calls: the output is either calls or the JSON answer.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from specpair_runtime.engine.grammar import GrammarSpec, json_schema_for_lark
from specpair_runtime.server.request_model import RequestModel
from specpair_runtime.server.tools import FUNCTION_NAME, ToolError, ToolPlan

MAX_CHOICES = 1024


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is 'json_schema'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema: only with type 'json_schema', not {self.type!r}")
        return self


Choices = Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)]


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            name
            for name, value in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of json, regex, choice, grammar, json_object is needed, got "
                f"{', '.join(given) or 'none'}"
            )
        return self


class GuidedFields(RequestModel):
    """vLLM's older top-level constraint fields."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None


class ConstraintError(ValueError):
    """Conflicting or malformed constraint fields; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def _schema(value: dict[str, Any] | str, field: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConstraintError(field, f"not JSON: {error}") from None
        if not isinstance(value, dict):
            raise ConstraintError(field, "must be a JSON object (a schema)")
    return GrammarSpec.json_schema(value)


def _sources(
    response_format: ResponseFormat | None,
    structured: StructuredOutputs | None,
    guided: GuidedFields | None,
) -> list[tuple[str, GrammarSpec]]:
    found: list[tuple[str, GrammarSpec]] = []
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", GrammarSpec.json_object()))
    elif response_format is not None and response_format.json_schema is not None:
        schema = response_format.json_schema.schema_
        field = "response_format.json_schema.schema"
        found.append((field, _schema(schema if schema is not None else {}, field)))
    if structured is not None:
        if structured.json_ is not None:
            found.append(
                ("structured_outputs.json", _schema(structured.json_, "structured_outputs.json"))
            )
        elif structured.regex is not None:
            found.append(("structured_outputs.regex", GrammarSpec.regex(structured.regex)))
        elif structured.choice is not None:
            found.append(("structured_outputs.choice", GrammarSpec.choice(structured.choice)))
        elif structured.grammar is not None:
            found.append(("structured_outputs.grammar", GrammarSpec.lark(structured.grammar)))
        else:
            found.append(("structured_outputs.json_object", GrammarSpec.json_object()))
    if guided is not None:
        if guided.guided_json is not None:
            found.append(("guided_json", _schema(guided.guided_json, "guided_json")))
        if guided.guided_regex is not None:
            found.append(("guided_regex", GrammarSpec.regex(guided.guided_regex)))
        if guided.guided_choice is not None:
            found.append(("guided_choice", GrammarSpec.choice(guided.guided_choice)))
        if guided.guided_grammar is not None:
            found.append(("guided_grammar", GrammarSpec.lark(guided.guided_grammar)))
    return found


def _answer_rule(spec: GrammarSpec) -> str:
    """A Lark rule ``answer`` for a JSON answer (the only kinds combined with calls)."""
    schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
    return f"answer: %json {json_schema_for_lark(schema)}\n"


def output_constraint(
    response_format: ResponseFormat | None = None,
    structured: StructuredOutputs | None = None,
    guided: GuidedFields | None = None,
    tools: ToolPlan | None = None,
) -> tuple[str | None, GrammarSpec | None]:
    """(the field the constraint came from, its grammar), or (None, None) for free text."""
    sources = _sources(response_format, structured, guided)
    if len(sources) > 1:
        raise ConstraintError(
            sources[1][0], f"give one output constraint; {sources[0][0]} is set too"
        )
    if tools is not None and tools.lark is not None:
        return "tool_choice", GrammarSpec.lark(tools.lark)
    if not sources:
        return None, None
    field, spec = sources[0]
    if tools is None or tools.calls_rules is None:
        return field, spec
    if spec.kind not in ("json_schema", "json_object"):
        raise ToolError(field, "with tools and tool_choice 'auto' only a JSON answer format fits")
    grammar = "start: calls | answer\n" + tools.calls_rules + _answer_rule(spec)
    return field, GrammarSpec.lark(grammar)
