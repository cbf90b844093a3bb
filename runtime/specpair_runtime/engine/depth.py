"""Depth control: how many tokens the rows of a step draft, behind two calls.

Before a step the engine asks ``plan(batch_size, timed)``: the step's depth
cap (0: a target-only step, with the reason), and the bar of the per-row
confidence stop. After it, ``record(outcome)`` hands over what the step did.
Nothing else of the policy reaches the engine. One depth for the whole step;
rows near their ``max_new_tokens`` draft fewer by leaving the later draft
forwards, never by wasted verify work.

The rules, in the order ``plan`` applies them (docs/architecture.md has the
figure that keeps each):

1. ``adaptive: false``: ``maxDepth`` (the batch cap and ``duringPrefill``
   still apply). ``minDepth`` is the floor of every adaptive depth.
2. The batch cap, TensorRT-LLM's ``draft_len_schedule`` idea: a bigger batch
   is closer to compute-bound, so verifying drafts costs more; ``maxDepth``
   at one row, halved at each doubling of the rows, never below
   ``minDepth``; 0 above ``disableAboveBatchSize``.
3. The per-row confidence stop (``drafter.py`` applies it), only where
   ``draftConfidence`` is set: a row drafts no further once the product of
   the draft's probabilities of its drafts is below the bar.
4. The modelled best depth, ``E(d) / (d t_d + t_v(d + 1))`` (``CostModel``),
   caps the batch cap, and every ``EXPLORE_EVERY`` speculation steps one
   step drafts at the batch cap, so the deeper positions' acceptance is
   measured again instead of frozen at an early unlucky estimate.
5. Not paying: after ``MIN_VERDICT_STEPS`` speculation steps, if target-only
   (``1 / t_v(1)``) beats the best depth by ``NOT_PAYING_MARGIN``, the engine
   decodes target-only and re-probes speculation after 16, 32, ... 256
   steps; the back-off starts over once a full verdict window says
   speculation pays again. ``t_v(1)`` is timed by any step without drafts and
   without prompt work (a row's last token drafts nothing); a probe, one
   target-only step, is asked for only when a verdict is due and it is
   unknown, or when none was timed in ``PROBE_TARGET_EVERY`` speculation
   steps, and only in a step without prompt chunks, since only such steps
   are timed. A re-probe of speculation, too, waits for such a step.
6. ``duringPrefill``: a step that reads a prompt chunk speculates only where
   it is on; unset, everywhere but the CPU, where such a step is bound by its
   arithmetic and the verify tokens slow the prompts about as much as they
   speed up the decoding rows (``PREFILL``). The drafts still catch up in it.
7. ``acceptanceFloor`` / ``acceptanceWindow``: once the last ``window``
   speculation steps accepted fewer than ``floor`` of their drafts,
   speculation turns off with a reason until the knobs change (0: never).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specpair_runtime.config import (
    SpeculationKnobs,
    resolved_draft_confidence,
    resolved_during_prefill,
)
from specpair_runtime.engine.cost_model import (
    FIRST_BACKOFF,
    MIN_VERDICT_STEPS,
    CostModel,
)

PROBE_TARGET_EVERY = 64  # speculation steps between target-only probes
MAX_BACKOFF = 256
EXPLORE_EVERY = 8  # speculation steps between steps at the batch cap (when the cap is lower)
# A plain step's reason when it carries a prompt chunk and ``duringPrefill`` is off.
PREFILL = "prefill"


def batch_depth_cap(batch_size: int, knobs: SpeculationKnobs) -> int:
    """Depth cap for a running batch of ``batch_size`` requests (0 = do not speculate)."""
    if knobs.disable_above_batch_size is not None and batch_size > knobs.disable_above_batch_size:
        return 0
    halvings = max(batch_size, 1).bit_length() - 1
    return max(knobs.min_depth, knobs.max_depth >> halvings)


@dataclass
class AcceptanceFloor:
    """Rolling engine-wide acceptance over the last ``window`` speculation steps."""

    window: int
    steps: deque[tuple[int, int]] = field(default_factory=deque)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.steps.append((drafted, accepted))
        while len(self.steps) > self.window:
            self.steps.popleft()

    @property
    def rate(self) -> float | None:
        drafted = sum(d for d, _ in self.steps)
        return sum(a for _, a in self.steps) / drafted if drafted else None

    def verdict(self, floor: float) -> str | None:
        """A reason to turn speculation off, or None."""
        rate = self.rate
        if floor <= 0.0 or len(self.steps) < self.window or rate is None or rate >= floor:
            return None
        return (
            f"acceptance_floor: rolling acceptance {rate:.3f} over the last {self.window} "
            f"speculation steps is below acceptanceFloor {floor:.3f}"
        )


@dataclass(frozen=True)
class StepOutcome:
    """What one step did, as the depth controller learns from it.

    ``pure``: no prompt work for either model (neither a target chunk nor a
    draft catch-up), so its times are a decode step's. ``drafts``: (drafted,
    accepted) of each row that drafted, at the depth it really drafted.
    """

    depth: int  # as planned (0: a target-only step)
    reason: str | None  # why ``depth`` is 0
    rows: int
    pure: bool
    drafts: list[tuple[int, int]]
    draft_seconds: float
    verify_seconds: float


@dataclass(frozen=True)
class StepPlan:
    """The policy's decision for one step."""

    cap: int  # depth cap for this step (0 = target-only)
    reason: str | None  # why the cap is 0 (None when speculating)
    confidence: float = 0.0  # the per-row stop's bar for this step (0: no stop)


