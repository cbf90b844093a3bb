"""The measured per-step token budget (chunked prefill)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from specpair_runtime.config import STEP_TOKENS_START
from specpair_runtime.engine.budget import (
    GROWTH,
    MIN_PREFILL_CHUNK,
    PREFILL_AGING,
    STEADY_DRAFT_FEED,
    STEP_ALLOWANCE,
    StepBudget,
    StepTiming,
    chunk_cost,
    chunk_size,
    draft_catch_up,
    prefill_order,
)
from specpair_runtime.engine.options import IDLE_PREFILL_FACTOR, EngineOptions

DEFAULT_STEP_TOKENS_CPU = STEP_TOKENS_START["cpu"]


def test_a_configured_budget_is_fixed() -> None:
    budget = EngineOptions(max_step_tokens=48).step_budget(_cpu())
    budget.record(4, 1, 0, 0.010)
    budget.record(4, 1, 48, 0.500)  # a slow chunk does not move it
    assert budget.fixed and budget.tokens == 48
    assert budget.ceiling == 48 * IDLE_PREFILL_FACTOR


def test_an_unconfigured_budget_starts_at_the_device_default() -> None:
    budget = EngineOptions().step_budget(_cpu())
    assert not budget.fixed
    assert budget.tokens == DEFAULT_STEP_TOKENS_CPU
    assert budget.ceiling == DEFAULT_STEP_TOKENS_CPU * IDLE_PREFILL_FACTOR


def test_cheap_chunks_grow_the_budget_at_most_by_growth_per_step() -> None:
    budget = StepBudget(32, 256)
    budget.record(8, 1, 0, 0.010)
    budget.record(8, 1, 32, 0.010)  # the chunk cost nothing measurable
    assert budget.tokens == int(32 * GROWTH)
    for _ in range(10):
        budget.record(8, 1, budget.tokens, 0.0101)
    assert budget.tokens == 256  # the ceiling


def test_expensive_chunks_shrink_the_budget_to_the_allowance() -> None:
    budget = StepBudget(32, 256)
    pure = 0.100
    per_token = 0.005  # each prompt token costs 5 % of a decode step
    budget.record(4, 2, 0, pure)
    budget.record(4, 2, 32, pure + 32 * per_token)
    expected = int(STEP_ALLOWANCE * pure / per_token) + 4 * 3
    assert budget.tokens == expected == 17


def test_the_budget_never_falls_below_the_floor() -> None:
    budget = StepBudget(32, 256)
    budget.record(1, 0, 0, 0.001)
    budget.record(1, 0, 32, 10.0)
    assert budget.tokens == MIN_PREFILL_CHUNK


def test_one_noisy_step_does_not_swing_the_estimate() -> None:
    budget = StepBudget(32, 256)
    budget.record(2, 1, 0, 0.100)
    for _ in range(4):
        budget.record(2, 1, 20, 0.100 + 20 * 0.001)
    settled = budget.tokens
    budget.record(2, 1, 20, 5.0)  # a neighbour's burst
    assert budget.tokens == settled
    assert not budget.fixed


def test_one_slow_step_at_a_new_size_shrinks_a_growing_budget() -> None:
    # Deliberately cautious. A growing budget tries a new chunk size in every
    # step, so a slow step is its own point of the line: a robust fit (Theil-Sen)
    # would keep growing through it, and the streams beside an oversized chunk
    # pay for it in their inter-token latency.
    budget = StepBudget(8, 256)
    budget.record(2, 0, 0, 0.0030)
    sizes = []
    for step in range(10):
        chunk = budget.tokens - 2
        sizes.append(chunk)
        budget.record(2, 0, chunk, 0.0075 if step == 9 else 0.0035)
    assert sizes[-1] > 32  # it grew while chunks were cheap
    assert budget.tokens < sizes[-1]  # and the slow one is believed at once


def test_a_chunk_without_a_pure_step_of_its_depth_is_not_used() -> None:
    budget = StepBudget(32, 256)
    budget.record(2, 1, 0, 0.100)
    budget.record(2, 3, 32, 9.0)  # depth 3: no pure step to compare with
    budget.record(0, 0, 256, 9.0)  # an idle step: nobody waited
    assert budget.tokens == 32 and not budget.extra


def test_a_chunk_compares_with_the_nearest_batch_size_when_its_own_was_never_pure() -> None:
    # Under steady arrivals the step that takes a prompt has one decoding row
    # fewer than the pure steps around it.
    budget = StepBudget(32, 256)
    budget.record(8, 1, 0, 0.100)
    budget.record(2, 3, 0, 0.010)  # another depth: no reference
    budget.record(7, 1, 32, 0.100 + 32 * 0.001)
    tokens, extra = budget.extra[-1]
    assert tokens == 32 and extra == pytest.approx(32 * 0.001)


def test_a_chunk_between_two_pure_batch_sizes_compares_with_a_line_between_them() -> None:
    # The 1.5B pair at 8 streams: 6-row steps with prompt work, pure steps on record
    # only of 1 row (the single stream's) and of 8 rows.
    budget = StepBudget(32, 256)
    budget.record(1, 1, 0, 0.360)
    budget.record(8, 1, 0, 0.640)
    budget.record(6, 1, 8, 0.600)
    [(tokens, extra)] = budget.extra
    assert tokens == 8 and extra == pytest.approx(0.600 - (0.360 + 0.280 * 5 / 7))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="tokens <= ceiling"):
        StepBudget(64, 32)


def _cpu() -> torch.device:
    return torch.device("cpu")


def test_chunk_cost_fits_a_fixed_part_and_a_per_token_part() -> None:
    samples = deque([(16, 0.010 + 16 * 0.001), (32, 0.010 + 32 * 0.001), (64, 0.010 + 64 * 0.001)])
    fixed, per_token = chunk_cost(samples)
    assert fixed == pytest.approx(0.010)
    assert per_token == pytest.approx(0.001)


def test_chunk_cost_with_one_size_charges_it_all_per_token() -> None:
    assert chunk_cost(deque([(20, 0.040), (20, 0.050), (20, 0.045)])) == (0.0, 0.045 / 20)


def test_a_fixed_cost_beyond_the_allowance_takes_prompts_in_few_steps() -> None:
    # Chunks that cost a fixed 4 ms and next to nothing per token: half the allowance
    # buys any size, so prompts enter in as few steps as possible.
    budget = StepBudget(32, 256)
    budget.record(8, 1, 0, 0.005)
    for _ in range(16):
        size = budget.tokens - 16
        budget.record(8, 1, size, 0.005 + 0.004 + size * 1e-6)
    assert budget.tokens == 256


def test_a_fixed_cost_beyond_the_allowance_keeps_costly_chunks_bounded() -> None:
    # The 1.5B pair on 2 AMD vCPUs: a prompt token costs 25 ms beside a 340 ms pure
    # step, and mixed steps read a 150 ms fixed part. Growing to the ceiling took
    # whole prompts in 2.4-3.2 s steps; the chunk gets half the allowance instead.
    pure, fixed, per_token, rows = 0.340, 0.150, 0.025, 8
    budget = StepBudget(32, 256)
    budget.record(rows, 1, 0, pure)
    for _ in range(24):
        chunk = max(budget.tokens - rows * 2, MIN_PREFILL_CHUNK)
        budget.record(rows, 1, chunk, pure + fixed + chunk * per_token)
    half = STEP_ALLOWANCE / 2 * pure
    assert budget.tokens == int(half / per_token) + rows * 2
    chunk = max(budget.tokens - rows * 2, MIN_PREFILL_CHUNK)
    assert chunk * per_token <= max(half, MIN_PREFILL_CHUNK * per_token)


def test_the_chunk_share_of_the_allowance_falls_as_the_fixed_part_grows() -> None:
    # No cliff at the allowance: a larger fixed part never buys a larger chunk.
    pure, per_token = 0.340, 0.002
    budgets = []
    for fixed in (0.0, 0.02, 0.04, 0.06, 0.085, 0.2):
        budget = StepBudget(256, 256)  # at the ceiling: growth does not cap the answer
        budget.record(4, 1, 0, pure)
        for chunk in (8, 16, 32, 8, 16, 32):
            budget.record(4, 1, chunk, pure + fixed + chunk * per_token)
        budgets.append(budget.tokens)
    allowance = STEP_ALLOWANCE * pure
    assert budgets[0] == int(allowance / per_token) + 4 * 2
    assert budgets[-2:] == [int(allowance / 2 / per_token) + 4 * 2] * 2
    assert budgets == sorted(budgets, reverse=True)


def test_close_chunk_sizes_are_read_per_token_however_the_noise_tilts_the_line() -> None:
    # 8, 9 and 10 tokens whose noisy extras fall with size: a fitted line is flat
    # ("chunks are free") and would double the budget; per token it stays put.
    samples = deque([(8, 0.080), (9, 0.072), (10, 0.070)])
    fixed, per_token = chunk_cost(samples)
    assert fixed == 0.0
    assert per_token == pytest.approx((8 * 0.080 + 9 * 0.072 + 10 * 0.070) / (64 + 81 + 100))
    budget = StepBudget(16, 256)
    budget.record(8, 0, 0, 0.300)
    for tokens, extra in samples:
        budget.record(8, 0, tokens, 0.300 + extra)
    # 25 % of 300 ms buys 9 prompt tokens at 8.1 ms each, beside the 8 decodes; not 32.
    assert budget.tokens == int(STEP_ALLOWANCE * 0.300 / per_token) + 8 == 17


def test_a_draft_catch_up_alone_is_neither_pure_nor_a_chunk_sample() -> None:
    budget = StepBudget(32, 256)
    budget.record(4, 1, 0, 0.100)
    budget.record(4, 1, 0, 0.130, draft_catch_up=20)  # the draft prefills a prompt
    assert min(budget.pure[(4, 1)]) == 0.100 and len(budget.pure[(4, 1)]) == 1
    assert not budget.extra and budget.tokens == 32


def test_the_budget_counts_target_tokens_so_the_drafts_catch_up_fits_in_the_allowance() -> None:
    # A prompt token costs the target 8 ms and the draft 1.5 ms; the draft catches
    # up on as many tokens as the target took. Charged per target token, a step
    # with its catch-up stays within the allowance; charged per token of both
    # models, the per-token cost read 4.75 ms and the steps took 1.4x a pure one.
    target_ms, draft_ms, pure = 0.008, 0.0015, 0.540
    budget = StepBudget(16, 256)
    budget.record(7, 1, 0, pure)
    for _ in range(12):
        chunk = budget.tokens - 7 * 2
        budget.record(7, 1, chunk, pure + chunk * (target_ms + draft_ms), draft_catch_up=chunk)
    chunk = budget.tokens - 7 * 2
    assert pure + chunk * (target_ms + draft_ms) <= (1 + STEP_ALLOWANCE) * pure


@pytest.mark.parametrize(
    ("pending", "left", "first", "size"),
    [
        (100, 20, True, 20),  # what the budget leaves
        (100, -4, True, MIN_PREFILL_CHUNK),  # the decodes used it up: the floor
        (100, -4, False, 0),  # only the first chunk of a step gets the floor
        (5, 20, True, 5),  # never more than is pending
    ],
)
def test_the_first_chunk_of_a_step_gets_at_least_the_floor(
    pending: int, left: int, first: bool, size: int
) -> None:
    assert chunk_size(pending, left, first) == size


def test_an_unmeasured_budget_leaves_prompt_work_only_the_floor() -> None:
    # The start value is a guess: on the 1.5B pair, 23-27 prompt tokens beside 1-4
    # decoding rows can take one and a half to two times a neighbouring step, so
    # until a chunk is timed prompt work gets only the floor.
    budget = StepBudget(32, 256)
    left = 32 - 4 * 2  # four rows decoding at depth 1
    assert budget.chunk_room(left) == 0
    assert chunk_size(100, budget.chunk_room(left), True) == MIN_PREFILL_CHUNK
    assert budget.chunk_room(-3) == -3
    budget.record(4, 1, 0, 0.500)
    assert budget.chunk_room(left) == 0  # a pure step alone measures no chunk
    budget.record(4, 1, MIN_PREFILL_CHUNK, 0.540)
    assert budget.chunk_room(left) == left
    assert StepBudget(32, 256, fixed=True).chunk_room(left) == left


@pytest.mark.parametrize(
    ("fed", "drafts", "catch_up"),
    [
        (0, False, 0),  # a prefill row whose draft is caught up
        (12, False, 12),  # a row that only catches up
        (1, True, 0),  # a draft was rejected: the draft reads the recovered token
        (STEADY_DRAFT_FEED, True, 0),  # all accepted: its last draft and the bonus
        (17, True, 15),  # a prefill just ended: the draft reads its last chunk first
    ],
)
def test_a_drafting_rows_feed_beyond_a_steady_decode_is_catch_up(
    fed: int, drafts: bool, catch_up: int
) -> None:
    assert draft_catch_up(fed, drafts) == catch_up


def test_a_step_whose_drafting_row_catches_up_cannot_set_the_pure_reference() -> None:
    # The engine passes the hidden catch-up; the 0.69 s step must not become the
    # 8-row reference that every chunk is then measured against.
    budget = StepBudget(16, 256)
    budget.record(8, 1, 0, 0.690, draft_catch_up=draft_catch_up(9, True))
    assert (8, 1) not in budget.pure
    budget.record(8, 1, 0, 0.500, draft_catch_up=draft_catch_up(2, True))
    assert list(budget.pure[(8, 1)]) == [0.500]


@pytest.mark.parametrize(
    ("decoding_rows", "prompt_tokens", "kind"),
    [(3, 0, "decode"), (3, 8, "mixed"), (1, 1, "mixed"), (0, 32, "prefill")],
)
def test_a_step_is_named_by_what_it_carried(
    decoding_rows: int, prompt_tokens: int, kind: str
) -> None:
    assert StepTiming.of(decoding_rows, prompt_tokens, 0.5) == StepTiming(kind, 0.5)  # type: ignore[arg-type]


def test_the_shortest_remaining_prompt_goes_first() -> None:
    # Admitted in this order, all in this step: 600, 20 and 300 tokens left.
    assert prefill_order([600, 20, 300], [0, 0, 0]) == [1, 2, 0]


def test_equal_prompts_keep_their_admission_order() -> None:
    assert prefill_order([50, 50, 50], [0, 0, 0]) == [0, 1, 2]
    assert prefill_order([], []) == []


def test_a_waiting_prompt_goes_first_after_its_tokens_over_the_aging_in_steps() -> None:
    """Aging: each step waited counts as PREFILL_AGING tokens read."""
    long = 600
    steps = long // PREFILL_AGING
    # A fresh short prompt beside a long one that has waited a while: the short one first.
    assert prefill_order([long, 1], [steps - 2, 0]) == [1, 0]
    # Once the long one's key is 0, no newcomer (at least 1 token) passes it.
    assert prefill_order([long, 1], [steps, 0]) == [0, 1]
    # Two old prompts keep the order their keys give.
    assert prefill_order([long, long + 3 * PREFILL_AGING], [0, 4]) == [1, 0]
