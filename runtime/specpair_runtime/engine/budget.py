"""The per-step token budget for prompt chunks (chunked prefill), measured or fixed.

A step runs every decoding row, then prompt chunks fill the budget. How many
prompt tokens a step can take without stretching the running streams'
inter-token latency depends on the model and the machine, by orders of
magnitude: on 2 CPU cores a 1.5B model's prompt token costs about what a
decoding row does, while for the tiny test models in the server any chunk
costs the same ~2 ms (the server's other threads, most likely: in one
process those chunks cost ~14 µs a token), and the number of tokens in it
hardly matters. A fixed default is wrong for one of them.

So unless ``serving.maxStepTokens`` fixes it, the budget is measured, as
Sarathi-Serve sizes its chunks to a latency target, but online:

- ``pure``: a step with decoding rows and no prompt chunk (neither the
  target's nor a draft catch-up), per (decoding rows, depth): the minimum of
  the last ``TIMING_WINDOW`` samples (a busy machine only ever adds time).
- ``extra``: a step of the same key (or, when none was pure yet, of the same
  depth: a line between the nearest row counts below and above, else the
  nearest) with ``c`` target prompt tokens took
  this much longer than ``pure``. ``c`` counts the target's chunks only:
  the draft catches up on the same tokens a step later, from a budget of the
  same size, so a budget token costs one target token plus one draft token,
  and that is what the line measures. (Counting both models' tokens as one
  would dilute the per-token cost by the cheap draft tokens, with the draft's
  catch-up on top of the budget: steps with chunks of 1.4-1.9x a pure step
  on the 1.5B pair instead of 1.25x.) A step with only a draft
  catch-up is neither pure nor a sample. A catch-up counts wherever it rides,
  also in a decoding row that reads the tokens its draft missed before it
  drafts (``draft_catch_up``), as the row whose prefill just ended does.
  The last ``SAMPLES`` of them, as the median per distinct ``c`` (one noisy
  step must not swing it), give a line
  ``extra(c) = fixed + per_token * c`` (with one distinct ``c``, or a flat
  line over sizes less than ``FIT_SPREAD`` apart: all of it per token).
- The budget is the largest chunk that keeps a mixed step within
  ``STEP_ALLOWANCE`` of the pure step: ``(STEP_ALLOWANCE * pure - fixed) /
  per_token`` prompt tokens, plus the decoding rows' own. When the fixed part
  takes more than half the allowance, the chunk's own tokens still get half
  of it (``STEP_ALLOWANCE / 2 * pure / per_token``): every mixed step pays the
  fixed part whatever its size, and the chunk adds a bounded share on top.
  (Taking prompts in as few steps as possible instead grows the budget to
  the ceiling wherever the fixed part is misread, as from a step whose draft
  caught up on 69 tokens beside a 5-token chunk: on the 1.5B pair on 2 AMD
  vCPUs, 2.4-3.2 s steps beside 0.6 s pure ones, p99 ITL 3.5-4.7x one
  stream's.)
  Where a chunk's tokens cost next to nothing, that is still the ceiling;
  where a chunk has a fixed cost (the tiny pair in the server: a 100-token
  chunk adds a few ms to a 4 ms step), the chunks stay small, which keeps
  its 8-stream p99 ITL low at some cost in time to first token.
  The budget grows at most ``GROWTH``
  times per step, so a larger chunk is probed before it is trusted, and stays
  within [``MIN_PREFILL_CHUNK``, ``ceiling``].

With no stream decoding, nobody waits on the step: prompts take ``ceiling``
tokens at once (fewer, larger chunks cost less in total). Until the first
mixed step has been timed, prompt work beside decoding rows takes only the
floor (``chunk_room``): the start value is a guess, not a measurement. On
the 1.5B pair its 23-27 prompt tokens beside 1-4 decoding rows made the
first mixed step of an 8-stream level take 0.87-1.45 s, against 0.5-0.9 s
for the ten steps after it: up to three of the level's ten longest gaps.
A key never seen plain leaves the
budget unmeasured, and such steps then keep to the floor: slower prompts,
never a stall for the running streams.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from specpair_runtime.engine.cost_model import TIMING_WINDOW

# A step that carries prompt chunks may take this much longer than a pure decode step.
STEP_ALLOWANCE = 0.25
# At most this growth per step: a larger chunk is probed before it is trusted,
# and the probe itself must stay a small stretch (doubling a 22-token budget on a
# noisy fit made a 1.5B-pair step take 1.6x a pure one, the run's p99 ITL).
GROWTH = 1.25
SAMPLES = 16  # mixed steps that the line is fitted to
# A waiting prefill gets at least this many tokens per step, even when the
# running decodes use up the budget, so it is never starved; the budget never
# falls below it either.
MIN_PREFILL_CHUNK = 8
# Prompt tokens a waiting prefill's ordering key drops per step (``prefill_order``).
PREFILL_AGING = 1
# A flat line ("chunks cost the same whatever their size") is believed only
# over chunk sizes at least this factor apart.
FIT_SPREAD = 2.0
# A drafting row feeds its draft at most this many tokens in a steady decode: the
# bonus token and, when every draft was accepted, the last draft (sampled, never
# read). More is a catch-up on tokens that the draft missed: prompt work.
STEADY_DRAFT_FEED = 2


# What a step carried: decoding rows only; decoding rows beside prompt work (the
# steps that STEP_ALLOWANCE bounds); prompt work only (nobody waits on it).
StepKind = Literal["decode", "mixed", "prefill"]
STEP_KINDS: tuple[StepKind, ...] = ("decode", "mixed", "prefill")


@dataclass(frozen=True)
class StepTiming:
    """One engine step's draft + target seconds, and what it carried."""

    kind: StepKind
    seconds: float

    @classmethod
    def of(cls, decoding_rows: int, prompt_tokens: int, seconds: float) -> StepTiming:
        """``prompt_tokens``: the target's prompt chunks and the drafts' catch-up together."""
        kind: StepKind = "prefill" if decoding_rows == 0 else "mixed" if prompt_tokens else "decode"
        return cls(kind, seconds)


