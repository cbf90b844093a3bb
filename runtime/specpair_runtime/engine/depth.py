"""Depth control: how many tokens every decoding request drafts in a step.

One depth for the whole step (rows near their ``max_new_tokens`` draft fewer
by being cut short, not by wasted verify work):

    depth = min(batch_cap(B), cost_cap)       (0 = a target-only step)

1. ``maxDepth`` when ``adaptive`` is off; ``minDepth`` is the floor of the
   adaptive choice.
2. ``batch_cap(B)`` (TensorRT-LLM's ``draft_len_schedule`` idea: bigger
   batches are closer to compute-bound, so verifying drafts costs more):
   ``maxDepth`` at batch size 1, halved at each doubling of the batch size
   (``maxDepth >> floor(log2 B)``), never below ``minDepth``; 0 above
   ``disableAboveBatchSize``.
3. ``cost_cap`` (only with ``adaptive``): the depth with the best measured
   throughput. The engine times its steps: seconds per draft forward
   ``t_d``, and seconds per target forward over n query tokens ``t_v(n)``
   (n = 1 is a plain target-only step), per batch size; ``t_d`` is the
   minimum of its last ``TIMING_WINDOW`` samples (noise on a shared machine
   only adds), ``t_v`` is below.
   With the acceptance rate a_i of draft position i (given that every
   earlier one was accepted, decayed counts; a position with few samples
   leans on the one before it, ``PRIOR_WEIGHT`` pseudo-counts of its rate,
   since acceptance runs in streaks: once the draft is right it tends to
   stay right), the expected tokens per step
   at depth d are ``E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i`` and the modelled
   throughput is ``E(d) / (d * t_d + t_v(d + 1))``. A verify (n >= 2) costs
   ``t_v(n) = level + slope * n``, one line through the last
   ``VERIFY_SAMPLES`` verify timings of all sizes: the slope is their
   Theil-Sen estimate (the median of the pairwise slopes, at least 0), the
   level the minimum of the last ``TIMING_WINDOW`` samples' residuals.
   Each size's own minimum was compared before: on a shared machine whose
   speed drifts, a size timed once in a fast moment looked a third cheaper
   than the others, and the cap sat at depth 1 for 15 steps of a 32-token
   run (docs/benchmarks-history.md, stop 37). A pooled line cannot favour one size
   by luck: a fast moment lowers the level of every depth alike. A
   target-only step (``t_v(1)``) keeps its own minimum: it is the baseline
   that speculation is compared with, timed only in rare probes, and on
   CUDA a 1-token step runs another kernel than a verify. With one size
   measured the line is flat, so deeper depths get tried and measured, and
   shallower ones win only on a measured slope or falling acceptance. The
   cap is the best d, except where the confidence stop's bar is measured
   (below; the CPU's default): there the cap is the batch cap whenever
   speculation pays, and the cost model decides only between speculating
   and not. The stop weighs each row's next draft against the same
   break-even cost with that row's own draft probabilities, which an
   engine-wide average cannot see; a cap below the batch cap also cut the
   confident rows, which the target would have taken (make bench's
   prompts, greedy: 35 target passes against 33, docs/benchmarks-history.md,
   stop 43). Only after ``MIN_VERDICT_STEPS`` speculation steps
   (one noisy timing must not switch speculation off) and when target-only
   (``1 / t_v(1)``) beats the best depth by ``NOT_PAYING_MARGIN``, the cap
   is 0 and the engine decodes target-only, re-probing speculation after
   16 steps, then 32, 64, ... (at most 256) while it keeps losing (the
   back-off starts over only once a full verdict window says speculation
   pays again). A re-probe speculates only in steps without prompt chunks:
   on 2 CPU cores a depth-1 step of 8 rows costs about twice a target-only
   one, and with a prompt chunk and a draft catch-up on top it took 2-3x
   (one in-process trace, docs/benchmarks-history.md). Every step without drafts and
   without prompt work is timed as ``t_v(1)``, whatever made it one: a probe,
   or rows that draft nothing (a row's last token, at one stream). While
   speculating it probes one target-only step when ``t_v(1)`` is still
   unknown once a verdict is due (``MIN_VERDICT_STEPS``) and when no such
   step was timed in the last 64 speculation steps, in a
   step without prompt chunks (only those are timed), and
   when the cap is below the batch cap, every ``EXPLORE_EVERY`` speculation
   steps drafts at the batch cap once, so the deeper positions' acceptance
   is measured again instead of frozen at an early unlucky estimate.
4. ``acceptanceFloor`` / ``acceptanceWindow``: once the last ``window``
   speculation steps (engine-wide) have drafted tokens and accepted fewer
   than ``floor`` of them, speculation turns off for the whole engine with a
   reason, until the knobs change. A floor of 0 disables this rule.

Within the step's depth, each row may stop sooner: the engine's
draft-confidence stop (``draftConfidence``, ``speculative.py``) ends a row's
drafts once the product of the draft's probabilities of its drafts so far
(the draft's estimate that all of them are accepted) is below the threshold; unset, its threshold is
``CostModel.break_even_confidence``, the acceptance one more draft token needs
to pay for itself at the measured costs. So acceptance per position is
counted over the rows that reached it, and a step is timed at the depth its
rows really drafted.

A step that carries a prompt chunk does not speculate where ``duringPrefill``
is off, unset the CPU's default (``PREFILL``; architecture.md, depth rule 6);
the engine still lets the drafts catch up in it.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specpair_runtime.config import (
    SpeculationKnobs,
    measured_draft_confidence,
    resolved_during_prefill,
)

# Step timings are the minimum of the last TIMING_WINDOW samples: a busy
# (shared) machine only ever adds time, so the minimum is the closest to the
# step's own cost, and the window still follows real drift (longer contexts).
TIMING_WINDOW = 8
ACCEPTANCE_DECAY = 0.98  # per step, so acceptance follows drift
PROBE_TARGET_EVERY = 64  # speculation steps between target-only probes
FIRST_BACKOFF = 16  # target-only steps before re-probing speculation
MAX_BACKOFF = 256
MIN_VERDICT_STEPS = 16  # speculation steps measured before "not paying" may be concluded
NOT_PAYING_MARGIN = 1.05  # target-only must win by 5% to switch speculation off
PRIOR_WEIGHT = 4.0  # pseudo-counts of the previous position's rate in a position's estimate
EXPLORE_EVERY = 8  # speculation steps between steps at the batch cap (when the cap is lower)
VERIFY_SAMPLES = 32  # verify timings (n >= 2 tokens) per batch size that the cost line is fitted to
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


def _windowed_min(window: deque[float], sample: float) -> float:
    window.append(sample)
    while len(window) > TIMING_WINDOW:
        window.popleft()
    return min(window)


def expected_tokens(acceptance: list[float], depth: int) -> float:
    """Expected committed tokens per step at ``depth``: 1 + sum_j prod_{i<=j} a_i."""
    total, run = 1.0, 1.0
    for position in range(depth):
        run *= acceptance[position] if position < len(acceptance) else 0.0
        total += run
    return total


def theil_sen_slope(samples: Sequence[tuple[int, float]]) -> float:
    """The median of the pairwise slopes of ``(n, seconds)`` samples; 0 with one size.

    Robust to a minority of spikes (a neighbour's job doubling some steps),
    which a least-squares slope through few sizes follows.
    """
    points = list(samples)
    slopes = [
        (t_j - t_i) / (n_j - n_i)
        for i, (n_i, t_i) in enumerate(points)
        for n_j, t_j in points[i + 1 :]
        if n_j != n_i
    ]
    return statistics.median(slopes) if slopes else 0.0


@dataclass(frozen=True)
class VerifyLine:
    """``t_v(n) = level + slope * n`` seconds for a verify of n >= 2 tokens."""

    level: float
    slope: float

    @staticmethod
    def fit(samples: Sequence[tuple[int, float]]) -> VerifyLine:
        """The line through recent ``(n, seconds)`` samples (oldest first)."""
        slope = max(theil_sen_slope(samples), 0.0)
        recent = list(samples)[-TIMING_WINDOW:]
        return VerifyLine(min(seconds - slope * n for n, seconds in recent), slope)

    def seconds(self, n: int) -> float:
        return max(self.level + self.slope * n, 0.0)  # extrapolated below the sizes measured


@dataclass
class CostModel:
    """Measured step costs and per-position acceptance; picks the cost cap."""

    draft_seconds: dict[int, float] = field(default_factory=dict)  # batch size -> s/forward
    target_only_seconds: dict[int, float] = field(default_factory=dict)  # B -> s, t_v(1)
    verify_samples: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # n >= 2
    verify_lines: dict[int, VerifyLine] = field(default_factory=dict)  # B -> fitted line
    reached: list[float] = field(default_factory=list)  # position i drafted, all before accepted
    accepted: list[float] = field(default_factory=list)  # position i accepted
    steps_since_target_probe: int = 0
    speculation_samples: int = 0  # speculation steps since the last (re)start of speculation
    target_only_streak: int = 0
    backoff: int = FIRST_BACKOFF
    reprobing: bool = False  # speculating again after a "not paying" verdict, until the next one
    samples: dict[tuple[int, int], deque[float]] = field(default_factory=dict)

    def record_draft(self, batch_size: int, seconds_per_forward: float) -> None:
        window = self.samples.setdefault((batch_size, 0), deque())
        self.draft_seconds[batch_size] = _windowed_min(window, seconds_per_forward)

    def record_verify(self, batch_size: int, query_tokens: int, seconds: float) -> None:
        if query_tokens == 1:
            window = self.samples.setdefault((batch_size, 1), deque())
            self.target_only_seconds[batch_size] = _windowed_min(window, seconds)
            self.steps_since_target_probe = 0
            return
        pooled = self.verify_samples.setdefault(batch_size, deque(maxlen=VERIFY_SAMPLES))
        pooled.append((query_tokens, seconds))
        self.verify_lines[batch_size] = VerifyLine.fit(pooled)

    def record_acceptance(self, drafted: int, accepted: int) -> None:
        """One row's outcome: ``accepted`` leading tokens of ``drafted``."""
        while len(self.reached) < drafted:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for position in range(min(drafted, accepted + 1)):
            self.reached[position] += 1.0
            if position < accepted:
                self.accepted[position] += 1.0

    def decay(self) -> None:
        self.reached = [r * ACCEPTANCE_DECAY for r in self.reached]
        self.accepted = [a * ACCEPTANCE_DECAY for a in self.accepted]

    def acceptance(self, depth: int) -> list[float]:
        """a_i per position: position 0 with a Beta(1, 1) prior, each later one with
        ``PRIOR_WEIGHT`` pseudo-counts at the previous position's rate (unseen: that rate)."""
        rates: list[float] = []
        for position in range(depth):
            reached = self.reached[position] if position < len(self.reached) else 0.0
            accepted = self.accepted[position] if position < len(self.accepted) else 0.0
            if not rates:
                rates.append((accepted + 1.0) / (reached + 2.0))
            else:
                rates.append((accepted + PRIOR_WEIGHT * rates[-1]) / (reached + PRIOR_WEIGHT))
        return rates

    def throughput(self, batch_size: int, depth: int) -> float | None:
        """Modelled tokens per second per row at ``depth`` (0 = target-only)."""
        if depth == 0:
            single = self.target_only_seconds.get(batch_size)
            return 1.0 / single if single else None
        line = self.verify_lines.get(batch_size)
        draft = self.draft_seconds.get(batch_size)
        if line is None or draft is None:
            return None
        cost = depth * draft + line.seconds(depth + 1)
        return expected_tokens(self.acceptance(depth), depth) / cost if cost > 0 else None

    def verify_slope(self, batch_size: int) -> float:
        """Seconds one more verify token adds: the verify line's slope, 0 (flat) until
        two sizes are measured.

        A robust fit over all sizes, not the difference of two neighbours: a size
        measured once or twice is noisy on a shared machine, and one difference of
        two noisy points moved the bar below from 0.24 to 0.79 in one trace.
        """
        line = self.verify_lines.get(batch_size)
        return line.slope if line is not None else 0.0

    def break_even_confidence(self, batch_size: int, depth: int) -> float | None:
        """The acceptance one more draft token needs to pay for itself at ``depth``,
        or None while a cost is unmeasured.

        One more token (taken with probability p: it and every draft before
        it accepted, which the engine reads as the product of the draft's
        probabilities) turns a step of E tokens in C seconds into E + p tokens
        in C + c seconds, with c a draft forward
        and one more verify token (``verify_slope``). That pays when p / c > E /
        C, so the bar is the step's modelled rate (all its rows) times c, at
        most 1.
        """
        rate = self.throughput(batch_size, depth)
        draft = self.draft_seconds.get(batch_size)
        if rate is None or draft is None:
            return None
        marginal = draft + self.verify_slope(batch_size)
        return min(batch_size * rate * marginal, 1.0)

    def cost_cap(self, batch_size: int, min_depth: int, max_depth: int) -> int:
        """The modelled best depth in [min_depth, max_depth], or 0 when target-only wins."""
        baseline = self.throughput(batch_size, 0)
        best_depth, best_rate = max_depth, None
        for depth in range(min_depth, max_depth + 1):
            rate = self.throughput(batch_size, depth)
            if rate is None:
                return max_depth  # not measured yet: speculate to measure
            if best_rate is None or rate > best_rate:
                best_depth, best_rate = depth, rate
        if (
            baseline is not None
            and best_rate is not None
            and self.speculation_samples >= MIN_VERDICT_STEPS
            and baseline >= best_rate * NOT_PAYING_MARGIN
        ):
            return 0
        return best_depth


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
    """The engine's decision for one step."""

    cap: int  # depth cap for this step (0 = target-only)
    reason: str | None  # why the cap is 0 (None when speculating)


@dataclass
class DepthController:
    """Engine-wide depth decisions (per-request heuristics live with the requests)."""

    knobs: SpeculationKnobs
    device_type: str  # where the confidence stop's bar is measured, the cap defers to it
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
        """Depth cap for the next step, before per-request heuristics.

        ``timed``: the step carries no prompt chunk, so its timing will be
        recorded. A target-only probe waits for such a step: a probe that
        records nothing would be asked for again and again while prompts keep
        arriving (one run of the 1.5B pair under load spent 32 % of its steps
        on such probes, each a step without speculation). A step that carries
        one does not speculate where ``duringPrefill`` is off (the CPU's
        default): there the verify tokens slow the prompts about as much as
        they speed up the decoding rows (architecture.md, depth rule 6).
        """
        plan = self._speculation_plan(batch_size, timed)
        if plan.cap > 0 and not timed and not resolved_during_prefill(self.knobs, self.device_type):
            return StepPlan(0, PREFILL)
        return plan

    def _speculation_plan(self, batch_size: int, timed: bool) -> StepPlan:
        """Rules 1-3 of the module docstring and the probes, for ``plan``."""
        cap = batch_depth_cap(batch_size, self.knobs)
        if cap == 0:
            return StepPlan(0, "batch_size")
        if not self.knobs.adaptive:
            return StepPlan(cap, None)
        cost = self.cost
        # Only the "not paying" verdict reads t_v(1), and none is due before
        # MIN_VERDICT_STEPS: until then a row's last token (a step without drafts)
        # may time it for free. A probe commits one token per row where a
        # speculation step on the demo pair commits about 2.9.
        probe_target = timed and (
            (
                batch_size not in cost.target_only_seconds
                and cost.speculation_samples >= MIN_VERDICT_STEPS
            )
            or cost.steps_since_target_probe >= PROBE_TARGET_EVERY
        )
        if probe_target:
            return StepPlan(0, "probe")
        cost_cap = cost.cost_cap(batch_size, min(self.knobs.min_depth, cap), cap)
        if cost_cap == 0:
            if cost.reprobing:  # the re-probe's verdict: it still loses
                cost.reprobing = False
                cost.target_only_streak = 0
            if cost.target_only_streak < cost.backoff or not timed:
                return StepPlan(0, "not_paying")
            # Re-probe speculation; back off further if it still loses.
            cost.backoff = min(cost.backoff * 2, MAX_BACKOFF)
            cost.target_only_streak = 0
            cost.speculation_samples = 0
            cost.reprobing = True
            return StepPlan(max(self.knobs.min_depth, 1), None)
        if cost.reprobing and not timed:
            # A re-probe speculates in steps without prompt chunks only: a probe that
            # speculation is known to lose must not stack on a prompt chunk as well.
            return StepPlan(0, "not_paying")
        if cost.speculation_samples >= MIN_VERDICT_STEPS:
            # Paying after a full verdict window; the back-off starts over next time.
            cost.reprobing = False
            cost.backoff = FIRST_BACKOFF
        if measured_draft_confidence(self.knobs, self.device_type):
            # The confidence stop cuts each row at the same break-even bar, with the
            # row's own draft probabilities; a cap below the batch cap cut rows the
            # stop would have let draft (docs/benchmarks-history.md, stop 43).
            return StepPlan(cap, None)
        if cost_cap < cap and self.speculation_steps % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            return StepPlan(cap, None)  # re-measure the deeper positions
        return StepPlan(cost_cap, None)

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
        if (
            outcome.pure
            and len(outcome.drafts) == batch
            and all(n == depth for n, _ in outcome.drafts)
        ):
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
