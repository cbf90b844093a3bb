"""The depth rule's measurements: step costs and per-position acceptance.

Seconds per draft forward ``t_d`` and per target forward over n query tokens
``t_v(n)`` (n = 1 is a plain target-only step), per batch size, and the
acceptance rate a_i of each draft position (given that every earlier one was
accepted; decayed counts, so the rates follow drift). From these it models a
step: ``E(d) = 1 + sum_{j<=d} prod_{i<=j} a_i`` tokens at depth d in
``d * t_d + t_v(d + 1)`` seconds.

- A timing is the minimum of its last ``TIMING_WINDOW`` samples: a busy
  (shared) machine only ever adds time, so the minimum is closest to the
  step's own cost, and the window still follows real drift (longer contexts).
- A verify (n >= 2) costs ``t_v(n) = level + slope * n``, one line through the
  last ``VERIFY_SAMPLES`` verify timings of all sizes: the slope is their
  Theil-Sen estimate (the median of the pairwise slopes, at least 0), the
  level the lowest recent residual. On a machine whose speed drifts, a size
  timed once in a fast moment would look a third cheaper than the others if
  each size kept its own minimum, and pull the depth down for many steps; a
  fast moment lowers a pooled line's level for every size alike. A
  target-only step keeps its own minimum: it is the baseline speculation is
  compared with, and on CUDA a 1-token step runs another kernel than a verify.
- A position with few samples leans on the one before it (``PRIOR_WEIGHT``
  pseudo-counts of that rate): acceptance runs in streaks, and one miss after
  a streak is not a collapse.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

TIMING_WINDOW = 8
ACCEPTANCE_DECAY = 0.98  # per step, so acceptance follows drift
PRIOR_WEIGHT = 4.0  # pseudo-counts of the previous position's rate in a position's estimate
VERIFY_SAMPLES = 32  # verify timings (n >= 2 tokens) per batch size that the cost line is fitted to
MIN_VERDICT_STEPS = 16  # speculation steps measured before "not paying" may be concluded
NOT_PAYING_MARGIN = 1.05  # target-only must win by 5% to switch speculation off
FIRST_BACKOFF = 16  # target-only steps before re-probing speculation


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
    """Measured step costs and per-position acceptance; the modelled best depth.

    It also counts what the "not paying" verdict (``depth.py``, rule 5)
    needs: speculation steps since speculation (re)started, steps since
    ``t_v(1)`` was timed, and the verdict's back-off.
    """

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
