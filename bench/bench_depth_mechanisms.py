"""Depth rules on the real pair: real counts, and seconds from a measured cost table.

Each variant (knobs, or one mechanism of the depth rule switched off)
decodes the same prompts greedily through the real engine on the real
Qwen2.5-Coder pair, so its counts are the engine's own: target forwards,
draft forwards, drafted and accepted tokens. Time is not taken from the
clock per step: a shared machine's noise would swamp the differences, and
the adaptive rules would decide differently in every run. Instead each
forward is charged what a forward of that many tokens costs, from a table
measured once at the start (``bench_forward.measure``, the fastest of its
rounds, linear between the sizes measured), and the engine's step timer
reads that modelled clock. So the rules decide on the same costs in every
run and a variant's figures are deterministic; the table's own noise moves
every variant alike. Wall seconds are printed beside, for what they are
worth on a busy machine.

Modes: ``single`` decodes each prompt alone (``make bench``'s shape);
``batchN`` decodes N prompts at once, where the batch cap and the
break-even bar of N rows apply. Prompts: ``make bench``'s three and three
coding prompts, where acceptance runs higher. ``--bad-draft`` permutes the
draft's logits, so that it never agrees with the target (the case the
"not paying" rule exists for).

    .venv/bin/python bench/bench_depth_mechanisms.py [--variants a,b] [--modes single,batch3]
        [--max-new-tokens 96] [--costs FILE | --save-costs FILE] [--json FILE] [--bad-draft]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench.bench_forward import measure

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine import speculative
from specpair_runtime.engine.api import SamplingParams

if TYPE_CHECKING:
    from specpair_runtime.engine.pair import LoadedPair
    from specpair_runtime.engine.speculative import SpeculativeEngine

CODING_PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list, "
    "with type hints and a docstring.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods, "
    "and a short usage example.",
    "Write a Python function that parses a date in the format YYYY-MM-DD and returns "
    "the day of the week, raising ValueError on bad input.",
)
TARGET_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 17, 24, 32, 48, 64, 96, 128, 192)
DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 192)
CONTEXT = 128


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares; pool adjacent violators).

    A forward of more tokens never costs less; where a busy machine timed a
    size in a slow moment, the pooled value spreads that over its neighbours.
    """
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            total = blocks[-1][0] * blocks[-1][1] + mean * count
            blocks[-1][1] += count
            blocks[-1][0] = total / blocks[-1][1]
    return [mean for mean, count in blocks for _ in range(int(count))]


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one forward of n tokens: linear between the sizes measured, and past them."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    @staticmethod
    def smooth(sizes: Sequence[int], seconds: Sequence[float]) -> CostCurve:
        order = sorted(range(len(sizes)), key=lambda i: sizes[i])
        fitted = non_decreasing([seconds[i] for i in order])
        return CostCurve(tuple(sizes[i] for i in order), tuple(fitted))

    def __call__(self, tokens: int) -> float:
        i = bisect.bisect_left(self.sizes, tokens)
        if i < len(self.sizes) and self.sizes[i] == tokens:
            return self.seconds[i]
        lo = min(max(i - 1, 0), len(self.sizes) - 2)
        n0, n1 = self.sizes[lo], self.sizes[lo + 1]
        s0, s1 = self.seconds[lo], self.seconds[lo + 1]
        return max(s0 + (s1 - s0) * (tokens - n0) / (n1 - n0), 0.0)


class ModelledClock:
    """The sum of the modelled seconds of every forward so far."""

    def __init__(self, costs: Mapping[str, CostCurve]) -> None:
        self.costs = costs
        self.now = 0.0
        self.forwards = {name: 0 for name in costs}
        # Forwards by model and size: the same run's time under another table.
        self.sizes: dict[str, dict[int, int]] = {name: {} for name in costs}

    def charge(self, model: str, tokens: int) -> None:
        self.now += self.costs[model](tokens)
        self.forwards[model] += 1
        self.sizes[model][tokens] = self.sizes[model].get(tokens, 0) + 1

    def timer(self) -> type:
        """A ``StepTimer`` that reads this clock."""
        clock = self

        class ClockTimer:
            def __init__(self, device: torch.device) -> None:
                self.start = self.middle = clock.now

            def mark(self) -> None:
                self.middle = clock.now

            def split(self) -> tuple[float, float]:
                return self.middle - self.start, clock.now - self.middle

        return ClockTimer


def instrument(engine: SpeculativeEngine, clock: ModelledClock, bad_draft: bool) -> None:
    """Charge each forward of the engine's runners to ``clock`` (and spoil the draft)."""
    runners = {"target": engine.target, "draft": engine.draft}
    for name, runner in runners.items():
        if runner is None:
            continue
        original = runner.forward
        permute = bad_draft and name == "draft"

        def forward(
            rows: Any,
            input_ids: torch.Tensor,
            sample_index: torch.Tensor | None,
            *,
            dense: bool = False,
            _original: Callable[..., torch.Tensor | None] = original,
            _name: str = name,
            _permute: bool = permute,
        ) -> torch.Tensor | None:
            clock.charge(_name, int(input_ids.numel()))
            logits = _original(rows, input_ids, sample_index, dense=dense)
            if _permute and logits is not None:
                logits = logits.roll(1, dims=-1)  # every token's logit moves to its neighbour
            return logits

        runner.forward = forward  # type: ignore[method-assign]


