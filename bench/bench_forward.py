"""What one forward of n query tokens costs, on the engine's own path, per model.

Speculation pays only while a verify of k + 1 tokens costs about one decode
step, and the draft's k forwards stay cheap beside it. This prints that cost
curve for the pair that ``make bench`` runs: the target (prepacked oneDNN
fp32 on the CPU) and the draft (int4-weight on the CPU), each through the
engine's ``ModelRunner`` over its slot storage, with logits at every query
position as a verify takes them. Each forward continues a context of
``--context`` tokens; its positions are overwritten by the next one (the
engine's rollback by length). On CUDA the target runs in bf16 and the steps
replay captured CUDA graphs, as the engine runs them (``make gpu-check``
includes this curve).

Rounds alternate over models and sizes, so drift on a shared machine hits
all of them alike. Per size it prints the median milliseconds over rounds
and the cost against one token, computed within each round: the median and
[min-max] over rounds. ``--transformers-forward`` also times each model
through transformers' own forward on the same modules (rows ``<model>-hf``)
and prints the engine's loop against it, per size, within each round.

    .venv/bin/python bench/bench_forward.py [--tokens 1,2,4,5,8,9,16] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads sleep when idle but spin briefly between ops (before torch loads).
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from specpair_runtime.config import Quantization
from specpair_runtime.engine.kvcache import RowSpan

if TYPE_CHECKING:
    from tools.fetch_models import Role

    from specpair_runtime.engine.pair import LoadedPair
    from specpair_runtime.engine.runner import ModelRunner
    from specpair_runtime.engine.speculative import SpeculativeEngine

DEFAULT_TOKENS = (1, 2, 4, 5, 8, 9, 16)
DEFAULT_CONTEXT = 128
REPEATS = 5  # forwards per size per round; the round keeps their median


def parse_tokens(text: str) -> list[int]:
    """``--tokens``: comma-separated query sizes >= 1; 1 is always measured (the baseline)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"every size must be >= 1, got {text!r}")
    return sorted({1, *sizes})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(runner: ModelRunner, context: int, rows: int = 1) -> None:
    """Fill slots 0..rows-1 with ``context`` tokens each: what every timed forward continues."""
    ids = torch.randint(100, 1000, (context,), generator=torch.Generator().manual_seed(0))
    spans = [RowSpan(row, row * context, context, 0) for row in range(rows)]
    runner.forward(spans, ids.repeat(rows).to(runner.device), None)


