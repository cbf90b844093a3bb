"""SpeculationEffective: is the draft helping? (operator/specpair_operator/effectiveness.py)."""

from __future__ import annotations

from typing import Any

import pytest

from specpair_operator.api import parse_spec
from specpair_operator.effectiveness import NOT_HELPING, Inputs, break_even_rate, verdict
from tests.support.operator_process import SAMPLE

KNOBS = {"enabled": True, "maxDepth": 4, "acceptanceFloor": 0.0}


Interval = dict[str, Any]


def interval(rate: float, drafted: int = 400, share: float | None = 0.9, **more: Any) -> Interval:
    return {
        "rate": rate,
        "draftedTokens": drafted,
        "generatedTokens": 1000,
        "speculatedShare": share,
        "revision": "r1",
        "speculationOff": [],
        **more,
    }


def judge(
    acceptance: Interval | None, knobs: Interval | None = None, current: str | None = "r1"
) -> tuple[str, str, str]:
    inputs = Inputs(
        knobs=knobs or KNOBS,
        acceptance=acceptance,
        current_revision=current,
        min_drafted_tokens=200,
        break_even=0.155,
    )
    cond = verdict(inputs)
    assert cond.type == "SpeculationEffective"
    return cond.status, cond.reason, cond.message


def test_break_even_is_the_share_of_bytes_a_drafted_token_reads() -> None:
    spec = parse_spec(SAMPLE["spec"])  # Llama-3.1-8B target, Llama-3.2-1B draft, bf16
    assert break_even_rate(spec) == pytest.approx(1_235_814_400 / 8_030_261_248)
    int4 = SAMPLE["spec"] | {"draft": {**SAMPLE["spec"]["draft"], "quantization": "int4-weight"}}
    assert break_even_rate(parse_spec(int4)) == pytest.approx(
        1_235_814_400 * 0.5 / (8_030_261_248 * 2)
    )
    same = SAMPLE["spec"] | {"draft": {**SAMPLE["spec"]["target"], "source": "hf://other@1"}}
    assert break_even_rate(parse_spec(same)) == 1.0


def test_a_draft_that_never_agrees_is_low_acceptance() -> None:
    status, reason, message = judge(interval(0.0, drafted=404))
    assert (status, reason) == ("False", "LowAcceptance")
    assert "acceptance 0.000 over 404 drafted tokens of revision r1" in message
    assert "break-even rate 0.155" in message and "still serves" in message
    assert reason in NOT_HELPING


def test_the_acceptance_floor_knob_raises_the_bar() -> None:
    status, reason, message = judge(interval(0.3), {**KNOBS, "acceptanceFloor": 0.4})
    assert (status, reason) == ("False", "LowAcceptance")
    assert "speculation.acceptanceFloor 0.400" in message
    assert judge(interval(0.3))[:2] == ("True", "Effective")


def test_a_helping_draft_is_effective_and_says_how_much() -> None:
    status, reason, message = judge(interval(0.71, share=0.93))
    assert (status, reason) == ("True", "Effective")
    assert "acceptance 0.710" in message and "93% of the generated tokens" in message


def test_mostly_target_only_steps_mean_the_draft_is_rarely_used() -> None:
    status, reason, message = judge(interval(0.6, share=0.2))
    assert (status, reason) == ("False", "MostlyTargetOnly")
    assert "only 20% of the 1000 tokens" in message and "not paying" in message
    assert judge(interval(0.6, share=0.5))[:2] == ("True", "Effective")


def test_the_runtime_falling_back_is_shown_before_any_full_interval() -> None:
    off = [{"pod": "p-1", "reason": "acceptance_floor"}, {"pod": "p-2", "reason": "batch_size"}]
    status, reason, message = judge(
        interval(0.05, drafted=32, speculationOff=off), {**KNOBS, "acceptanceFloor": 0.3}
    )
    assert (status, reason) == ("False", "RuntimeFellBack")
    assert "on p-1:" in message and "acceptanceFloor 0.300" in message
    assert "target-only" in message and "p-2" not in message
    # A pause (batch size, memory) is not the draft's fault: the interval decides.
    paused = interval(0.05, drafted=32, speculationOff=off[1:])
    assert judge(paused)[:2] == ("Unknown", "NotMeasured")


@pytest.mark.parametrize(
    ("acceptance", "current", "words"),
    [
        (None, "r1", "no acceptance measured"),
        (interval(0.9), "r2", "no acceptance measured"),  # another revision's interval
        (interval(0.9), None, "no acceptance measured"),  # nothing serves
        (interval(0.0, drafted=199), "r1", "199 of the 200 drafted tokens"),
    ],
)
def test_too_little_to_judge_is_unknown(
    acceptance: Interval | None, current: str | None, words: str
) -> None:
    status, reason, message = judge(acceptance, current=current)
    assert (status, reason) == ("Unknown", "NotMeasured")
    assert words in message


def test_speculation_turned_off_by_the_knobs_is_said_without_a_verdict() -> None:
    status, reason, message = judge(interval(0.0), {**KNOBS, "enabled": False})
    assert (status, reason) == ("False", "SpeculationOff")
    assert reason not in NOT_HELPING and "TargetOnly" in message