# A variant: knobs, and patches of the depth rule's code (object, attribute, value).
Patch = tuple[Any, str, Any]


@dataclass(frozen=True)
class Variant:
    name: str
    knobs: SpeculationKnobs | None  # None: target-only
    patches: tuple[Patch, ...] = ()


@dataclass
class Outcome:
    variant: str
    mode: str
    tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    modelled_seconds: float = 0.0
    wall_seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)
    forward_sizes: dict[str, dict[int, int]] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.modelled_seconds if self.modelled_seconds else 0.0


@contextlib.contextmanager
def patched(patches: Sequence[Patch]) -> Iterator[None]:
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    try:
        for obj, attr, value in patches:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def run_variant(
    pair: LoadedPair,
    variant: Variant,
    mode: str,
    prompts: Sequence[list[int]],
    costs: Mapping[str, CostCurve],
    max_new_tokens: int,
    bad_draft: bool,
) -> Outcome:
    """Decode ``prompts`` in ``mode`` (alone each, or in batches) with ``variant``."""
    from specpair_runtime.engine.options import EngineOptions
    from specpair_runtime.engine.speculative import generate

    batch = 1 if mode == "single" else int(mode.removeprefix("batch"))
    groups = [list(prompts[i : i + batch]) for i in range(0, len(prompts), batch)]
    length = max(len(p) for p in prompts) + max_new_tokens
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    outcome = Outcome(variant.name, mode)
    clock = ModelledClock(costs)
    with patched([*variant.patches, (speculative, "StepTimer", clock.timer())]):
        # One engine for every group, as a server keeps it: what the rules learn carries over.
        options = EngineOptions(max_slots=batch, max_length=length)
        engine = pair.engine(
            speculate=variant.knobs is not None, knobs=variant.knobs, options=options
        )
        instrument(engine, clock, bad_draft)
        for group in groups:
            started = time.perf_counter()
            results = generate(engine, group, params)
            outcome.wall_seconds += time.perf_counter() - started
            for result in results:
                outcome.tokens += len(result.token_ids)
                outcome.drafted += result.stats.drafted_tokens
                outcome.accepted += result.stats.accepted_tokens
                outcome.outputs.append(result.token_ids)
        outcome.fallbacks = dict(engine.fallback_counts)
    outcome.modelled_seconds = clock.now
    outcome.forward_sizes = clock.sizes
    outcome.target_forwards = clock.forwards["target"]
    outcome.draft_forwards = clock.forwards.get("draft", 0)
    return outcome


def measure_costs(pair: LoadedPair, rounds: int) -> dict[str, CostCurve]:
    """The fastest of ``rounds`` per size, through the engine's runners (``bench_forward``)."""
    from specpair_runtime.engine.options import EngineOptions

    engine = pair.engine(options=EngineOptions(max_slots=1, max_length=CONTEXT + 256))
    assert engine.draft is not None
    samples = measure(
        {"target": engine.target, "draft": engine.draft},
        {"target": TARGET_SIZES, "draft": DRAFT_SIZES},
        context=CONTEXT,
        rounds=rounds,
        repeats=3,
    )
    return {
        name: CostCurve.smooth(list(by_size), [min(by_size[n]) for n in by_size])
        for name, by_size in samples.items()
    }


def _verdict_only(cost_cap: Callable[..., int]) -> Callable[..., int]:
    """``CostModel.cost_cap`` that keeps its "not paying" verdict (0) but never
    caps the depth below the batch cap."""

    def capped(self: Any, batch_size: int, min_depth: int, max_depth: int) -> int:
        return 0 if cost_cap(self, batch_size, min_depth, max_depth) == 0 else max_depth

    return capped


def variants() -> dict[str, Variant]:
    """The variants this script knows, by name: the default, each mechanism off, fixed depths."""
    from specpair_runtime.engine import cost_model, depth

    default = SpeculationKnobs()
    never = 10**9
    chosen = {
        "target-only": Variant("target-only", None),
        "default": Variant("default", default),
        "no-verdict": Variant(
            "no-verdict",
            default,
            (
                (cost_model, "MIN_VERDICT_STEPS", never),
                (depth, "MIN_VERDICT_STEPS", never),
                (depth, "PROBE_TARGET_EVERY", never),
            ),
        ),
        "stop-0.5": Variant("stop-0.5", default.model_copy(update={"draft_confidence": 0.5})),
        "no-cost-cap": Variant(
            "no-cost-cap",
            default,
            ((cost_model.CostModel, "cost_cap", _verdict_only(cost_model.CostModel.cost_cap)),),
        ),
        "no-batch-cap": Variant(
            "no-batch-cap",
            default,
            ((depth, "batch_depth_cap", lambda b, knobs: knobs.depth_limit),),
        ),
    }
    for cap in (4, 6, 8, 12, 16):
        knobs = default.model_copy(update={"max_depth": cap})
        chosen[f"default<={cap}"] = Variant(f"default<={cap}", knobs)
        chosen[f"stop-0.5<={cap}"] = Variant(
            f"stop-0.5<={cap}", knobs.model_copy(update={"draft_confidence": 0.5})
        )
        chosen[f"no-batch-cap<={cap}"] = Variant(
            f"no-batch-cap<={cap}",
            knobs,
            ((depth, "batch_depth_cap", lambda b, knobs: knobs.depth_limit),),
        )
    for k in (1, 2, 3, 4, 5, 6, 8, 10, 12):
        chosen[f"k={k}"] = Variant(
            f"k={k}", SpeculationKnobs(max_depth=k, min_depth=k, adaptive=False)
        )
    return chosen


