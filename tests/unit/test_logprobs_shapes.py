"""OpenAI's logprobs shapes from the engine's entries (``server/logprobs.py``)."""

from __future__ import annotations

import math

from specpair_runtime.engine.api import TokenLogprob
from specpair_runtime.server.logprobs import (
    LOGPROB_FLOOR,
    CompletionLogprobsBuilder,
    chat_logprobs,
    token_texts,
)

TEXTS = {1: "def", 2: " add", 3: "(", 4: "\ufffd", 5: "\ufffd"}


def text(token_id: int) -> str:
    return TEXTS[token_id]


def test_chat_entries_carry_bytes_and_alternatives_in_order() -> None:
    entries = [TokenLogprob(1, -0.1, ((1, -0.1), (2, -2.5))), TokenLogprob(4, -0.3)]
    shape = chat_logprobs(entries, text)
    first, second = shape.content
    assert (first.token, first.logprob, first.bytes) == ("def", -0.1, [100, 101, 102])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("def", -0.1), (" add", -2.5)]
    assert second.bytes == list("\ufffd".encode()) and second.top_logprobs == []


def test_minus_infinity_becomes_the_floor() -> None:
    entries = [TokenLogprob(2, -math.inf, ((1, 0.0), (3, -math.inf)))]
    chat = chat_logprobs(entries, text).content[0]
    assert chat.logprob == LOGPROB_FLOOR and chat.top_logprobs[1].logprob == LOGPROB_FLOOR
    legacy = CompletionLogprobsBuilder(text).build(entries)
    assert legacy.token_logprobs == [LOGPROB_FLOOR]
    assert legacy.top_logprobs == [{" add": LOGPROB_FLOOR, "def": 0.0, "(": LOGPROB_FLOOR}]
    assert all(math.isfinite(v) for v in legacy.top_logprobs[0].values())


def test_completion_offsets_continue_across_chunks() -> None:
    builder = CompletionLogprobsBuilder(text)
    first = builder.build([TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)])
    second = builder.build([TokenLogprob(3, -0.3)])
    assert first.text_offset == [0, 3] and second.text_offset == [7]
    assert first.tokens == ["def", " add"] and second.top_logprobs == [{"(": -0.3}]


def test_the_chosen_token_keeps_its_value_when_an_alternative_shares_its_text() -> None:
    # Two byte tokens both decode to U+FFFD: the legacy shape is keyed by text.
    legacy = CompletionLogprobsBuilder(text).build([TokenLogprob(4, -1.0, ((5, -0.5), (4, -1.0)))])
    assert legacy.top_logprobs == [{"\ufffd": -1.0}]


def test_token_texts_decode_each_id_once() -> None:
    calls: list[list[int]] = []

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            calls.append(ids)
            return f"<{ids[0]}>"

    lookup = token_texts(Tokenizer())
    assert [lookup(7), lookup(7), lookup(8)] == ["<7>", "<7>", "<8>"]
    assert calls == [[7], [8]]