@dataclass
class DepthController:
    """The engine's depth policy: ``plan`` before a step, ``record`` after it."""

    knobs: SpeculationKnobs
    device_type: str  # the per-device defaults of ``duringPrefill``
    cost: CostModel = field(default_factory=CostModel)
    floor: AcceptanceFloor = field(init=False)
    speculation_steps: int = 0

    def __post_init__(self) -> None:
        self.floor = AcceptanceFloor(self.knobs.acceptance_window)

    def update_knobs(self, knobs: SpeculationKnobs) -> None:
        """New knobs reset the floor window (a tripped floor is re-evaluated afresh)."""
        self.knobs = knobs
        self.floor = AcceptanceFloor(knobs.acceptance_window)
        self.cost.backoff = FIRST_BACKOFF
        self.cost.target_only_streak = 0
        self.cost.reprobing = False

    def plan(self, batch_size: int, timed: bool = True) -> StepPlan:
        """The next step's depth cap and stop bar, for ``batch_size`` decoding rows.

        ``timed``: the step carries no prompt chunk, so its timing will be
        recorded (rule 5 waits for such steps). A step that carries one does
        not speculate where ``duringPrefill`` is off (rule 6).
        """
        cap, reason = self._speculation_cap(batch_size, timed)
        if cap > 0 and not timed and not resolved_during_prefill(self.knobs, self.device_type):
            return StepPlan(0, PREFILL)
        if cap == 0:
            return StepPlan(0, reason)
        return StepPlan(cap, None, self.confidence())

    def confidence(self) -> float:
        """The per-row stop's bar (0 = off): ``draftConfidence`` as set (rule 3)."""
        return resolved_draft_confidence(self.knobs)

    def record(self, outcome: StepOutcome) -> None:
        """Learn from a step: decode-step timings, acceptance per position, the floor."""
        cost = self.cost
        batch = outcome.rows
        if outcome.pure and not outcome.drafts:
            # A target-only step, whatever made it one: a probe, a fallback, or rows
            # with one token left (at depth 0 no row drafts).
            cost.record_verify(batch, 1, outcome.verify_seconds)
        if outcome.depth == 0:
            self.record_target_only_step(outcome.reason)
            return
        if not outcome.drafts:
            return
        depth = outcome.drafts[0][0]  # below the plan's where the confidence stop cut
        uniform = all(n == depth for n, _ in outcome.drafts)
        if outcome.pure and len(outcome.drafts) == batch and uniform:
            cost.record_draft(batch, outcome.draft_seconds / depth)
            cost.record_verify(batch, depth + 1, outcome.verify_seconds)
        for drafted, accepted in outcome.drafts:
            cost.record_acceptance(drafted, accepted)
        self.record_speculation_step(
            sum(n for n, _ in outcome.drafts), sum(a for _, a in outcome.drafts)
        )

    def record_target_only_step(self, reason: str | None) -> None:
        if reason == "not_paying":
            self.cost.target_only_streak += 1

    def record_speculation_step(self, drafted: int, accepted: int) -> None:
        """Engine-wide totals of one speculation step (all rows)."""
        self.speculation_steps += 1
        self.cost.speculation_samples += 1
        self.cost.steps_since_target_probe += 1
        self.cost.decay()
        self.floor.record(drafted, accepted)

    def floor_verdict(self) -> str | None:
        return self.floor.verdict(self.knobs.acceptance_floor)

    def _speculation_cap(self, batch_size: int, timed: bool) -> tuple[int, str | None]:
        """Rules 1, 2, 4 and 5 of the module docstring: the cap, and why it is 0."""
        cap = batch_depth_cap(batch_size, self.knobs)
        if cap == 0:
            return 0, "batch_size"
        if not self.knobs.adaptive:
            return cap, None
        if timed and self._probe_due(batch_size):
            return 0, "probe"
        cost_cap = self.cost.cost_cap(batch_size, min(self.knobs.min_depth, cap), cap)
        if cost_cap == 0:
            return self._not_paying(timed)
        if self.cost.reprobing and not timed:
            # A re-probe speculates in steps without prompt chunks only: a probe that
            # speculation is known to lose must not stack on a prompt chunk as well.
            return 0, "not_paying"
        if self.cost.speculation_samples >= MIN_VERDICT_STEPS:
            # Paying after a full verdict window; the back-off starts over next time.
            self.cost.reprobing = False
            self.cost.backoff = FIRST_BACKOFF
        if cost_cap < cap and self.speculation_steps % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return cap, None  # re-measure the deeper positions
        return cost_cap, None

    def _probe_due(self, batch_size: int) -> bool:
        """A target-only step to time ``t_v(1)``: wanted by a due verdict, or stale.

        Until ``MIN_VERDICT_STEPS`` a row's last token (a step without
        drafts) may time it for free. A probe commits one token per row where
        a speculation step on the demo pair commits about 2.9.
        """
        cost = self.cost
        unknown = batch_size not in cost.target_only_seconds
        return (unknown and cost.speculation_samples >= MIN_VERDICT_STEPS) or (
            cost.steps_since_target_probe >= PROBE_TARGET_EVERY
        )

    def _not_paying(self, timed: bool) -> tuple[int, str | None]:
        """Target-only while speculation loses; a re-probe once the back-off has run out."""
        cost = self.cost
        if cost.reprobing:  # the re-probe's verdict: it still loses
            cost.reprobing = False
            cost.target_only_streak = 0
        if cost.target_only_streak < cost.backoff or not timed:
            return 0, "not_paying"
        cost.backoff = min(cost.backoff * 2, MAX_BACKOFF)
        cost.target_only_streak = 0
        cost.speculation_samples = 0
        cost.reprobing = True
        return max(self.knobs.min_depth, 1), None