def format_table(rows: Sequence[Outcome], baseline: Mapping[str, Outcome]) -> str:
    header = (
        f"{'variant':20s} {'mode':7s} {'tokens':>6s} {'tgt fwd':>7s} {'tok/tgt':>7s} "
        f"{'drf fwd':>7s} {'accept':>6s} {'model s':>8s} {'vs tgt':>6s} {'wall s':>7s}  fallbacks"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        base = baseline.get(row.mode)
        ratio = row.tokens_per_second / base.tokens_per_second if base else float("nan")
        accept = row.accepted / row.drafted if row.drafted else 0.0
        lines.append(
            f"{row.variant:20s} {row.mode:7s} {row.tokens:6d} {row.target_forwards:7d} "
            f"{row.tokens / row.target_forwards:7.2f} {row.draft_forwards:7d} {accept:6.2f} "
            f"{row.modelled_seconds:8.1f} {ratio:5.2f}x {row.wall_seconds:7.1f}  "
            f"{dict(sorted(row.fallbacks.items()))}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    known = variants()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--variants", default="default,k=4", help=f"of {', '.join(known)}")
    parser.add_argument("--modes", default="single", help="single, batch3, batch6")
    parser.add_argument("--max-new-tokens", type=int, default=96, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the cost table")
    parser.add_argument("--costs", type=Path, help="a cost table saved by --save-costs")
    parser.add_argument("--save-costs", type=Path)
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--bad-draft", action="store_true", help="a draft that never agrees")
    args = parser.parse_args(argv)
    names = ["target-only", *(n for n in args.variants.split(",") if n and n != "target-only")]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(known)}")
    modes = [m for m in args.modes.split(",") if m]
    if any(m != "single" and not m.removeprefix("batch").isdigit() for m in modes):
        parser.error(f"modes are single or batchN, got {args.modes!r}")

    from bench.engine_harness import DEFAULT_PROMPTS
    from tools.fetch_models import cached_pair_or_report

    from specpair_runtime.config import ModelSpec, recommended_draft_quantization
    from specpair_runtime.cpu_threads import apply_cpu_threads
    from specpair_runtime.engine.pair import load_pair
    from specpair_runtime.engine.prompting import encode_prompt

    dirs = cached_pair_or_report()
    if dirs is None:
        return 2
    apply_cpu_threads(None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pair = load_pair(
        ModelSpec(source=str(dirs["target"])),
        ModelSpec(source=str(dirs["draft"]), quantization=recommended_draft_quantization(device)),
        SpeculationKnobs(),
        device,
    )
    if args.costs is not None:
        table = json.loads(args.costs.read_text())
        costs = {name: CostCurve.smooth(c["sizes"], c["seconds"]) for name, c in table.items()}
    else:
        costs = measure_costs(pair, args.rounds)
        if args.save_costs is not None:
            args.save_costs.write_text(json.dumps({n: asdict(c) for n, c in costs.items()}))
    print(
        "cost table (ms): "
        + "; ".join(
            f"{name} "
            + ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in zip(c.sizes, c.seconds, strict=True))
            for name, c in costs.items()
        ),
        flush=True,
    )
    texts = [*DEFAULT_PROMPTS, *CODING_PROMPTS]
    prompts = [encode_prompt(pair.target.tokenizer, text, chat=True) for text in texts]
    rows: list[Outcome] = []
    for mode in modes:
        for name in names:
            outcome = run_variant(
                pair, known[name], mode, prompts, costs, args.max_new_tokens, args.bad_draft
            )
            rows.append(outcome)
            print(format_table([outcome], {}).splitlines()[-1], file=sys.stderr, flush=True)
    baseline = {r.mode: r for r in rows if r.variant == "target-only"}
    print(format_table(rows, baseline))
    reference = {r.mode: r.outputs for r in rows if r.variant == "target-only"}
    differ = [f"{r.variant}/{r.mode}" for r in rows if r.outputs != reference[r.mode]]
    print("greedy output identical to target-only:", "yes" if not differ else f"NO: {differ}")
    if args.json is not None:
        summary = [
            {**asdict(r), "tokens_per_second": r.tokens_per_second, "outputs": None} for r in rows
        ]
        args.json.write_text(
            json.dumps({"costs": {n: asdict(c) for n, c in costs.items()}, "rows": summary})
        )
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
