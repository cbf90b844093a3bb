"""Tool calls parsed out of streamed text: same result however the text is cut."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator

import pytest

from specpair_runtime.server.tool_calls import ToolCallParser, parse

ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
    "\n</tool_call>"
)
TWO = (
    '<tool_call>\n{"name": "a", "arguments": {"x": "}{\\"]"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
)


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def stream(pieces: Iterable[str]) -> tuple[str, dict[int, dict[str, str]], list[tuple[int, str]]]:
    """Feed pieces; return (content, calls by index, order of (index, kind) events)."""
    numbers = ids()
    parser = ToolCallParser(lambda: next(numbers))
    content = ""
    calls: dict[int, dict[str, str]] = {}
    events: list[tuple[int, str]] = []
    for out in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += out.content
        for delta in out.calls:
            call = calls.setdefault(delta.index, {"arguments": ""})
            if delta.id is not None:
                assert "id" not in call, "the id comes once, first"
                call.update(id=delta.id, name=delta.name or "")
                events.append((delta.index, "head"))
            else:
                assert "id" in call, "arguments come after the call's id and name"
            call["arguments"] += delta.arguments
            if delta.arguments:
                events.append((delta.index, "arguments"))
    return content, calls, events


def test_plain_text_is_content() -> None:
    assert stream(["Hello, ", "world <b>", "!"])[0] == "Hello, world <b>!"
    assert parse("no calls here") == ("no calls here", [])


def test_a_possible_open_tag_is_held_back_until_it_is_not() -> None:
    parser = ToolCallParser()
    assert parser.feed("Hi <tool").content == "Hi "
    assert parser.feed("box>").content == "<toolbox>"
    assert parser.feed("<").content == ""
    assert parser.finish().content == "<"


def test_one_call() -> None:
    content, calls, _ = stream([ONE])
    assert content == ""
    assert calls == {
        0: {
            "id": "call_0",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": [1, 2]}',
        }
    }
    text, parsed = parse(ONE)
    assert text is None and [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]})
    ]


@pytest.mark.parametrize("text", [ONE, TWO, "Let me check.\n" + ONE, ONE + "\nDone."])
def test_every_cut_gives_the_same_result(text: str) -> None:
    whole = stream([text])
    for cut in range(1, len(text)):
        assert stream([text[:cut], text[cut:]])[:2] == whole[:2], cut
    by_char = stream(list(text))
    assert by_char[:2] == whole[:2]
    # Streamed a character at a time, the arguments come in many pieces.
    assert by_char[2].count((0, "arguments")) > 3


def test_two_calls_and_text_around_them() -> None:
    content, calls, _ = stream(["I will look.\n", TWO, "\n"])
    assert content == "I will look.\n"
    assert [c["name"] for c in calls.values()] == ["a", "b"]
    assert json.loads(calls[0]["arguments"]) == {"x": '}{"]'}
    assert calls[1]["arguments"] == "{}"
    text, _ = parse(TWO + "\nThat is all.")
    assert text == "\nThat is all."


def test_arguments_before_the_name_are_sent_with_it() -> None:
    _, calls, events = stream(
        list('<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>')
    )
    assert calls[0]["name"] == "search" and calls[0]["arguments"] == '{"q": 1}'
    assert events[0] == (0, "head")


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    _, calls, _ = stream(list('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'))
    assert calls[0]["arguments"] == '{"a": 1}'


def test_missing_arguments_are_an_empty_object() -> None:
    _, calls, _ = stream(['<tool_call>{"name": "now"}</tool_call>'])
    assert calls[0]["arguments"] == "{}"


def test_a_call_cut_off_keeps_what_was_read() -> None:
    content, calls, _ = stream(['<tool_call>\n{"name": "f", "arguments": {"city": "Pa'])
    assert content == ""
    assert calls[0]["name"] == "f" and calls[0]["arguments"] == '{"city": "Pa'


@pytest.mark.parametrize(
    "block", ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']
)
def test_a_block_without_a_name_is_content(block: str) -> None:
    assert stream([block])[:2] == (block, {})
    assert stream(list(block))[:2] == (block, {})
    assert parse(block) == (block, [])


def test_an_unclosed_block_without_a_name_is_content() -> None:
    assert stream(['<tool_call>\n{"na'])[:2] == ('<tool_call>\n{"na', {})
