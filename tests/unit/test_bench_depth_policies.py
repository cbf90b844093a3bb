"""bench/bench_depth_policies.py: replaying a draft trace under depth policies."""

from __future__ import annotations

import pytest
from bench.bench_depth_policies import (
    Branches,
    Costs,
    HeuristicSchedule,
    accepted_run,
    break_even_threshold,
    confidence_stop,
    fixed,
    format_table,
    main,
    oracle,
    policies,
    product_stop,
    replay,
    replay_branches,
    replay_table,
)
from bench.bench_draft_agreement import DraftPosition

# A verify costs one step up to 3 tokens, then more; a draft forward a tenth of a step.
COSTS = Costs(draft=0.1, verify={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.2, 5: 1.4, 6: 1.6})


def trace(agrees: str, confidences: list[float] | None = None) -> list[DraftPosition]:
    """``agrees`` as a string, one per position: y (the draft's first choice is the
    target's token), s (its second choice is), n (neither)."""
    values = confidences or [0.9] * len(agrees)
    return [
        DraftPosition(a == "y", c, second_agrees=a == "s")
        for a, c in zip(agrees, values, strict=True)
    ]


def test_accepted_run_counts_leading_agreements_up_to_the_drafts_and_the_end() -> None:
    positions = trace("yyny")
    assert accepted_run(positions, 0, 4) == 2
    assert accepted_run(positions, 0, 1) == 1
    assert accepted_run(positions, 2, 4) == 0
    assert accepted_run(positions, 3, 4) == 1  # the trace ends


def test_target_only_commits_one_token_per_target_forward() -> None:
    result = replay(trace("ynyn"), None, COSTS)
    assert (result.tokens, result.passes) == (4, 4)
    assert result.seconds == pytest.approx(4.0)


def test_a_fixed_depth_commits_the_accepted_run_and_one_more() -> None:
    # Pass 1 at 0: drafts 2, both accepted, +1 bonus -> position 3.
    # Pass 2 at 3: drafts 2, the first rejected, +1 recovered -> position 4.
    # Pass 3 at 4: drafts 2, both accepted -> position 7 (the trace ends at 6).
    result = replay(trace("yyynyy"), fixed(2), COSTS)
    assert result.passes == 3
    assert result.tokens_per_pass == pytest.approx(2.0)
    assert result.seconds == pytest.approx(3 * (2 * 0.1 + 1.0))


def test_the_confidence_rule_keeps_the_unsure_token_and_stops_after_it() -> None:
    positions = trace("yyyyyy", [0.9, 0.3, 0.9, 0.9, 0.9, 0.9])
    rule = confidence_stop(0.4, cap=4)
    assert rule(positions, 0) == 2  # position 1 is below 0.4: drafted, then stop
    assert rule(positions, 2) == 4  # confident to the cap
    assert rule(positions, 5) == 2  # past the end of the trace


def test_the_product_rule_stops_once_the_whole_pass_is_unlikely() -> None:
    positions = trace("yyyyyy", [0.9, 0.8, 0.7, 0.9, 0.9, 0.9])
    # 0.9, 0.72, 0.504 (below 0.6: drafted, then stop); a single token never fell below 0.6.
    assert product_stop(0.6, cap=6)(positions, 0) == 3
    assert product_stop(0.6, cap=2)(positions, 0) == 2  # capped
    assert product_stop(0.6, cap=6)(positions, 3) == 4  # 0.9, 0.81, 0.729, past the end
    assert confidence_stop(0.6, cap=6)(positions, 0) == 6


def test_the_heuristic_schedule_grows_after_full_acceptance_and_shrinks_after_a_miss() -> None:
    schedule = HeuristicSchedule(start=2, cap=5, threshold=0.4)
    positions = trace("yyyyyyyyyyyynyyy")
    assert schedule(positions, 0) == 2
    schedule.observe(2, 2)
    assert schedule.depth == 4
    schedule.observe(4, 4)
    assert schedule.depth == 5  # capped
    schedule.observe(5, 1)
    assert schedule.depth == 4
    for _ in range(6):
        schedule.observe(4, 0)
    assert schedule.depth == 1  # never below one draft
    unsure = trace("yyyy", [0.9, 0.3, 0.9, 0.9])
    assert HeuristicSchedule(start=4, cap=8, threshold=0.4)(unsure, 0) == 2  # the rule inside


def test_replay_tells_a_policy_that_listens_each_pass_outcome() -> None:
    heard: list[tuple[int, int]] = []

    class Listening:
        def __call__(self, positions: object, start: int) -> int:
            return 2

        def observe(self, drafts: int, accepted: int) -> None:
            heard.append((drafts, accepted))

    replay(trace("yyynyy"), Listening(), COSTS)
    assert heard == [(2, 2), (2, 0), (2, 2)]