def time_forward(
    runner: ModelRunner, tokens: int, context: int, repeats: int, rows: int = 1
) -> float:
    """Median seconds of a forward of ``rows`` rows of ``tokens`` tokens after ``context`` each."""
    ids = torch.randint(100, 1000, (rows * tokens,)).to(runner.device)
    every = torch.arange(rows * tokens, device=runner.device)  # logits everywhere, like a verify
    span = [RowSpan(row, row * tokens, tokens, context) for row in range(rows)]
    # Untimed: the first call of a shape (on CUDA, cudagraph trees run it
    # eagerly, then record it, and only the third call replays).
    started = time.perf_counter()
    for _ in range(3 if runner.graphs is not None else 1):
        runner.forward(span, ids, every)
    _sync(runner.device)
    warmup = time.perf_counter() - started
    if warmup > 1.0:  # a compile or a capture: say what it cost
        print(f"  {tokens} tokens: first calls took {warmup:.1f} s", file=sys.stderr, flush=True)
    samples = []
    for _ in range(repeats):
        _sync(runner.device)
        started = time.perf_counter()
        runner.forward(span, ids, every)
        _sync(runner.device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure(
    runners: Mapping[str, ModelRunner],
    sizes: Mapping[str, Sequence[int]],
    *,
    context: int,
    rounds: int,
    repeats: int = REPEATS,
    rows: int = 1,
) -> dict[str, dict[int, list[float]]]:
    """Seconds per forward: model -> size -> one value per round (rounds alternate).

    ``sizes`` names the query sizes (tokens per row) to time for each model in
    ``runners``; each forward has ``rows`` rows, in slots 0..rows-1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    samples: dict[str, dict[int, list[float]]] = {
        name: {n: [] for n in sizes[name]} for name in runners
    }
    with torch.inference_mode():
        for runner in runners.values():
            prefill(runner, context, rows)
        for _ in range(rounds):
            for name, runner in runners.items():
                for n in sizes[name]:
                    seconds = time_forward(runner, n, context, repeats, rows)
                    samples[name][n].append(seconds)
                    # As it comes, so that a run cut short still says something.
                    print(f"  {name} {n} tokens: {seconds * 1e3:.1f} ms", file=sys.stderr)
    return samples


@dataclass(frozen=True)
class CostRow:
    model: str
    tokens: int
    ms: float  # median over rounds
    ratio: float  # against 1 token, median of the per-round ratios
    ratio_min: float
    ratio_max: float


def _spread(seconds: Sequence[float], baseline: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios ``seconds / baseline``."""
    ratios = [s / b for s, b in zip(seconds, baseline, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def summarize(samples: Mapping[str, Mapping[int, Sequence[float]]]) -> list[CostRow]:
    """Per model and size: median ms, and the cost against 1 token within each round."""
    rows = []
    for model, by_size in samples.items():
        base = by_size[1]
        for n, seconds in sorted(by_size.items()):
            rows.append(
                CostRow(model, n, statistics.median(seconds) * 1e3, *_spread(seconds, base))
            )
    return rows


def paired_ratios(
    samples: Mapping[str, Mapping[int, Sequence[float]]], suffix: str
) -> list[tuple[str, int, float, float, float]]:
    """(model, tokens, median, min, max) of ``model`` / ``model<suffix>``, within each round."""
    out = []
    for name, by_size in samples.items():
        other = samples.get(f"{name}{suffix}")
        if other is None:
            continue
        for n, seconds in sorted(by_size.items()):
            out.append((name, n, *_spread(seconds, other[n])))
    return out


def loop_ratios(
    samples: Mapping[str, Mapping[int, Sequence[float]]],
) -> list[tuple[str, int, float, float, float]]:
    """(model, tokens, median, min, max) of the engine's loop / transformers' forward per round."""
    return paired_ratios(samples, "-hf")


def format_rows(rows: Sequence[CostRow]) -> str:
    lines = [f"{'model':8s} {'tokens':>6s} {'ms':>8s}  vs 1 token", "-" * 44]
    for row in rows:
        spread = f"[{row.ratio_min:.2f}-{row.ratio_max:.2f}]"
        lines.append(f"{row.model:8s} {row.tokens:6d} {row.ms:8.1f}  {row.ratio:.2f}x {spread}")
    return "\n".join(lines)


def pair_and_engine(
    dirs: Mapping[Role, Path],
    device: str,
    quantization: Quantization,
    max_length: int,
    *,
    cuda_graphs: bool = True,
    compile_graphs: bool = False,
    slots: int = 1,
) -> tuple[LoadedPair, SpeculativeEngine]:
    """The fetched pair, and an engine over it whose runners are timed (in slot 0).

    As the runtime runs them: the loader switches the CPU's linears to the
    engine's kernels, and on CUDA uniform steps replay captured graphs.
    """
    from specpair_runtime.config import ModelSpec, SpeculationKnobs
    from specpair_runtime.engine.options import EngineOptions
    from specpair_runtime.engine.pair import load_pair

    pair = load_pair(
        ModelSpec(source=str(dirs["target"])),
        ModelSpec(source=str(dirs["draft"]), quantization=quantization),
        SpeculationKnobs(),
        device,
    )
    options = EngineOptions(
        max_slots=slots,
        max_length=max_length,
        cuda_graphs=cuda_graphs,
        cuda_graph_compile=compile_graphs,
    )
    return pair, pair.engine(options=options)


def graph_kind(engine: SpeculativeEngine) -> str:
    graphs = engine.target.graphs
    if graphs is None:
        return "eager"
    return "compiled graphs" if graphs.compiles else "captured graphs"


def transformers_runners(
    runners: Mapping[str, ModelRunner], max_length: int, slots: int = 1
) -> dict[str, ModelRunner]:
    """A runner per model that takes transformers' forward instead of the engine's loop.

    Same loaded modules and kernels, its own storage of ``slots`` slots. Where the engine
    runs transformers' forward anyway (no ``DecoderLoop`` for the model), none.
    """
    from specpair_runtime.engine.runner import ModelRunner

    others: dict[str, ModelRunner] = {}
    for name, runner in runners.items():
        if runner.decoder is None:
            continue
        other = ModelRunner(runner.loaded, slots, max_length)
        other.decoder = None
        others[f"{name}-hf"] = other
    return others


def eager_runners(
    runners: Mapping[str, ModelRunner], max_length: int, slots: int = 1
) -> dict[str, ModelRunner]:
    """A runner per graph-stepping model that runs every forward eagerly (``<model>-eager``).

    Same loaded modules, the engine's own loop, its own storage of ``slots`` slots: the
    baseline that replay is set against within each round.
    """
    from specpair_runtime.engine.runner import ModelRunner

    return {
        f"{name}-eager": ModelRunner(runner.loaded, slots, max_length)
        for name, runner in runners.items()
        if runner.graphs is not None
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=parse_tokens, default=list(DEFAULT_TOKENS))
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    parser.add_argument("--device", help="torch device (default: cuda if present, else cpu)")
    parser.add_argument(
        "--draft-quantization",
        choices=get_args(Quantization),
        help="the draft's quantization (default: what make bench runs on the device)",
    )
    parser.add_argument(
        "--transformers-forward",
        action="store_true",
        help="also time each model through transformers' own forward (rows '<model>-hf'), "
        "on the same modules and kernels, alternating with the engine's loop",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="on CUDA, run every forward eagerly (no captured graphs), to compare with replay",
    )
    parser.add_argument(
        "--compile-graphs",
        action="store_true",
        help="on CUDA, record torch.compile's fused step instead of capturing the eager one "
        "(the engine's cudaGraphCompile)",
    )
    parser.add_argument(
        "--baseline-eager",
        action="store_true",
        help="on CUDA, also time each model eagerly on the same modules (rows '<model>-eager'), "
        "alternating with the graph steps, and print replay against eager per size",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=1,
        metavar="N",
        help="KV slots of the engine: its warm-up records every row bucket up to N, as a "
        "server with maxBatchSize N does (forwards are timed on one row)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=1,
        metavar="N",
        help="rows per timed forward (each in its own slot after --context tokens): the "
        "cost of a decode or verify step of N requests",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        metavar="N",
        help="positions per KV slot (default: the context plus the largest size); the dense "
        "graph step reads whole slots, so this sets what its attention reads",
    )
    parser.add_argument(
        "--shaped-pair",
        action="store_true",
        help="time a pair of the real pair's architecture with random weights instead of the "
        "fetched pair (costs depend on shapes, not values; for machines without the pair)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    needed = args.context + max(args.tokens) + 1
    if args.max_length is not None and args.max_length < needed:
        parser.error(f"--max-length must be >= --context + the largest size + 1 = {needed}")
    if args.slots < 1:
        parser.error(f"--slots must be >= 1, got {args.slots}")
    if args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    if args.eager and (args.compile_graphs or args.baseline_eager):
        parser.error("--eager runs no graphs; drop --compile-graphs and --baseline-eager")
    from tools.shaped_pair import bench_pair

    with bench_pair(shaped=args.shaped_pair) as dirs:
        return 2 if dirs is None else run(args, dirs)


def run(args: argparse.Namespace, dirs: Mapping[Role, Path]) -> int:
    from specpair_runtime.config import recommended_draft_quantization
    from specpair_runtime.engine.loading import resolve_device

    device = resolve_device(args.device)
    # The draft as make bench runs it; the target is never quantized.
    quantization = args.draft_quantization or recommended_draft_quantization(device.type)
    length = args.max_length or args.context + max(args.tokens) + 1
    slots = max(args.slots, args.rows)
    _, engine = pair_and_engine(
        dirs,
        str(device),
        quantization,
        length,
        cuda_graphs=not args.eager,
        compile_graphs=args.compile_graphs,
        slots=slots,
    )
    started = time.perf_counter()
    shapes = engine.warm_up_graphs()
    warm_up_seconds = time.perf_counter() - started
    if shapes:  # what a new pod pays before it turns ready, for this slot count
        print(
            f"warm-up: recorded {shapes} graph step shapes of both models in "
            f"{warm_up_seconds:.1f} s",
            flush=True,
        )
    runners: dict[str, ModelRunner] = {"target": engine.target}
    if engine.draft is not None:
        runners["draft"] = engine.draft
    if args.baseline_eager:
        runners.update(eager_runners(runners, length, args.rows))
    if args.transformers_forward:
        runners.update(transformers_runners(runners, length, args.rows))
    print(
        f"{'shaped pair (random weights)' if args.shaped_pair else 'real pair'} on "
        f"device {device} ({engine.target.dtype}, "
        f"{graph_kind(engine)}), max length {length}, "
        f"draft quantization {quantization}, "
        f"torch threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '')}; "
        f"{args.rows} row(s) per forward, context {args.context}, "
        f"{args.rounds} rounds of {REPEATS} forwards per size",
        flush=True,
    )
    every = {name: args.tokens for name in runners}
    samples = measure(runners, every, context=args.context, rounds=args.rounds, rows=args.rows)
    rows = summarize(samples)
    print(format_rows(rows))
    for name, n, ratio, low, high in loop_ratios(samples):
        print(
            f"{name} {n} tokens: engine loop / transformers forward "
            f"{ratio:.2f} [{low:.2f}-{high:.2f}]"
        )
    replay_vs_eager = paired_ratios(samples, "-eager")
    for name, n, ratio, low, high in replay_vs_eager:
        print(f"{name} {n} tokens: graph replay / eager {ratio:.2f} [{low:.2f}-{high:.2f}]")
    if args.json is not None:
        report = {
            "graphs": graph_kind(engine),
            "max_length": length,
            "slots": slots,
            "rows_per_forward": args.rows,
            "warm_up_shapes": shapes,
            "warm_up_seconds": round(warm_up_seconds, 2),
            "rows": [row.__dict__ for row in rows],
            "replay_vs_eager": [
                {"model": name, "tokens": n, "ratio": r, "min": low, "max": high}
                for name, n, r, low, high in replay_vs_eager
            ],
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
