"""bench/bench_depth_policies.py: replaying a draft trace under depth policies."""

from __future__ import annotations

import pytest
from bench.bench_depth_policies import (
    Costs,
    accepted_run,
    confidence_stop,
    fixed,
    format_table,
    main,
    oracle,
    policies,
    replay,
    replay_table,
)
from bench.bench_draft_agreement import DraftPosition

# A verify costs one step up to 3 tokens, then more; a draft forward a tenth of a step.
COSTS = Costs(draft=0.1, verify={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.2, 5: 1.4})


def trace(agrees: str, confidences: list[float] | None = None) -> list[DraftPosition]:
    """``agrees`` as a string of y/n, one per position."""
    values = confidences or [0.9] * len(agrees)
    return [DraftPosition(a == "y", c) for a, c in zip(agrees, values, strict=True)]


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
    assert names == ["target-only", "k=1", "k=2", "confidence 0.4 <=4", "oracle <=4"]
    assert rows[0].vs_target_only == 1.0
    # k=1 against a direct replay of both traces; target-only: 12 tokens in 12 s.
    direct = [replay(t, fixed(1), COSTS) for t in traces]
    tokens = sum(r.tokens for r in direct)
    seconds = sum(r.seconds for r in direct)
    assert rows[1].tokens_per_second == pytest.approx(tokens / seconds)
    assert rows[1].vs_target_only == pytest.approx((tokens / seconds) / (12 / 12.0))
    assert "oracle <=4" in format_table(rows)


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