def test_a_second_choice_branch_turns_a_first_miss_into_two_tokens() -> None:
    # k=2 with a branch at the first draft position; the passes start at:
    #   0: a miss, the second choice right: the branch token and the next -> 2;
    #   2: y, then a miss at the second draft position (no branch there) -> 4;
    #   4: a miss, the second choice wrong -> 5;  5: y y -> the end.
    positions = trace("snysnyy")
    result = replay_branches(positions, Branches(depth=2, positions=1), COSTS)
    assert result.passes == 4
    assert result.seconds == pytest.approx(4 * (2 * 0.1 + COSTS.verify[4]))
    plain = replay(positions, fixed(2), COSTS)
    assert plain.passes == 5  # without the branch the first pass commits one token


def test_branches_beyond_the_depth_are_refused() -> None:
    with pytest.raises(ValueError, match="positions <= depth"):
        Branches(depth=2, positions=3)
    with pytest.raises(ValueError, match="1 <= positions"):
        Branches(depth=2, positions=0)


def test_the_oracle_drafts_to_the_first_miss() -> None:
    positions = trace("yynyyyyy")
    assert oracle(4)(positions, 0) == 3  # two accepted, then the miss
    assert oracle(4)(positions, 3) == 4  # capped
    assert oracle(4)(positions, 2) == 1


def test_the_oracle_is_never_slower_than_a_fixed_depth_with_the_same_cap() -> None:
    positions = trace("yyynyyyyynnyyyynyyy")
    best_fixed = max(replay(positions, fixed(k), COSTS).tokens_per_second for k in (1, 2, 3, 4))
    assert replay(positions, oracle(4), COSTS).tokens_per_second >= best_fixed


def test_a_policy_that_drafts_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 token"):
        replay(trace("yy"), lambda positions, start: 0, COSTS)


def test_the_table_compares_every_policy_with_target_only() -> None:
    traces = [trace("yyynyy"), trace("nnyyyy")]
    rows = replay_table(traces, policies([1, 2], [4]), COSTS)
    names = [row.name for row in rows]
    engine = "product 0.5 <=4"  # the engine's stop at draftConfidence 0.5
    assert names == ["target-only", "k=1", "k=2", "confidence 0.4 <=4", engine, "oracle <=4"]
    assert rows[0].vs_target_only == 1.0
    # k=1 against a direct replay of both traces; target-only: 12 tokens in 12 s.
    direct = [replay(t, fixed(1), COSTS) for t in traces]
    tokens = sum(r.tokens for r in direct)
    seconds = sum(r.seconds for r in direct)
    assert rows[1].tokens_per_second == pytest.approx(tokens / seconds)
    assert rows[1].vs_target_only == pytest.approx((tokens / seconds) / (12 / 12.0))
    assert "oracle <=4" in format_table(rows)


def test_the_fuller_table_adds_products_the_schedule_and_branches() -> None:
    chosen = policies([4], [4], [0.3], [(3, 1)], schedule=True)
    assert list(chosen) == [
        "k=4",
        "confidence 0.4 <=4",
        "product 0.5 <=4",
        "product 0.3 <=4",
        "schedule <=8",
        "k=3 + 2nd at 1",
        "oracle <=4",
    ]
    rows = replay_table([trace("yysyyyyn")], chosen, COSTS)
    branch = next(row for row in rows if row.name == "k=3 + 2nd at 1")
    direct = replay_branches(trace("yysyyyyn"), Branches(3, 1), COSTS)
    assert branch.tokens_per_pass == pytest.approx(direct.tokens_per_pass)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"), (["--rounds", "0"], "--rounds")],
)
def test_bad_flags_name_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(flags)
    assert message in capsys.readouterr().err


def test_the_break_even_bar_is_fixed_depth_fours_rate_times_one_more_tokens_cost() -> None:
    traces = [trace("yyynyy"), trace("nnyyyy")]
    flat = Costs(draft=0.1, verify={n: 1.0 for n in range(1, 7)})
    runs = [replay(t, fixed(4), flat) for t in traces]
    rate = sum(r.tokens for r in runs) / sum(r.seconds for r in runs)
    assert break_even_threshold(traces, flat) == pytest.approx(rate * 0.1)
    # Verify tokens that cost more raise the bar (COSTS: 0.2 s each from 4 tokens on).
    assert break_even_threshold(traces, COSTS) > break_even_threshold(traces, flat)
