"""How much a better depth rule could gain: the draft's trace replayed under depth policies.

Greedy speculative decoding is deterministic given one trace: at each
position of the target's greedy continuation, whether the draft's argmax is
the target's token when the draft has read every token before it (which is
what it has read while every earlier draft of the pass was accepted), and the
probability the draft gives its argmax. A pass that starts at position i and
drafts d tokens accepts the run of agreements from i (at most d) and commits
one token more (the recovered or bonus token). Its cost is d draft forwards
and one target forward of d + 1 query tokens. So a depth policy's tokens per
target pass follow from the trace alone, and its speed from two measured
costs.

This collects the trace on ``make bench``'s three prompts (the draft as
``make bench`` runs it), measures the costs in the same process through the
engine's own runners (``bench_forward.measure``), and replays:

- ``k=d``: a fixed depth, as ``make bench``'s ``specpair k=d`` modes;
- ``confidence t <=c``: HF assisted generation's rule (transformers'
  ``assistant_confidence_threshold``, 0.4 by default): draft until a token
  whose draft probability is below ``t``, at most ``c`` tokens;
- ``product t <=c``: draft until the product of the draft's probabilities
  over the pass (its own estimate that every draft so far is accepted) falls
  below ``t``, at most ``c`` tokens: the engine's per-row confidence stop;
- ``product 0.5 <=4``: that rule at ``draftConfidence: 0.5``;
- ``break-even t <=c``: that rule at a bar taken from these costs (the rate
  of fixed depth 4 times a draft forward plus one more verify token: the
  acceptance one more draft token needs to pay), at ``maxDepth`` 4 and 8;
- ``schedule``: transformers' ``num_assistant_tokens_schedule="heuristic"``:
  start at 5 tokens, 2 more after a pass that accepted every draft, 1 fewer
  after one that did not (at least 1, here at most 8), with the 0.4
  confidence rule inside each pass, as transformers applies both;
- ``k=d + 2nd at a``: a fixed depth ``d`` plus, at each of the first ``a``
  draft positions, the draft's second most likely token as a one-token
  branch (a tree of one chain and ``a`` leaves, as SpecInfer and EAGLE verify
  trees). The branches cost no draft forward (the draft's forward at that
  position gives both tokens), only ``a`` more query tokens in the verify.
  A pass whose first miss is at a position with a branch, where the target's
  token is the draft's second choice, commits one token more than the miss
  alone would: the branch token is the one the miss would have recovered,
  and the target's logits at the branch give the token after it;
- ``oracle <=c``: draft exactly up to the first miss, at most ``c`` tokens: a
  rule that knows the future never wastes a draft and never stops before the
  target would, so it is the estimate of what any rule with that cap could
  reach.

Within a pass, a rule reads the draft's confidence at the target's tokens;
after a miss the draft's own tokens differ, but those drafts are rejected
whatever it drafts next, so only where the rule stops changes the cost.

The replay leaves out what every rule shares (prompt prefill, the engine's
own time between forwards), and a pass whose first draft forward reads two
tokens is costed as one, so its ratios to target-only run higher than
``make bench``'s; compare the rules with each other.

    .venv/bin/python bench/bench_depth_policies.py [--max-new-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench.bench_draft_agreement import (
    DraftPosition,
    draft_trace,
    target_greedy,
    trace_agreement,
)
from bench.bench_forward import measure, pair_and_engine
from tools.fetch_models import cached_pair_or_report

if TYPE_CHECKING:
    from specpair_runtime.engine.runner import ModelRunner

# A policy: (trace, start of the pass) -> how many tokens to draft (>= 1).
Policy = Callable[[Sequence[DraftPosition], int], int]
HF_CONFIDENCE = 0.4  # transformers' default assistant_confidence_threshold
DEFAULT_CAPS = (4, 8)
DEFAULT_FIXED = (1, 2, 3, 4, 5, 6, 8)
DEFAULT_PRODUCTS = (0.1, 0.3)
DEFAULT_BRANCHES = ((3, 1), (4, 1), (4, 2))  # (depth, positions with a second-choice branch)
SCHEDULE_START, SCHEDULE_CAP = 5, 8  # transformers' heuristic schedule starts at 5


@dataclass(frozen=True)
class Costs:
    """Seconds of one draft forward of one token, and of target forwards of n query tokens."""

    draft: float
    verify: Mapping[int, float]

    def pass_seconds(self, drafts: int) -> float:
        return drafts * self.draft + self.verify[drafts + 1]


@dataclass(frozen=True)
class Replay:
    tokens: int
    passes: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes


def fixed(depth: int) -> Policy:
    return lambda trace, start: depth


def confidence_stop(threshold: float, cap: int) -> Policy:
    """Draft until a token the draft gives less than ``threshold`` (kept), at most ``cap``."""

    def policy(trace: Sequence[DraftPosition], start: int) -> int:
        drafts = 0
        while drafts < cap:
            drafts += 1
            at = start + drafts - 1
            if at >= len(trace) or trace[at].confidence < threshold:
                break
        return drafts

    return policy


def product_stop(threshold: float, cap: int) -> Policy:
    """Draft until the product of the draft's probabilities falls below ``threshold`` (that
    token kept), at most ``cap``: the draft's own estimate that the whole pass is accepted."""

    def policy(trace: Sequence[DraftPosition], start: int) -> int:
        drafts, product = 0, 1.0
        while drafts < cap:
            drafts += 1
            at = start + drafts - 1
            if at >= len(trace):
                break
            product *= trace[at].confidence
            if product < threshold:
                break
        return drafts

    return policy


