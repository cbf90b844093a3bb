"""What a serving step costs on 1 thread and on every CPU, with a core busy elsewhere or not.

A parallel op ends when its last thread does. In the server, the event loop,
the SSE writes and any other process compete for the same cores as torch's
threads; when one of them holds a core that an op's second thread needs, the
op waits for the scheduler. This times the step that chunked prefill makes
(``--rows`` decoding rows of one token plus one prompt chunk) on the tiny
pair's target through the engine's ``ModelRunner``, for each chunk size, on
1 thread and on all of torch's default threads, with ``--busy`` processes
spinning or none. Settings alternate within each round, so drift on a shared
machine hits all of them alike; ms is the median over rounds of each round's
median step, and "1 / all" the ratio within each round: median [min-max]
(``serving.cpuThreads``, docs/operations.md).

    .venv/bin/python bench/bench_cpu_threads.py [--chunks 0,16,32,256] [--rounds 3] [--busy 1]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specpair_runtime.openmp import openmp_defaults

os.environ.update(openmp_defaults(os.environ))  # before torch loads, as the runtime does
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.engine.kvcache import RowSpan
from specpair_runtime.engine.runner import ModelRunner

CONTEXT = 100  # tokens already in every slot
STEPS = 40  # timed steps per setting and chunk size per round (after 5 untimed)


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 0:
        raise argparse.ArgumentTypeError(f"every size must be >= 0, got {text!r}")
    return sizes


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes that spin, each holding a core, until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2 if spinners else 0)
        yield spinners
    finally:
        for process in spinners:
            process.kill()
            process.wait()


def step_seconds(runner: ModelRunner, rows: int, chunk: int) -> float:
    """Median seconds of one step: ``rows`` decoding rows and a ``chunk``-token prompt row."""
    spans = [RowSpan(slot, slot, 1, CONTEXT) for slot in range(rows)]
    sample = list(range(rows))
    if chunk:
        spans.append(RowSpan(rows, rows, chunk, CONTEXT))
        sample.append(rows + chunk - 1)  # the chunk's last position, as a final chunk
    ids = torch.randint(5, 100, (rows + chunk,))
    index = torch.tensor(sample)
    times = []
    for step in range(5 + STEPS):
        started = time.perf_counter()
        runner.forward(spans, ids, index)
        if step >= 5:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(
    runner: ModelRunner, args: argparse.Namespace, threads: list[int], loads: list[int]
) -> dict[tuple[int, int, int], list[float]]:
    """Seconds per step: (busy processes, threads, chunk) -> one median per round."""
    samples: dict[tuple[int, int, int], list[float]] = {}
    with torch.inference_mode():
        for slot in range(args.rows + 1):  # the context every step continues
            runner.forward([RowSpan(slot, 0, CONTEXT, 0)], torch.randint(5, 100, (CONTEXT,)), None)
        for _ in range(args.rounds):
            for busy in loads:
                with busy_cores(busy):
                    for count, chunk in itertools.product(threads, args.chunks):
                        torch.set_num_threads(count)
                        seconds = step_seconds(runner, args.rows, chunk)
                        samples.setdefault((busy, count, chunk), []).append(seconds)
    return samples


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--chunks", type=parse_sizes, default=[0, 8, 16, 32, 64, 256])
    parser.add_argument("--rows", type=int, default=8, metavar="N", help="decoding rows")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    parser.add_argument("--busy", type=int, default=1, metavar="N", help="spinning processes")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.rounds < 1 or args.busy < 0:
        parser.error("--rows and --rounds must be >= 1, --busy >= 0")
    every = torch.get_num_threads()
    pair = build_pair("llama", 0, 0.08)
    runner = ModelRunner(
        as_loaded(pair.target, pair.tokenizer, "tiny-target"),
        args.rows + 1,
        CONTEXT + max(args.chunks) + 1,
    )
    threads = sorted({1, every})
    loads = sorted({0, args.busy})
    try:
        samples = measure(runner, args, threads, loads)
    finally:
        torch.set_num_threads(every)  # the caller's threads, when imported
    print(
        f"tiny pair target, {args.rows} decoding rows + one chunk, context {CONTEXT}; "
        f"{args.rounds} rounds of {STEPS} steps; torch's default threads: {every}"
    )
    header = "busy  chunk " + "".join(f"{f'{n} thr ms':>10s}" for n in threads)
    print(header + ("  1 / all" if len(threads) > 1 else ""))
    for busy, chunk in itertools.product(loads, args.chunks):
        ms = [statistics.median(samples[(busy, n, chunk)]) * 1e3 for n in threads]
        ratio = ""
        if len(threads) > 1:  # within each round, so drift between rounds cancels
            rounds = zip(samples[(busy, 1, chunk)], samples[(busy, every, chunk)], strict=True)
            per_round = [one / all_ for one, all_ in rounds]
            low, high = min(per_round), max(per_round)
            ratio = f"  {statistics.median(per_round):.2f}x [{low:.2f}-{high:.2f}]"
        print(f"{busy:4d}  {chunk:5d} " + "".join(f"{m:10.2f}" for m in ms) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
