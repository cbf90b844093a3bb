"""Prefix reuse's admission plan: which slot a new request takes, and what it skips."""

from __future__ import annotations

import pytest

from specpair_runtime.engine.prefix_reuse import (
    MIN_AWAITED_PREFIX,
    Admission,
    SlotContents,
    awaits_prefix,
    common_prefix_length,
    plan_admission,
)

SYSTEM = (1, 2, 3, 4, 5, 6)


def held(*tokens: int, draft: int | None = None) -> SlotContents:
    return SlotContents(tokens, len(tokens) if draft is None else draft)


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([9], [1]) == 0


def test_the_free_slot_holding_the_longest_prefix_is_taken_as_it_is() -> None:
    prompt = [*SYSTEM, 7, 8, 9]
    retained = {0: held(1, 2, 9), 2: held(*SYSTEM, 7, 50, draft=5), 3: held(*SYSTEM)}
    plan = plan_admission(prompt, [0, 2, 3], retained, {})
    # Taking slot 2 loses its one token past the match; slot 0 would lose three.
    assert plan == Admission(slot=2, reused=7, draft_reused=5)


def test_a_slot_holding_a_longer_conversation_is_kept_and_its_prefix_copied() -> None:
    prompt = [*SYSTEM, 7, 8]
    conversation = held(*SYSTEM, 20, 21, 22, 23, 24, 25, draft=9)
    plan = plan_admission(prompt, [0, 1, 2], {0: conversation, 2: held(3, 3)}, {})
    # The request shares only the system prompt: slot 1 (empty) gets a copy of it.
    assert plan == Admission(slot=1, reused=6, draft_reused=6, copy_from=0)


def test_the_last_two_prompt_tokens_are_always_read_as_a_prompt_chunk() -> None:
    prompt = [*SYSTEM]
    plan = plan_admission(prompt, [0], {0: held(*SYSTEM, 7)}, {})
    assert plan == Admission(slot=0, reused=len(SYSTEM) - 2, draft_reused=len(SYSTEM) - 2)
    assert plan_admission([5, 6], [0], {0: held(5, 6)}, {}).reused == 0
    assert plan_admission([5], [0], {0: held(5, 6)}, {}).reused == 0


def test_a_running_requests_longer_prefix_is_copied_into_the_least_holding_free_slot() -> None:
    prompt = [*SYSTEM, 7, 8, 9]
    retained = {0: held(1, 2), 1: held(1, 2, 3, 40, 41, 42)}
    running = {2: held(*SYSTEM, 7, 60, draft=4), 3: held(*SYSTEM, 70)}
    plan = plan_admission(prompt, [0, 1, 4], retained, running)
    # Slot 4 holds nothing, so it is overwritten first; slot 2 matches 7 tokens.
    assert plan == Admission(slot=4, reused=7, draft_reused=4, copy_from=2)


def test_a_free_match_as_long_as_a_running_one_needs_no_copy() -> None:
    prompt = [*SYSTEM, 7, 9]
    plan = plan_admission(prompt, [0, 1], {1: held(*SYSTEM)}, {5: held(*SYSTEM, 8)})
    assert plan == Admission(slot=1, reused=6, draft_reused=6)


def test_without_any_match_the_slot_holding_least_is_overwritten_lowest_first() -> None:
    retained = {0: held(9, 9, 9), 1: held(8), 3: held(7)}
    assert plan_admission([1, 2], [0, 1, 3], retained, {}) == Admission(1, 0, 0)
    assert plan_admission([1, 2], [0, 1, 2], retained, {}) == Admission(2, 0, 0)
    assert plan_admission([1, 2], [4], {}, {0: held(5)}) == Admission(4, 0, 0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="free slot"):
        plan_admission([1, 2], [], {}, {})
    with pytest.raises(ValueError, match="draft_len 3"):
        SlotContents((1, 2), 3)


def test_a_prompt_waits_for_a_shared_prefix_that_a_running_request_is_reading() -> None:
    prompt = list(range(40))
    # Another request with the same first 30 tokens has read 4 of them.
    assert awaits_prefix(prompt, 0, [([*range(30), 99], 4)])
    # It has read them all, or nearly: take what is there.
    assert not awaits_prefix(prompt, 0, [([*range(30), 99], 30)])
    assert not awaits_prefix(prompt, 20, [([*range(30), 99], 4)])
    # Too short a share to wait for; the last two prompt tokens never count.
    assert not awaits_prefix(prompt, 0, [(list(range(MIN_AWAITED_PREFIX - 1)), 0)])
    assert not awaits_prefix(list(range(MIN_AWAITED_PREFIX + 1)), 0, [(list(range(64)), 0)])
    assert not awaits_prefix(prompt, 0, [])