class HeuristicSchedule:
    """transformers' heuristic schedule: the depth grows by 2 after a pass that accepted
    every draft and shrinks by 1 after one that did not; the confidence rule runs inside.

    The depth carries over from one trace to the next, as transformers keeps it
    on the assistant's generation config between ``generate`` calls.
    """

    def __init__(self, start: int, cap: int, threshold: float) -> None:
        self.depth = start
        self.cap = cap
        self.threshold = threshold

    def __call__(self, trace: Sequence[DraftPosition], start: int) -> int:
        return confidence_stop(self.threshold, self.depth)(trace, start)

    def observe(self, drafts: int, accepted: int) -> None:
        """The outcome of the pass this policy planned (``replay`` calls it)."""
        if accepted == drafts:
            self.depth = min(self.depth + 2, self.cap)
        else:
            self.depth = max(self.depth - 1, 1)


@dataclass(frozen=True)
class Branches:
    """A fixed ``depth`` plus the draft's second choice at its first ``positions`` positions."""

    depth: int
    positions: int

    def __post_init__(self) -> None:
        if not 1 <= self.positions <= self.depth:
            raise ValueError(f"branches need 1 <= positions <= depth, got {self}")


def oracle(cap: int) -> Policy:
    """Draft every token the target accepts and the first one it rejects, at most ``cap``."""

    def policy(trace: Sequence[DraftPosition], start: int) -> int:
        run = accepted_run(trace, start, cap)
        return min(run + 1, cap)

    return policy


def accepted_run(trace: Sequence[DraftPosition], start: int, drafts: int) -> int:
    """How many of ``drafts`` tokens from ``start`` the target accepts (its leading agreements)."""
    run = 0
    while run < drafts and start + run < len(trace) and trace[start + run].agrees:
        run += 1
    return run


def replay(trace: Sequence[DraftPosition], policy: Policy | None, costs: Costs) -> Replay:
    """Decode the whole trace; ``policy=None`` is target-only (one token per target forward).

    A policy with an ``observe(drafts, accepted)`` method hears each pass's outcome.
    """
    observe = getattr(policy, "observe", None)
    position = passes = 0
    seconds = 0.0
    while position < len(trace):
        drafts = 0 if policy is None else policy(trace, position)
        if policy is not None and drafts < 1:
            raise ValueError(f"a policy must draft at least 1 token, got {drafts}")
        run = accepted_run(trace, position, drafts)
        if observe is not None:
            observe(drafts, run)
        position += run + 1
        seconds += costs.pass_seconds(drafts)
        passes += 1
    return Replay(len(trace), passes, seconds)


def replay_branches(trace: Sequence[DraftPosition], branches: Branches, costs: Costs) -> Replay:
    """Decode the whole trace with a fixed depth and second-choice branches (module doc)."""
    depth, width = branches.depth, branches.positions
    position = passes = 0
    seconds = 0.0
    while position < len(trace):
        run = accepted_run(trace, position, depth)
        miss = position + run
        branch_hit = run < width and miss < len(trace) and trace[miss].second_agrees
        position += run + (2 if branch_hit else 1)
        seconds += depth * costs.draft + costs.verify[depth + 1 + width]
        passes += 1
    return Replay(len(trace), passes, seconds)


def policies(
    fixed_depths: Sequence[int],
    caps: Sequence[int],
    products: Sequence[float] = (),
    branches: Sequence[tuple[int, int]] = (),
    *,
    schedule: bool = False,
) -> dict[str, Policy | Branches]:
    """The rules to replay, by name (module doc)."""
    chosen: dict[str, Policy | Branches] = {f"k={d}": fixed(d) for d in fixed_depths}
    for cap in caps:
        chosen[f"confidence {HF_CONFIDENCE} <={cap}"] = confidence_stop(HF_CONFIDENCE, cap)
    if 4 in caps:  # the engine's rule (a product) at draftConfidence 0.5
        chosen["product 0.5 <=4"] = product_stop(0.5, 4)
    for threshold in products:
        for cap in caps:
            chosen[f"product {threshold} <={cap}"] = product_stop(threshold, cap)
    if schedule:
        chosen[f"schedule <={SCHEDULE_CAP}"] = HeuristicSchedule(
            SCHEDULE_START, SCHEDULE_CAP, HF_CONFIDENCE
        )
    for depth, width in branches:
        chosen[f"k={depth} + 2nd at {width}"] = Branches(depth, width)
    for cap in caps:
        chosen[f"oracle <={cap}"] = oracle(cap)
    return chosen


