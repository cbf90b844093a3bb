"""metav1.Condition bookkeeping: lastTransitionTime moves only with status."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from specpair_operator.conditions import ConditionUpdate, merge_conditions, transitioned

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_new_condition_gets_now_and_generation() -> None:
    result = merge_conditions(
        [], [ConditionUpdate("Ready", "False", "Creating", "wait")], generation=3, now=T0
    )
    assert result == [
        {
            "type": "Ready",
            "status": "False",
            "observedGeneration": 3,
            "lastTransitionTime": "2026-01-02T03:04:05Z",
            "reason": "Creating",
            "message": "wait",
        }
    ]


def test_same_status_keeps_transition_time_but_updates_the_rest() -> None:
    first = merge_conditions(
        [], [ConditionUpdate("Ready", "False", "Creating", "wait")], generation=1, now=T0
    )
    second = merge_conditions(
        first,
        [ConditionUpdate("Ready", "False", "ReplicasUnavailable", "0/1")],
        generation=2,
        now=T1,
    )
    assert second[0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert (second[0]["reason"], second[0]["observedGeneration"]) == ("ReplicasUnavailable", 2)
    assert not transitioned(first, second, "Ready")
    # Asked for, a new reason alone counts (SpeculationEffective: the runtime fell back).
    assert transitioned(first, second, "Ready", reason=True)
    assert not transitioned(second, second, "Ready", reason=True)


def test_status_change_moves_transition_time() -> None:
    first = merge_conditions([], [ConditionUpdate("Ready", "False", "A", "")], generation=1, now=T0)
    second = merge_conditions(
        first, [ConditionUpdate("Ready", "True", "B", "")], generation=1, now=T1
    )
    assert second[0]["lastTransitionTime"] == "2026-01-02T03:09:05Z"
    assert transitioned(first, second, "Ready")


def test_other_conditions_are_kept_in_place() -> None:
    start = merge_conditions(
        [],
        [ConditionUpdate("Ready", "True", "A", ""), ConditionUpdate("Degraded", "False", "B", "")],
        generation=1,
        now=T0,
    )
    result = merge_conditions(
        start, [ConditionUpdate("Degraded", "True", "C", "bad")], generation=2, now=T1
    )
    assert [c["type"] for c in result] == ["Ready", "Degraded"]
    assert result[0] == start[0]
    assert not transitioned(start, result, "Ready")
    assert transitioned(start, result, "Degraded")


def test_unchanged_input_gives_equal_output() -> None:
    updates = [ConditionUpdate("Ready", "True", "Available", "1/1")]
    first = merge_conditions([], updates, generation=1, now=T0)
    assert merge_conditions(first, updates, generation=1, now=T1) == first


def test_speculation_events_warn_when_the_draft_stops_helping() -> None:
    from specpair_operator.reconcile import _emit_transitions

    Conditions = list[dict[str, object]]

    def step(before: Conditions, status: str, reason: str) -> tuple[Conditions, list[object]]:
        update = ConditionUpdate("SpeculationEffective", status, reason, "m")  # type: ignore[arg-type]
        after = merge_conditions(before, [update], generation=1, now=T1)
        posted: list[tuple[str, str, str]] = []
        _emit_transitions(before, after, lambda *event: posted.append(event))
        return after, [(kind, why) for kind, why, _ in posted]

    conds, posted = step([], "Unknown", "NotMeasured")
    assert posted == []
    conds, posted = step(conds, "False", "LowAcceptance")
    assert posted == [("Warning", "LowAcceptance")]
    conds, posted = step(conds, "False", "LowAcceptance")
    assert posted == []  # an unchanged pass posts nothing
    conds, posted = step(conds, "False", "RuntimeFellBack")
    assert posted == [("Warning", "RuntimeFellBack")]  # same status, news all the same
    conds, posted = step(conds, "True", "Effective")
    assert posted == [("Normal", "Effective")]
    conds, posted = step(conds, "False", "SpeculationOff")
    assert posted == []  # turned off on purpose
