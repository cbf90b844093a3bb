"""The model's tool calls, parsed out of its text as it streams.

Qwen2.5 (and every Hermes-style template) writes a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. ``ToolCallParser`` reads the output text piece by piece
and gives back OpenAI's deltas: ``content`` text outside the blocks (text
that may be the start of ``<tool_call>`` is held back until it is not), and
per call first its ``id`` and ``name`` (once the name is read), then its
``arguments`` in fragments whose concatenation is the model's JSON for them,
exactly as written. A non-streamed response runs the same parser over the
whole text (``parse``), so both give the same calls.

Whitespace outside the blocks once a call has started (the newline between
two calls) is not content; other text there is. A block whose JSON breaks
off (``max_tokens``) keeps what was read of it; a block that never yielded
a name is given back as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: the first one has ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ParsedOutput:
    """Deltas of one feed: content text, then call pieces (in the order they came)."""

    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@dataclass
class _JsonScanner:
    """Reads one JSON object character by character; records its top-level members' spans.

    ``spans[key] = (start, end)``: the raw text of the member's value in the
    scanned text (end None while the value is still being read). ``done``:
    the object closed.
    """

    depth: int = 0
    in_string: bool = False
    escape: bool = False
    key_start: int | None = None
    key: str | None = None
    value_start: int | None = None
    expecting_value: bool = False
    done: bool = False
    broken: bool = False
    spans: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    def feed(self, text: str, start: int) -> None:
        for offset, char in enumerate(text[start:], start):
            if self.done or self.broken:
                return
            self._char(text, offset, char)

    def _char(self, text: str, at: int, char: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1 and self.key_start is not None and self.value_start is None:
                    self.key = self._decode(text[self.key_start : at + 1])
                    self.key_start = None
                elif self.depth == 1 and self.value_start is not None:
                    self._close_value(at + 1)
            return
        if char.isspace():
            return
        if self.depth == 0:
            if char != "{":
                self.broken = True
                return
            self.depth = 1
            return
        at_top = self.depth == 1
        if at_top and self.expecting_value:
            self.expecting_value = False
            self.value_start = at
            if self.key is not None:
                self.spans[self.key] = (at, None)
        if char == '"':
            self.in_string = True
            if at_top and self.value_start is None and self.key is None:
                self.key_start = at
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.value_start is not None:
                self._close_value(at + 1)
            elif self.depth == 0:
                if self.value_start is not None:  # a scalar ends at the object's end
                    self._close_value(self._scalar_end(text, at))
                self.done = True
        elif at_top and char == ":":
            self.expecting_value = True
        elif at_top and char == ",":
            if self.value_start is not None:
                self._close_value(self._scalar_end(text, at))
            self.key = None

    def _scalar_end(self, text: str, at: int) -> int:
        end = at
        while end > 0 and text[end - 1].isspace():
            end -= 1
        return end

    def _close_value(self, end: int) -> None:
        if self.key is not None and self.value_start is not None:
            self.spans[self.key] = (self.value_start, end)
        self.value_start = None
        self.key = None

    @staticmethod
    def _decode(raw: str) -> str | None:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, str) else None


@dataclass
class _Call:
    index: int
    text: str = ""  # the block's text after the open tag
    scanner: _JsonScanner = field(default_factory=_JsonScanner)
    scanned: int = 0
    id: str | None = None
    name: str | None = None
    sent_arguments: int = 0  # characters of the raw arguments already sent
    closed: bool = False


class ToolCallParser:
    """Incremental: ``feed(text)`` per piece of output, ``finish()`` at the end."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._outside = ""  # text outside blocks, not yet given out
        self._calls: list[_Call] = []
        self._current: _Call | None = None

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read so far that have a name."""
        return [
            ToolCall(c.id, c.name, self._arguments(c)[0])
            for c in self._calls
            if c.id is not None and c.name is not None
        ]

    def feed(self, text: str) -> ParsedOutput:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        pending = text
        while pending:
            if self._current is None:
                pending = self._read_outside(pending, content)
            else:
                pending = self._read_call(self._current, pending, content, deltas)
        return ParsedOutput("".join(content), tuple(deltas))

    def finish(self) -> ParsedOutput:
        """What is still held: a partial open tag, an unnamed block, trailing text."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        call = self._current
        if call is not None:
            self._current = None
            if call.name is None:
                self._calls.remove(call)
                content.append(OPEN_TAG + call.text)
            else:
                self._send_arguments(call, deltas, final=True)
        if self._outside and (not self._calls or self._outside.strip()):
            content.append(self._outside)
        self._outside = ""
        return ParsedOutput("".join(content), tuple(deltas))

    def _read_outside(self, text: str, content: list[str]) -> str:
        buffered = self._outside + text
        found = buffered.find(OPEN_TAG)
        if found >= 0:
            self._give_outside(buffered[:found], content, final=True)
            self._current = _Call(len(self._calls))
            self._calls.append(self._current)
            return buffered[found + len(OPEN_TAG) :]
        held = _partial_tag(buffered, OPEN_TAG)
        self._give_outside(buffered[: len(buffered) - held], content, final=False)
        self._outside += buffered[len(buffered) - held :]
        return ""

    def _give_outside(self, text: str, content: list[str], final: bool) -> None:
        """Text outside blocks: content, except whitespace once a call has started."""
        self._outside = ""
        if not self._calls or text.strip():
            content.append(text)
        elif not final:
            self._outside = text  # whitespace between calls: decided by what follows

    def _read_call(
        self, call: _Call, text: str, content: list[str], deltas: list[ToolCallDelta]
    ) -> str:
        call.text += text
        end = call.text.find(CLOSE_TAG)
        rest = ""
        if end >= 0:
            rest = call.text[end + len(CLOSE_TAG) :]
            call.text = call.text[:end]
            call.closed = True
        call.scanner.feed(call.text, call.scanned)
        call.scanned = len(call.text)
        if call.name is None:
            span = call.scanner.spans.get("name")
            if span is not None and span[1] is not None:
                name = _JsonScanner._decode(call.text[span[0] : span[1]])
                if name is not None:
                    call.id, call.name = self._new_id(), name
                    deltas.append(ToolCallDelta(call.index, "", call.id, name))
        if call.name is not None:
            self._send_arguments(call, deltas, final=call.closed)
        if call.closed:
            self._current = None
            if call.name is None:  # not a call we can name: give it back as text
                self._calls.remove(call)
                content.append(OPEN_TAG + call.text + CLOSE_TAG)
        return rest

    def _arguments(self, call: _Call) -> tuple[str, bool]:
        """(the raw arguments text read so far, whether it is complete)."""
        span = call.scanner.spans.get("arguments")
        if span is None:
            return ("{}" if call.scanner.done else ""), call.scanner.done
        start, end = span
        raw = call.text[start : end if end is not None else len(call.text)]
        if end is None:
            raw = raw.rstrip()
        if raw.startswith('"') and end is not None:  # arguments given as a JSON string
            decoded = _JsonScanner._decode(raw)
            return (decoded if decoded is not None else raw), True
        return raw, end is not None

    def _send_arguments(self, call: _Call, deltas: list[ToolCallDelta], final: bool) -> None:
        raw, complete = self._arguments(call)
        if raw.startswith('"') and not complete:
            return  # a string form is sent decoded, once whole
        if final and not raw and call.scanner.done:
            raw = "{}"
        if len(raw) > call.sent_arguments:
            deltas.append(ToolCallDelta(call.index, raw[call.sent_arguments :]))
            call.sent_arguments = len(raw)


def parse(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """The whole output's content (None when empty and there are calls) and its calls."""
    parser = ToolCallParser(new_id)
    first, last = parser.feed(text), parser.finish()
    content = first.content + last.content
    calls = parser.calls
    if calls and not content.strip():
        return None, calls
    return content, calls