@dataclass
class StepBudget:
    """Tokens per step over all rows; ``fixed`` budgets never change.

    ``ceiling``: the most a measured budget grows to, and what a step with no
    decoding row takes (nobody waits on it).
    """

    tokens: int
    ceiling: int
    fixed: bool = False
    pure: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    extra: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=SAMPLES))

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.ceiling < self.tokens:
            raise ValueError(
                f"step budget needs 1 <= tokens <= ceiling, got {self.tokens}, {self.ceiling}"
            )

    def record(
        self,
        decoding_rows: int,
        depth: int,
        prompt_tokens: int,
        seconds: float,
        draft_catch_up: int = 0,
    ) -> None:
        """One step's wall time: ``decoding_rows`` decoded at ``depth`` beside the
        target's ``prompt_tokens`` and ``draft_catch_up`` draft prompt tokens."""
        if self.fixed or decoding_rows == 0:
            return
        key = (decoding_rows, depth)
        if prompt_tokens == 0:
            if draft_catch_up == 0:
                self.pure.setdefault(key, deque(maxlen=TIMING_WINDOW)).append(seconds)
            return
        pure = self._pure_seconds(decoding_rows, depth)
        if pure is None:
            return  # no pure step of this depth to compare with yet
        self.extra.append((prompt_tokens, max(seconds - pure, 0.0)))
        self.tokens = self._next(pure, decoding_rows * (depth + 1))

    def chunk_room(self, left: int) -> int:
        """What prompt chunks beside decoding rows may take of the ``left`` tokens
        that the rows leave: all of it once a mixed step was timed (or when the
        budget is fixed); before that nothing, so only the first chunk's floor
        (``chunk_size``) runs, as a probe."""
        return left if self.fixed or self.extra else min(left, 0)

    def _pure_seconds(self, decoding_rows: int, depth: int) -> float | None:
        """The fastest pure step of this shape; else, at the same depth, a line
        between the nearest row counts below and above; else the nearest one.

        At 8 streams with long prompts arriving nearly every step carries prompt
        work, so the exact shape is rare, and the nearest row count on record
        can be far: the nearest alone compared 7-row steps on the 1.5B pair
        with a single stream's 1-row steps.
        """
        exact = self.pure.get((decoding_rows, depth))
        if exact is not None:
            return min(exact)
        known = sorted(rows for rows, d in self.pure if d == depth)
        if not known:
            return None
        below = [r for r in known if r < decoding_rows]
        above = [r for r in known if r > decoding_rows]
        if below and above:
            low, high = below[-1], above[0]
            low_s, high_s = min(self.pure[(low, depth)]), min(self.pure[(high, depth)])
            return low_s + (high_s - low_s) * (decoding_rows - low) / (high - low)
        nearest = below[-1] if below else above[0]  # all on one side: no tie to break
        return min(self.pure[(nearest, depth)])

    def _next(self, pure: float, decode_tokens: int) -> int:
        fixed, per_token = chunk_cost(self.extra)
        allowance = STEP_ALLOWANCE * pure
        # A fixed part beyond half the allowance leaves the chunk's tokens half of it
        # (not the ceiling): a mixed step aims at pure + max(allowance, fixed + allowance / 2).
        room = max(allowance - fixed, allowance / 2)
        wanted = self.ceiling if per_token <= 0.0 else int(room / per_token) + decode_tokens
        grown = int(self.tokens * GROWTH)
        return max(MIN_PREFILL_CHUNK, min(wanted, grown, self.ceiling))