def break_even_threshold(
    traces: Sequence[Sequence[DraftPosition]], costs: Costs, depth: int = 4
) -> float:
    """The break-even confidence bar on these costs, at fixed ``depth``'s rate."""
    from specpair_runtime.engine.cost_model import CostModel

    model = CostModel()
    for n, seconds in costs.verify.items():
        model.record_verify(1, n, seconds)
    runs = [replay(trace, fixed(depth), costs) for trace in traces]
    rate = sum(r.tokens for r in runs) / sum(r.seconds for r in runs)
    return min(rate * (costs.draft + model.verify_slope(1)), 1.0)


@dataclass(frozen=True)
class PolicyRow:
    name: str
    tokens_per_pass: float
    tokens_per_second: float  # over all prompts
    vs_target_only: float


def replay_table(
    traces: Sequence[Sequence[DraftPosition]],
    chosen: Mapping[str, Policy | Branches],
    costs: Costs,
) -> list[PolicyRow]:
    """Every policy over every trace (summed), against target-only on the same costs."""

    def total(policy: Policy | Branches | None) -> Replay:
        runs = [
            replay_branches(trace, policy, costs)
            if isinstance(policy, Branches)
            else replay(trace, policy, costs)
            for trace in traces
        ]
        return Replay(
            sum(r.tokens for r in runs), sum(r.passes for r in runs), sum(r.seconds for r in runs)
        )

    baseline = total(None).tokens_per_second
    rows = [PolicyRow("target-only", 1.0, baseline, 1.0)]
    for name, policy in chosen.items():
        run = total(policy)
        speed = run.tokens_per_second
        rows.append(PolicyRow(name, run.tokens_per_pass, speed, speed / baseline))
    return rows


def format_table(rows: Sequence[PolicyRow]) -> str:
    lines = [f"{'policy':22s} {'tokens/pass':>11s} {'tok/s':>7s}  vs target-only", "-" * 58]
    for row in rows:
        lines.append(
            f"{row.name:22s} {row.tokens_per_pass:11.2f} {row.tokens_per_second:7.2f}  "
            f"{row.vs_target_only:.2f}x"
        )
    return "\n".join(lines)


def measured_costs(target: ModelRunner, draft: ModelRunner, max_drafts: int, rounds: int) -> Costs:
    """Medians over ``rounds`` of one draft token and of target forwards of 1..max_drafts+1."""
    verify_sizes = list(range(1, max_drafts + 2))
    samples = measure(
        {"target": target, "draft": draft},
        {"target": verify_sizes, "draft": [1]},  # a draft forward reads one token
        context=128,
        rounds=rounds,
    )
    return Costs(
        draft=statistics.median(samples["draft"][1]),
        verify={n: statistics.median(samples["target"][n]) for n in verify_sizes},
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    dirs = cached_pair_or_report()
    if dirs is None:
        return 2
    from bench.engine_harness import DEFAULT_PROMPTS

    from specpair_runtime.config import recommended_draft_quantization
    from specpair_runtime.engine.prompting import encode_prompt

    quantization = recommended_draft_quantization("cpu")
    # The loader gives the target the engine's kernels: its greedy tokens are the engine's.
    pair, engine = pair_and_engine(dirs, "cpu", quantization, max_length=256)
    assert pair.draft is not None and engine.draft is not None
    max_drafts = max(*DEFAULT_FIXED, *DEFAULT_CAPS, *(d + w for d, w in DEFAULT_BRANCHES))
    prompts = [encode_prompt(pair.target.tokenizer, text, chat=True) for text in DEFAULT_PROMPTS]
    with torch.inference_mode():
        continuations = [target_greedy(pair.target.model, p, args.max_new_tokens) for p in prompts]
        traces = [
            draft_trace(pair.draft.model, p, c) for p, c in zip(prompts, continuations, strict=True)
        ]
    costs = measured_costs(engine.target, engine.draft, max_drafts, args.rounds)
    agreement = [trace_agreement(t) for t in traces]
    misses = [p for t in traces for p in t if not p.agrees]
    second = sum(p.second_agrees for p in misses) / len(misses) if misses else 0.0
    print(
        f"draft {quantization}; {len(traces)} prompts, {[len(t) for t in traces]} tokens; "
        f"agreement {' / '.join(f'{a:.3f}' for a in agreement)}; "
        f"second choice right at {second:.0%} of the misses; "
        f"draft forward {costs.draft * 1e3:.1f} ms; target forward of n tokens (ms): "
        + ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in costs.verify.items())
    )
    chosen = policies(
        DEFAULT_FIXED, DEFAULT_CAPS, DEFAULT_PRODUCTS, DEFAULT_BRANCHES, schedule=True
    )
    bar = break_even_threshold(traces, costs)
    for cap in DEFAULT_CAPS:  # the engine's rule at its default maxDepth (4), and deeper
        chosen[f"break-even {bar:.2f} <={cap}"] = product_stop(bar, cap)
    print(format_table(replay_table(traces, chosen, costs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
