"""OpenAI's logprobs shapes from the engine's entries (``server/logprobs.py``)."""

from __future__ import annotations

import math

from specpair_runtime.engine.api import TokenLogprob
from specpair_runtime.server.logprobs import (
    LOGPROB_FLOOR,
    CompletionLogprobsBuilder,
    chat_logprobs,
)
from specpair_runtime.server.token_pieces import TokenPiece, piece_of

# 4 and 5: two halves of "é" (b"\xc3\xa9"); 6 and 7: two tokens with the same bytes
# (as "A" and the byte-fallback "<0x41>"); 8: a byte that starts a 3-byte character.
DATA = {1: b"def", 2: b" add", 3: b"(", 4: b"\xc3", 5: b"\xa9", 6: b"A", 7: b"A", 8: b"\xe4"}


def piece(token_id: int) -> TokenPiece:
    return piece_of(DATA[token_id])


def test_chat_entries_carry_bytes_and_alternatives_in_order() -> None:
    entries = [TokenLogprob(1, -0.1, ((1, -0.1), (2, -2.5))), TokenLogprob(4, -0.3)]
    shape = chat_logprobs(entries, piece)
    first, second = shape.content
    assert (first.token, first.logprob, first.bytes) == ("def", -0.1, [100, 101, 102])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("def", -0.1), (" add", -2.5)]
    # Half a character: named by its bytes as OpenAI does, and its real byte, not U+FFFD's.
    assert (second.token, second.bytes) == ("bytes:\\xc3", [0xC3])
    assert second.top_logprobs == []


def test_chat_bytes_rebuild_a_character_split_over_tokens() -> None:
    content = chat_logprobs([TokenLogprob(4, -0.1), TokenLogprob(5, -0.2)], piece).content
    assert bytes(b for entry in content for b in entry.bytes).decode() == "é"


def test_minus_infinity_becomes_the_floor() -> None:
    entries = [TokenLogprob(2, -math.inf, ((1, 0.0), (3, -math.inf)))]
    chat = chat_logprobs(entries, piece).content[0]
    assert chat.logprob == LOGPROB_FLOOR and chat.top_logprobs[1].logprob == LOGPROB_FLOOR
    legacy = CompletionLogprobsBuilder(piece).build(entries)
    assert legacy.token_logprobs == [LOGPROB_FLOOR]
    assert legacy.top_logprobs == [{" add": LOGPROB_FLOOR, "def": 0.0, "(": LOGPROB_FLOOR}]
    assert all(math.isfinite(v) for v in legacy.top_logprobs[0].values())


def test_completion_offsets_continue_across_chunks() -> None:
    builder = CompletionLogprobsBuilder(piece)
    first = builder.build([TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)])
    second = builder.build([TokenLogprob(3, -0.3)])
    assert first.text_offset == [0, 3] and second.text_offset == [7]
    assert first.tokens == ["def", " add"] and second.top_logprobs == [{"(": -0.3}]


def test_offsets_count_characters_of_split_ones_once() -> None:
    # "(é(": the token that ends "é" points at its start, the next one past it.
    builder = CompletionLogprobsBuilder(piece)
    ids = [3, 4, 5, 3]
    legacy = builder.build([TokenLogprob(i, -0.1) for i in ids])
    assert legacy.text_offset == [0, 1, 1, 2]
    assert legacy.tokens == ["(", "bytes:\\xc3", "bytes:\\xa9", "("]


def test_no_alternative_is_lost_to_a_shared_name() -> None:
    # Two byte tokens, each U+FFFD when decoded alone, have names of their own.
    legacy = CompletionLogprobsBuilder(piece).build([TokenLogprob(4, -1.0, ((5, -0.5), (4, -1.0)))])
    assert legacy.top_logprobs == [{"bytes:\\xc3": -1.0, "bytes:\\xa9": -0.5}]
    # Two ids with the same bytes: the later one is keyed by its id (vLLM's spelling).
    entry = TokenLogprob(6, -0.2, ((8, -0.1), (6, -0.2), (7, -0.3), (1, -4.0)))
    (top,) = CompletionLogprobsBuilder(piece).build([entry]).top_logprobs
    assert top == {"A": -0.2, "bytes:\\xe4": -0.1, "token_id:7": -0.3, "def": -4.0}
    assert len(top) == 1 + len({t for t, _ in entry.top} - {entry.token_id})