def chunk_size(pending: int, left: int, first: bool) -> int:
    """Tokens of the next prompt chunk (the target's, or a draft's catch-up).

    ``left``: what the step's budget leaves. The first chunk of a step gets at
    least ``MIN_PREFILL_CHUNK`` even when the decodes used the budget up, so a
    waiting prompt is never starved; later chunks only what is left.
    """
    return min(pending, max(left, MIN_PREFILL_CHUNK if first else 0))


def prefill_order(pending: Sequence[int], waited: Sequence[int]) -> list[int]:
    """The order in which prefilling requests get prompt chunks: indices into ``pending``.

    Shortest remaining prompt first, the order that minimizes the mean time to
    first token: first come, first served makes a 20-token prompt wait behind
    every 600-token one that arrived before it (its first token 12-22 s late
    at 8 streams on the 1.5B pair). With aging:
    each step a request has waited since its admission (``waited``) lowers its
    key by ``PREFILL_AGING``, so later, shorter prompts pass a prompt for at
    most ``pending / PREFILL_AGING`` steps, and none waits forever. The aging
    must stay well below the tokens a step reads: aged by the 8-token floor
    per step, every long prompt of a busy server soon outranks every new
    short one, and short prompts wait 14-44 s again. Equal keys keep their
    order (admission order).
    """
    keys = [p - w * PREFILL_AGING for p, w in zip(pending, waited, strict=True)]
    return sorted(range(len(keys)), key=keys.__getitem__)


def draft_catch_up(fed: int, drafts: bool) -> int:
    """How many of the ``fed`` tokens that one row's draft reads this step are catch-up.

    A row that does not draft only catches up. A drafting row's feed beyond
    ``STEADY_DRAFT_FEED`` is catch-up too: the row whose prefill just ended
    reads its last chunk (15-21 tokens on the 1.5B pair at 8 streams), and a
    row after steps that did not draft reads what they committed. Taken for a
    pure decode step, such a step sets the 8-row reference 30 % high (0.69 s
    against 0.49-0.53 s), and every chunk then looks cheap: budgets of 22-35
    tokens and steps with prompt work of 0.80-1.11 s.
    """
    return fed if not drafts else max(fed - STEADY_DRAFT_FEED, 0)


def chunk_cost(samples: deque[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per prompt token) of a mixed step, from (tokens, extra) samples.

    The median extra per distinct chunk size, then a least-squares line
    through those points, clipped to non-negative parts. With one distinct
    size the whole extra is per token (the cautious reading); so too when the
    line comes out flat over sizes less than ``FIT_SPREAD`` apart.
    """
    by_size: dict[int, list[float]] = {}
    for tokens, extra in samples:
        by_size.setdefault(tokens, []).append(extra)
    points = [(float(c), statistics.median(e)) for c, e in by_size.items()]
    if len(points) == 1:
        return 0.0, _through_origin(points)
    mean_c = statistics.fmean(c for c, _ in points)
    mean_e = statistics.fmean(e for _, e in points)
    spread = sum((c - mean_c) ** 2 for c, _ in points)
    slope = sum((c - mean_c) * (e - mean_e) for c, e in points) / spread
    if slope <= 0.0:
        sizes = [c for c, _ in points]
        if max(sizes) < FIT_SPREAD * min(sizes):
            # Sizes this close (8, 9, 10 tokens) cannot tell "chunks are free" from
            # noise: read that way once, the budget doubled into a step 40 % slower
            # than its neighbours (the 1.5B pair on 2 cores).
            return 0.0, _through_origin(points)
        return max(mean_e, 0.0), 0.0
    intercept = mean_e - slope * mean_c
    if intercept < 0.0:  # a line through the origin instead
        return 0.0, _through_origin(points)
    return intercept, slope


def _through_origin(points: list[tuple[float, float]]) -> float:
    """Seconds per token of the least-squares line ``extra = per_token * c``."""
    return sum(c * e for c, e in points) / sum(c * c for c, _ in points)
