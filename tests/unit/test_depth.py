"""Depth control: batch cap, cost model, acceptance floor."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specpair_runtime.config import (
    SpeculationKnobs,
    resolved_draft_confidence,
)
from specpair_runtime.engine.cost_model import (
    FIRST_BACKOFF,
    MIN_VERDICT_STEPS,
    TIMING_WINDOW,
    CostModel,
    VerifyLine,
    expected_tokens,
    theil_sen_slope,
)
from specpair_runtime.engine.depth import (
    EXPLORE_EVERY,
    PREFILL,
    PROBE_TARGET_EVERY,
    AcceptanceFloor,
    DepthController,
    StepPlan,
    batch_depth_cap,
)


@pytest.mark.parametrize(
    ("batch", "expected"), [(1, 8), (2, 4), (3, 4), (4, 2), (7, 2), (8, 1), (64, 1)]
)
def test_batch_cap_halves_per_doubling(batch: int, expected: int) -> None:
    assert batch_depth_cap(batch, SpeculationKnobs(max_depth=8)) == expected


def test_batch_cap_respects_min_depth_and_disable_threshold() -> None:
    knobs = SpeculationKnobs(max_depth=8, min_depth=3, disable_above_batch_size=4)
    assert batch_depth_cap(4, knobs) == 3
    assert batch_depth_cap(5, knobs) == 0


def test_expected_tokens() -> None:
    assert expected_tokens([1.0, 1.0], 2) == 3.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([], 2) == 1.0


def test_the_verify_line_is_a_robust_fit_over_all_sizes() -> None:
    assert theil_sen_slope([(5, 1.0), (5, 2.0)]) == 0.0  # one size: flat
    # One spike (a neighbour's job) among four samples does not tilt the line.
    line = VerifyLine.fit([(2, 1.0), (3, 1.1), (5, 1.3), (4, 9.0)])
    assert line.slope == pytest.approx(0.1)
    assert line.seconds(4) == pytest.approx(1.2)  # the level: the lowest residual
    assert VerifyLine.fit([(3, 2.0), (5, 1.0)]).slope == 0.0  # never cheaper with more tokens
    assert VerifyLine(-1.0, 0.1).seconds(2) == 0.0


def _measured(draft: float, verify: dict[int, float], acceptance: float) -> CostModel:
    cost = CostModel()
    cost.record_draft(1, draft)
    for n, seconds in verify.items():
        cost.record_verify(1, n, seconds)
    for _ in range(200):
        # Each position accepted with probability `acceptance`: feed expected counts.
        cost.reached = [100.0] * 8
        cost.accepted = [100.0 * acceptance] * 8
    return cost


def test_cost_cap_turns_speculation_off_when_it_does_not_pay() -> None:
    # The Qwen pair on 2 CPU cores: draft step 37% of a target step, a 5-token
    # verify 3.5x a 1-token step, acceptance ~0.7 (docs: shared notes).
    cost = _measured(0.37, {1: 1.0, 5: 3.5}, 0.7)
    assert cost.cost_cap(1, 1, 4) >= 1  # too few speculation steps for a verdict
    cost.speculation_samples = MIN_VERDICT_STEPS
    assert cost.cost_cap(1, 1, 4) == 0


def test_cost_cap_picks_the_best_depth_when_drafting_is_cheap() -> None:
    cost = _measured(0.05, {1: 1.0, 2: 1.02, 5: 1.1, 9: 1.3}, 0.8)
    depth = cost.cost_cap(1, 1, 8)
    rates = {d: cost.throughput(1, d) for d in range(1, 9)}
    assert depth == max(rates, key=lambda d: rates[d] or 0.0)
    assert depth >= 3


def test_cost_cap_speculates_until_measured() -> None:
    assert CostModel().cost_cap(1, 1, 4) == 4


def test_the_verify_slope_is_the_cost_of_one_more_verify_token() -> None:
    # Costs of the Qwen pair on a 2-core CPU: a draft forward 23 ms, verifies of
    # 1-5 tokens about alike, 200 ms.
    flat = _measured(0.023, {1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2, 5: 0.2}, 0.8)
    assert flat.verify_slope(1) == 0.0
    # Where each verify token costs 25 ms more, the line says so.
    steep = _measured(0.023, {n: 0.2 + 0.025 * (n - 1) for n in range(1, 6)}, 0.8)
    assert steep.verify_slope(1) == pytest.approx(0.025)
    assert steep.verify_slope(2) == 0.0  # batch 2 unmeasured


def test_one_noisy_verify_size_hardly_moves_the_slope() -> None:
    # A fit through all sizes, not the difference of neighbours, so one noisy size
    # moves the slope little.
    noisy = _measured(0.023, {1: 0.29, 2: 0.20, 3: 0.25, 4: 0.22, 5: 0.22}, 0.8)
    assert noisy.verify_slope(1) < 0.005  # nearly flat, as the sizes are


def test_one_size_timed_in_a_fast_moment_does_not_pull_the_depth_down() -> None:
    # A trace of make bench's default on 2 shared vCPUs: draft forwards of 24 ms,
    # verifies of 5, 2, 4 and 2 tokens in that order, the last one in a fast moment
    # of the machine. Compared size by size, t_v(2) = 0.186 s would look a third
    # cheaper than t_v(5) and hold the cap at depth 1.
    cost = CostModel()
    cost.record_draft(1, 0.024)
    cost.record_verify(1, 1, 0.303)
    for n, seconds in ((5, 0.268), (2, 0.330), (4, 0.286), (2, 0.186)):
        cost.record_verify(1, n, seconds)
    cost.reached = [100.0] * 4
    cost.accepted = [56.0, 60.0, 73.0, 81.0]
    line = cost.verify_lines[1]
    assert line.seconds(2) == line.seconds(5)  # the fast moment lowered every size alike
    # At these rates a 4th draft (taken with p = 0.2) about breaks even; depth 1 never.
    assert cost.cost_cap(1, 1, 4) >= 3
    # A slope that every size shows is followed: drafting deep then does not pay.
    steep = CostModel()
    steep.record_draft(1, 0.024)
    for n, seconds in ((5, 0.5), (2, 0.2), (4, 0.4), (3, 0.3), (5, 0.5)):
        steep.record_verify(1, n, seconds)
    steep.reached = [100.0] * 4
    steep.accepted = [56.0, 60.0, 73.0, 81.0]
    assert steep.verify_slope(1) == pytest.approx(0.1)
    assert steep.cost_cap(1, 1, 4) == 1


def test_acceptance_floor_needs_a_full_window() -> None:
    floor = AcceptanceFloor(window=3)
    floor.record(4, 0)
    floor.record(4, 1)
    assert floor.verdict(0.5) is None
    floor.record(4, 0)
    reason = floor.verdict(0.5)
    assert reason is not None and reason.startswith("acceptance_floor")
    assert floor.verdict(0.0) is None  # a floor of 0 disables the rule
    for _ in range(3):
        floor.record(4, 4)
    assert floor.verdict(0.5) is None


def test_controller_probes_target_only_then_backs_off() -> None:
    knobs = SpeculationKnobs(max_depth=4)
    controller = DepthController(knobs, "cpu")
    assert controller.plan(1).cap == 4  # nothing measured yet
    controller.cost.record_draft(1, 0.5)
    controller.cost.record_verify(1, 5, 3.0)
    for _ in range(MIN_VERDICT_STEPS - 1):
        controller.record_speculation_step(4, 1)
        assert controller.plan(1).cap >= 1  # no verdict is due: t_v(1) is not wanted yet
    controller.record_speculation_step(4, 1)
    plan = controller.plan(1)
    assert (plan.cap, plan.reason) == (0, "probe")  # a verdict is due: measure t_v(1)
    controller.cost.record_verify(1, 1, 1.0)
    plan = controller.plan(1)
    assert (plan.cap, plan.reason) == (0, "not_paying")
    for _ in range(FIRST_BACKOFF):
        controller.record_target_only_step("not_paying")
    assert controller.plan(1).cap >= 1  # re-probe speculation after the back-off
    assert controller.cost.backoff == 2 * FIRST_BACKOFF


def _losing_controller() -> DepthController:
    """A controller whose first verdict is in: target-only beats speculation at batch 1."""
    controller = DepthController(SpeculationKnobs(max_depth=4), "cpu")
    controller.cost.record_draft(1, 0.5)
    controller.cost.record_verify(1, 5, 3.0)
    controller.cost.record_verify(1, 1, 1.0)
    for _ in range(MIN_VERDICT_STEPS):
        controller.record_speculation_step(4, 1)
    assert controller.plan(1).reason == "not_paying"
    return controller


def _target_only_steps(controller: DepthController, steps: int) -> None:
    for _ in range(steps):
        plan = controller.plan(1)
        assert (plan.cap, plan.reason) == (0, "not_paying")
        controller.record_target_only_step(plan.reason)


def test_back_off_doubles_across_re_probes_that_keep_losing() -> None:
    controller = _losing_controller()
    for backoff in (FIRST_BACKOFF, 2 * FIRST_BACKOFF):
        _target_only_steps(controller, backoff)
        # The re-probe: a full verdict window of speculation steps, which lose again.
        for _ in range(MIN_VERDICT_STEPS):
            assert controller.plan(1).cap >= 1
            controller.record_speculation_step(4, 1)
        # The back-off held through the probe (it once fell back to the first one).
        assert controller.cost.backoff == 2 * backoff
    _target_only_steps(controller, 4 * FIRST_BACKOFF)
    assert controller.plan(1).cap >= 1


def test_a_re_probe_speculates_only_in_steps_without_prompt_chunks() -> None:
    controller = _losing_controller()
    _target_only_steps(controller, FIRST_BACKOFF)
    # Due, but a step with a prompt chunk does not start the probe ...
    assert (controller.plan(1, timed=False).cap, controller.cost.reprobing) == (0, False)
    assert controller.plan(1).cap >= 1  # ... the next pure step does
    controller.record_speculation_step(4, 1)
    assert controller.plan(1, timed=False).cap == 0  # nor does the probe go on in one
    assert controller.plan(1).cap >= 1


def test_back_off_starts_over_once_speculation_pays_again() -> None:
    controller = _losing_controller()
    _target_only_steps(controller, FIRST_BACKOFF)
    assert controller.plan(1).cap >= 1
    assert controller.cost.backoff == 2 * FIRST_BACKOFF
    controller.cost.record_verify(1, 5, 1.1)  # the draft got good: a cheap verify wins
    for _ in range(TIMING_WINDOW):
        controller.cost.record_verify(1, 5, 1.1)
    for _ in range(MIN_VERDICT_STEPS):
        controller.record_speculation_step(4, 4)
        controller.cost.record_acceptance(4, 4)
    assert controller.plan(1).cap >= 1
    assert (controller.cost.backoff, controller.cost.reprobing) == (FIRST_BACKOFF, False)


def test_controller_respects_batch_threshold_and_fixed_depth() -> None:
    controller = DepthController(SpeculationKnobs(max_depth=4, disable_above_batch_size=2), "cpu")
    assert (controller.plan(3).cap, controller.plan(3).reason) == (0, "batch_size")
    fixed = DepthController(SpeculationKnobs(max_depth=3, adaptive=False), "cpu")
    fixed.cost.record_verify(1, 1, 0.001)
    assert fixed.plan(1).cap == 3


def test_timings_are_the_recent_minimum_so_spikes_do_not_steer_the_depth() -> None:
    cost = CostModel()
    for seconds in (1.0, 9.0, 1.1, 8.0):  # a neighbour's job doubles some steps
        cost.record_verify(1, 5, seconds)
    assert cost.verify_lines[1].seconds(5) == 1.0
    for _ in range(TIMING_WINDOW):
        cost.record_verify(1, 5, 2.0)  # a real, lasting change is followed
    assert cost.verify_lines[1].seconds(5) == 2.0
    for seconds in (0.5, 4.0, 0.6):  # the target-only baseline keeps its own minimum
        cost.record_verify(1, 1, seconds)
    assert cost.target_only_seconds[1] == 0.5


def test_a_position_with_few_samples_leans_on_the_one_before() -> None:
    cost = CostModel()
    for _ in range(20):
        cost.record_acceptance(2, 2)  # a long streak of full acceptance
    cost.record_acceptance(2, 1)  # then one miss at position 1
    rates = cost.acceptance(3)
    assert rates[0] > 0.9
    assert rates[1] > 0.85  # one miss after a streak is not a collapse
    assert rates[2] == pytest.approx(rates[1])  # unseen: the previous position's rate
    cold = CostModel()
    cold.record_acceptance(2, 1)  # the same single miss with no history
    assert cold.acceptance(2)[1] < rates[1]


def _shallow_pays(controller: DepthController) -> CostModel:
    """Costs and acceptance under which the modelled best depth is below 4."""
    cost = controller.cost
    cost.record_draft(1, 0.2)
    for n in range(1, 6):
        cost.record_verify(1, n, 1.0)
    cost.reached, cost.accepted = [100.0] * 4, [50.0, 10.0, 10.0, 10.0]
    return cost


def test_a_lower_cost_cap_still_drafts_at_the_batch_cap_now_and_then() -> None:
    controller = DepthController(SpeculationKnobs(max_depth=4), "cpu")
    cost = _shallow_pays(controller)
    caps = []
    for _ in range(2 * EXPLORE_EVERY):
        caps.append(controller.plan(1).cap)
        controller.record_speculation_step(1, 1)
        cost.reached, cost.accepted = [100.0] * 4, [50.0, 10.0, 10.0, 10.0]
        cost.steps_since_target_probe = 0
    assert caps.count(4) == 2  # once every EXPLORE_EVERY steps
    assert all(cap < 4 for cap in caps if cap != 4)


def test_the_cost_cap_applies_on_every_device_and_with_a_set_stop() -> None:
    for controller in (
        DepthController(SpeculationKnobs(max_depth=4), "cpu"),
        DepthController(SpeculationKnobs(max_depth=4), "cuda"),
        DepthController(SpeculationKnobs(max_depth=4, draft_confidence=0.3), "cpu"),
    ):
        _shallow_pays(controller)
        assert controller.plan(1).cap < 4
    assert DepthController(SpeculationKnobs(max_depth=4), "cpu").plan(2).cap == 2  # batch cap


def test_a_target_only_probe_waits_for_a_step_without_prompt_chunks() -> None:
    # Prompts arriving all the time: a probe in a step with a chunk would not be
    # timed, and asking for it again on every such step stops speculation.
    # (duringPrefill on, as on CUDA: on the CPU such steps do not speculate.)
    controller = DepthController(SpeculationKnobs(max_depth=4, during_prefill=True), "cpu")
    controller.cost.record_draft(1, 0.5)
    controller.cost.record_verify(1, 5, 3.0)
    for _ in range(MIN_VERDICT_STEPS):
        controller.record_speculation_step(4, 1)
    assert controller.plan(1, timed=False).cap >= 1
    assert (controller.plan(1).cap, controller.plan(1).reason) == (0, "probe")
    controller.cost.record_verify(1, 1, 5.0)  # slower than speculating: it pays
    controller.cost.steps_since_target_probe = PROBE_TARGET_EVERY
    assert controller.plan(1, timed=False).cap >= 1
    assert controller.plan(1).reason == "probe"


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        (SpeculationKnobs(), 0.0),  # off unless set, on every device
        (SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False), 0.0),
        (SpeculationKnobs(draft_confidence=0.3, adaptive=False), 0.3),
        (SpeculationKnobs(draft_confidence=0.3), 0.3),
        (SpeculationKnobs(draft_confidence=0.0), 0.0),
    ],
)
def test_the_draft_confidence_stop_is_the_set_threshold(
    knobs: SpeculationKnobs, expected: float
) -> None:
    assert resolved_draft_confidence(knobs) == expected
    assert DepthController(knobs, "cpu").plan(1).confidence == expected


def test_a_bad_draft_confidence_names_the_field() -> None:
    with pytest.raises(ValidationError, match="draftConfidence"):
        SpeculationKnobs.model_validate({"draftConfidence": 1.5})


def test_a_step_with_a_prompt_chunk_speculates_only_where_during_prefill_is_on() -> None:
    knobs = SpeculationKnobs(max_depth=4, adaptive=False)
    on_cpu = DepthController(knobs, "cpu")
    assert on_cpu.plan(1, timed=False) == StepPlan(0, PREFILL)
    assert on_cpu.plan(1, timed=True) == StepPlan(4, None)  # no prompt chunk
    assert DepthController(knobs, "cuda").plan(1, timed=False) == StepPlan(4, None)
    on = knobs.model_copy(update={"during_prefill": True})
    assert DepthController(on, "cpu").plan(1, timed=False) == StepPlan(4, None)
    # A step that would not speculate anyway keeps its own reason.
    capped = knobs.model_copy(update={"disable_above_batch_size": 1})
    assert DepthController(capped, "cpu").plan(2, timed=False) == StepPlan(0, "batch_size")
