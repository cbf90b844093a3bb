"""Incremental detokenization, stop strings, EOS and max_new_tokens."""

from __future__ import annotations

import random

import pytest
from tools.tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from specpair_runtime.engine.stopping import (
    IncrementalDetokenizer,
    OutputStream,
    find_stop,
    held_suffix_length,
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def test_incremental_text_equals_full_decode(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    prompt = tokenizer("Hello, how can I help")["input_ids"]
    text_ids = tokenizer("Café 東京 ☕ déjà vu, the quick brown fox")["input_ids"]
    special = set(tokenizer.all_special_ids)
    for trial in range(300):
        # Real text, and random ids (which split multi-byte characters anywhere).
        ids = text_ids if trial == 0 else [rng.randrange(len(tokenizer)) for _ in range(40)]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pieces = []
        for token in ids:
            pieces.append(detok.add(token))
            # An incomplete character spans at most 3 tokens; only they are held
            # (and skipped special tokens between its bytes, which add no bytes).
            held = [t for t in detok.ids[detok.read_offset :] if t not in special]
            assert len(held) <= 3, (trial, held)
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        if trial == 0:  # valid text: an incomplete character is never released mid-stream
            assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_bytes_that_never_form_a_character_do_not_stall_the_stream(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    char_ids = tokenizer("語", add_special_tokens=False)["input_ids"]  # one byte a token
    assert len(char_ids) == 3
    stray = char_ids[1]  # a continuation byte: alone it is invalid UTF-8
    assert tokenizer.decode([stray, stray]) == "\ufffd\ufffd"
    detok = IncrementalDetokenizer(tokenizer, [])
    ids = [stray] * 6 + char_ids
    pieces = [detok.add(t) for t in ids]
    # A stray byte is released as soon as the next token shows that nothing completes it,
    # and a character whose bytes arrive one by one still comes out whole.
    assert pieces == [""] + ["\ufffd"] * 5 + ["\ufffd", "", "語"]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)


def test_held_suffix_and_find_stop() -> None:
    assert held_suffix_length("hello wor", ["world"]) == 3
    assert held_suffix_length("hello", ["xyz"]) == 0
    assert held_suffix_length("ab", ["abc", "b"]) == 2
    assert find_stop("one STOP two END", ["END", "STOP"]) == 4
    assert find_stop("nothing", ["END"]) is None


def _stream(tokenizer: PreTrainedTokenizerFast, **kwargs: object) -> OutputStream:
    defaults: dict[str, object] = {
        "eos_ids": {tokenizer.eos_token_id},
        "stop": (),
        "max_new_tokens": 100,
    }
    defaults.update(kwargs)
    return OutputStream(tokenizer, [tokenizer.bos_token_id], **defaults)  # type: ignore[arg-type]


def test_stop_string_across_tokens_is_trimmed_and_never_leaked(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = tokenizer("Thank you. STOP here. The end.")["input_ids"]
    stream = _stream(tokenizer, stop=("STOP here",))
    released: list[str] = []
    kept: list[int] = []
    for token in ids:  # one token per commit: the worst case for hold-back
        result = stream.push([token])
        released.append(result.text)
        kept.extend(result.token_ids)
        assert "S" not in result.text  # not even the start of the stop string leaks
        if result.finish_reason:
            break
    text = "".join(released)
    assert text == "Thank you. "
    assert stream.finish_reason == "stop"
    assert "STOP" not in text and len(kept) < len(ids)
    decoded = str(tokenizer.decode(kept))
    assert decoded.startswith("Thank you. STOP here")


def test_multi_token_commit_stops_inside_the_commit(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("one two three four five")["input_ids"]
    stream = _stream(tokenizer, stop=("three",))
    result = stream.push(ids)
    assert result.text == "one two "
    assert result.finish_reason == "stop"
    assert stream.push([5]).token_ids == []  # finished streams take nothing more


def test_eos_stops_and_is_kept_as_a_token_but_not_text(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("one two")["input_ids"]
    stream = _stream(tokenizer)
    result = stream.push([*ids, tokenizer.eos_token_id, *ids])
    assert result.token_ids == [*ids, tokenizer.eos_token_id]
    assert result.text == "one two" and result.finish_reason == "stop"


def test_max_new_tokens_cuts_a_commit(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("one two three four five six")["input_ids"]
    stream = _stream(tokenizer, max_new_tokens=3)
    first = stream.push(ids[:2])
    second = stream.push(ids[2:])
    assert first.finish_reason is None and second.finish_reason == "length"
    assert len(first.token_ids) + len(second.token_ids) == 3
    assert first.text + second.text == tokenizer.decode(ids[:3])


def test_possible_stop_prefix_is_held_then_released(tokenizer: PreTrainedTokenizerFast) -> None:
    stream = _stream(tokenizer, stop=("the end",))
    first = stream.push(tokenizer("go to the")["input_ids"])
    assert first.text == "go to "  # "the" might start "the end": held back
    second = stream.push(tokenizer(" store")["input_ids"])
    assert first.text + second.text == "go to the store"
    assert second.finish_reason is None
