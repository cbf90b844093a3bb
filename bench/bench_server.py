"""Load benchmark: N concurrent streaming clients against ``specpair-runtime serve``.

Starts the server as a real subprocess on loopback, once with speculation on
and once with it off, and drives it with httpx clients. Reports throughput
(completion tokens/s) and p50/p95/p99 of TTFT and ITL per concurrency level,
and the goal ratio: p99 ITL at the highest concurrency / p99 ITL of one stream
(goal <= 1.5). Per level it also reads the server's ``specpair_step_seconds``
before and after, and prints how many engine steps of each kind ran and their
mean time: ``mixed`` steps (prompt chunks beside decoding streams) against
``decode`` steps show what arriving prompts cost the running streams. It also
reads ``specpair_held_back_steps``: steps in which a stream committed tokens
but released no text (an incomplete UTF-8 character, say), so that its next
chunk gap spans two steps. When they are more than about 1 % of a level's
gaps, that level's p99 ITL is such a two-step gap, whatever the engine's
step times.

ITL is the gap between consecutive SSE chunks of one stream, as a client sees
it. With speculation one chunk carries every token of an accept step, so the
per-chunk gap is also reported divided by the mean tokens per chunk.

The levels run in ``--rounds`` rounds, in ascending order in odd rounds and
descending in even ones (1, 8, 8, 1, ...), and each level's gaps are pooled
over its rounds. Shared machines change speed in spells: the same forward
can take a third longer for the rest of a run. Run one after the other, the
single-stream baseline and the 8-stream level could fall into different
spells, and their ratio would move with the spell, not with the engine;
interleaved, both sample the same spells. Each round's own ratio is printed
too, as the spread. Each round sends the whole load
(``--requests-per-stream`` each): with fewer requests per round, more of a
level's short prompts arrive in the burst that starts it, where every
stream prefills at once, and the short prompts' time to first token reads
higher (on the 1.5B pair at 8 streams, a p50 of 2.2-2.5 s at 2 requests
per stream and round, against 0.89-0.98 s at 4).

``--long-prompt-words N`` puts N words of context before every other prompt,
so long prompts keep arriving while the other streams decode: the load that
chunked prefill (``serving.maxStepTokens``) exists for. Each long prompt
opens with its own case number, so no two share more than their first few
tokens: the server's prefix reuse (``serving.prefixReuse``) would otherwise
skip the repeated context, and the level would no longer carry prompt work.

Every level sends each of the ``PROMPTS`` equally often (one stream sends
all of them, more than ``--requests-per-stream`` if need be), so the levels
compare the same outputs. That matters for the tail: a character whose
UTF-8 bytes span two tokens (the Chinese comments the 1.5B coder writes
after ``for i in range(10):``) is held back until it is complete, so its
chunk gap spans two steps; with four prompts at one stream and all eight at
eight streams, only the second level had such gaps.

    python bench/bench_server.py --tiny                       # tiny models built in code
    python bench/bench_server.py --real-pair --long-prompt-words 100   # after make models
    python bench/bench_server.py --config runtime.yaml --streams 1,4,8
    python bench/bench_server.py --config runtime.yaml --long-prompt-words 400
    # another engine under the same load: its runtime/ from another revision
    git archive REV runtime | tar -x -C /tmp/old
    python bench/bench_server.py --config old.yaml --runtime-src /tmp/old
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specpair_runtime.config import Quantization, recommended_draft_quantization
from specpair_runtime.hardware import cpu_info

REPO = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Hello, how can I help you",
    "My order has not arrived yet and",
    "Please share your order number so",
    "The refund will appear on your card",
    "Can I change the delivery address",
    "def add(a, b):",
    "for i in range(10):",
    "one two three four five",
]


@dataclass
class StreamResult:
    ttft: float
    gaps: list[float]
    chunks: int
    tokens: int
    long_prompt: bool = False  # sent with ``--long-prompt-words`` of context


@dataclass
class LevelResult:
    mode: str
    streams: int
    wall_seconds: float
    results: list[StreamResult] = field(default_factory=list)
    # The server's engine steps during the level, by kind (specpair_step_seconds).
    steps: dict[str, dict[str, float]] = field(default_factory=dict)
    held_back_steps: int = 0  # specpair_held_back_steps during the level

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    def summary(self) -> dict[str, Any]:
        ttft = [r.ttft for r in self.results]
        gaps = [g for r in self.results for g in r.gaps]
        chunks = sum(r.chunks for r in self.results)
        tokens_per_chunk = self.tokens / chunks if chunks else 0.0
        return {
            "mode": self.mode,
            "streams": self.streams,
            "requests": len(self.results),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.wall_seconds, 1),
            "ttft_ms": percentiles(ttft),
            # Short prompts wait behind long ones only as the engine orders its prefills.
            "ttft_short_ms": percentiles([r.ttft for r in self.results if not r.long_prompt]),
            "ttft_long_ms": percentiles([r.ttft for r in self.results if r.long_prompt]),
            "itl_ms": percentiles(gaps),
            "gaps": len(gaps),
            "held_back_steps": self.held_back_steps,
            "held_back_share": round(self.held_back_steps / len(gaps), 4) if gaps else 0.0,
            "tokens_per_chunk": round(tokens_per_chunk, 2),
            "itl_per_token_p50_ms": round(
                percentiles(gaps)["p50"] / tokens_per_chunk if tokens_per_chunk else 0.0, 2
            ),
            "steps": self.steps,
        }


StepTotals = dict[str, tuple[float, float]]  # kind -> (steps, seconds)


def step_totals(metrics_text: str) -> StepTotals:
    """Count and sum of ``specpair_step_seconds`` per kind, from a /metrics page."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "specpair_step_seconds":
            continue
        for sample in family.samples:
            slot = {"_count": 0, "_sum": 1}.get(sample.name.removeprefix(family.name))
            if slot is not None:
                totals.setdefault(sample.labels["kind"], [0.0, 0.0])[slot] = sample.value
    return {kind: (count, seconds) for kind, (count, seconds) in totals.items()}


def step_delta(before: StepTotals, after: StepTotals) -> dict[str, dict[str, float]]:
    """Steps and their mean milliseconds per kind between two scrapes (kinds that ran)."""
    delta: dict[str, dict[str, float]] = {}
    for kind, (count, seconds) in after.items():
        old_count, old_seconds = before.get(kind, (0.0, 0.0))
        if count > old_count:
            mean_ms = (seconds - old_seconds) / (count - old_count) * 1000
            delta[kind] = {"count": count - old_count, "mean_ms": round(mean_ms, 2)}
    return delta


def held_back_steps(metrics_text: str) -> int:
    """``specpair_held_back_steps_total`` from a /metrics page (0 from a runtime without it)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "specpair_held_back_steps":
            return int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return 0


def scrape(base_url: str) -> tuple[StepTotals, int]:
    """The step histogram's totals and the held-back steps so far."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return step_totals(text), held_back_steps(text)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    ordered = sorted(values)
    if len(ordered) == 1:
        ordered = ordered * 2
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "p50": round(cuts[49] * 1000, 2),
        "p95": round(cuts[94] * 1000, 2),
        "p99": round(cuts[98] * 1000, 2),
    }


def server_env(base: Mapping[str, str], runtime_src: Path | None) -> dict[str, str]:
    """The server child's environment; with ``runtime_src``, its ``runtime/`` is imported
    instead of this checkout's, so two engines meet the same load and client."""
    env = {**base, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    if runtime_src is not None:
        env["PYTHONPATH"] = str(runtime_src / "runtime")
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def tiny_config(directory: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from tools.tiny_models import save_pair

    target, draft = save_pair(directory)
    return {
        "pair": {"name": "tiny", "version": "bench"},
        "target": {"source": str(target), "dtype": "float32"},
        "draft": {"source": str(draft), "dtype": "float32"},
        "speculation": {"maxDepth": 4},
    }


def real_pair_config(
    device: str | None, draft_quantization: Quantization | None = None
) -> dict[str, Any]:
    """The 1.5B/0.5B Qwen pair that ``make models`` put in the cache, as ``make bench`` runs it.

    ``draft_quantization`` None: what the benchmarks run on the device.
    """
    sys.path.insert(0, str(REPO))
    from tools.fetch_models import CacheLayout, converted_pair, default_cache

    dirs = converted_pair(CacheLayout(default_cache()))  # FetchError names what is missing
    on_cuda = device is not None and device.startswith("cuda")
    return {
        "pair": {"name": "qwen2.5-coder", "version": "bench"},
        "target": {"source": str(dirs["target"])},
        # A cheap draft is what makes speculation pay on a CPU (as in make bench).
        "draft": {
            "source": str(dirs["draft"]),
            "quantization": draft_quantization
            or recommended_draft_quantization("cuda" if on_cuda else "cpu"),
        },
    }


async def one_stream(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, seed: int
) -> StreamResult:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
    }
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    chunks = 0
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                chunks += 1
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return StreamResult(ttft=(first or last) - start, gaps=gaps, chunks=chunks, tokens=tokens)


FILLER = (
    "Background for the assistant: the customer wrote in earlier about a delayed parcel, "
    "a refund for a damaged item, and a question about changing the delivery address. "
)


# Numbers the long prompts of a run, so no two share their context (see the module doc).
CASE_NUMBERS = itertools.count(1)


def long_prompt(prompt: str, words: int, case: int) -> str:
    """``prompt`` after case number ``case`` and ``words`` words of deterministic context."""
    filler = FILLER.split()
    context = " ".join(filler[i % len(filler)] for i in range(words))
    return f"Case {case}. {context}\n\n{prompt}"


def is_long(index: int, round_: int, long_words: int) -> bool:
    """The odd prompts are long (when ``long_words`` > 0): every other request of a
    stream, and at any time about half of the streams."""
    return bool(long_words) and (index + round_) % len(PROMPTS) % 2 == 1


def prompt_for(index: int, round_: int, long_words: int, case: int = 0) -> str:
    number = (index + round_) % len(PROMPTS)
    if is_long(index, round_, long_words):
        return long_prompt(PROMPTS[number], long_words, case)
    return PROMPTS[number]


def requests_per_stream_at(streams: int, requested: int) -> int:
    """At least ``requested``, and enough that the streams send every prompt equally often:
    with ``prompt_for`` that holds for any count when ``streams`` is a multiple of the
    number of prompts, and otherwise for whole cycles through them."""
    if streams % len(PROMPTS) == 0:
        return requested
    return -(-requested // len(PROMPTS)) * len(PROMPTS)


async def run_level(
    base_url: str,
    mode: str,
    streams: int,
    requests_per_stream: int,
    max_tokens: int,
    long_words: int = 0,
) -> LevelResult:
    async with httpx.AsyncClient(base_url=base_url, timeout=1800) as client:
        rounds = requests_per_stream_at(streams, requests_per_stream)

        async def client_loop(index: int) -> list[StreamResult]:
            out = []
            for round_ in range(rounds):
                prompt = prompt_for(index, round_, long_words, next(CASE_NUMBERS))
                result = await one_stream(client, prompt, max_tokens, index)
                result.long_prompt = is_long(index, round_, long_words)
                out.append(result)
            return out

        start = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(i) for i in range(streams)))
        wall = time.perf_counter() - start
    level = LevelResult(mode, streams, wall)
    for results in per_client:
        level.results.extend(results)
    return level


def wait_ready(base_url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            body = httpx.get(f"{base_url}/readyz", timeout=5).json()
            if body["ready"]:
                return
            if body["phase"] == "failed":
                raise RuntimeError(f"server not ready: {body['reason']}")
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server not ready in time")


def round_order(levels: list[int], round_: int) -> list[int]:
    """The levels of round ``round_`` (0-based): ascending, then descending, and so on."""
    ordered = sorted(levels)
    return ordered if round_ % 2 == 0 else ordered[::-1]


def merge_rounds(rounds: list[LevelResult]) -> LevelResult:
    """One level's rounds as one result: their streams' results, wall time, steps and
    held-back steps together."""
    first = rounds[0]
    if any((lv.mode, lv.streams) != (first.mode, first.streams) for lv in rounds):
        raise ValueError("merge_rounds takes the rounds of one mode and level")
    merged = LevelResult(first.mode, first.streams, sum(lv.wall_seconds for lv in rounds))
    totals: dict[str, tuple[float, float]] = {}
    for level in rounds:
        merged.results.extend(level.results)
        merged.held_back_steps += level.held_back_steps
        for kind, step in level.steps.items():
            count, ms = totals.get(kind, (0.0, 0.0))
            totals[kind] = (count + step["count"], ms + step["count"] * step["mean_ms"])
    merged.steps = {
        kind: {"count": count, "mean_ms": round(ms / count, 2)}
        for kind, (count, ms) in totals.items()
    }
    return merged


def bench_mode(
    config: dict[str, Any], mode: str, args: argparse.Namespace, workdir: Path
) -> list[list[LevelResult]]:
    """Each round's levels, in the order they ran (``round_order``)."""
    port = free_port()
    speculation = {**config.get("speculation", {}), "enabled": mode == "speculation"}
    serving = {
        **config.get("serving", {}),
        "host": "127.0.0.1",
        "port": port,
        "maxBatchSize": max(args.streams),
    }
    path = workdir / f"config-{mode}.yaml"
    path.write_text(yaml.safe_dump({**config, "speculation": speculation, "serving": serving}))
    env = server_env(os.environ, args.runtime_src)
    log_path = workdir / f"server-{mode}.log"
    command = [sys.executable, "-m", "specpair_runtime", "serve", "--config", str(path)]
    if args.device:
        command += ["--device", args.device]
    if args.cpu_threads is not None:
        command += ["--cpu-threads", str(args.cpu_threads)]
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process, args.ready_timeout)
        # Warm-up: first-call overheads must not land in the measurements.
        asyncio.run(run_level(base_url, mode, 1, 1, args.max_tokens))
        rounds: list[list[LevelResult]] = []
        for round_ in range(args.rounds):
            order = round_order(args.streams, round_)
            rounds.append([measure_level(base_url, mode, n, args) for n in order])
        return rounds
    except Exception:
        print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_level(base_url: str, mode: str, n: int, args: argparse.Namespace) -> LevelResult:
    """One level of ``n`` streams, with the server's step and held-back counters over it."""
    before, held_before = scrape(base_url)
    level = asyncio.run(
        run_level(
            base_url,
            mode,
            n,
            args.requests_per_stream,
            args.max_tokens,
            args.long_prompt_words,
        )
    )
    after, held_after = scrape(base_url)
    level.steps = step_delta(before, after)
    level.held_back_steps = held_after - held_before
    return level


def print_table(levels: list[LevelResult]) -> None:
    header = (
        f"{'mode':<12} {'streams':>7} {'tok/s':>8} {'ttft p50':>9} {'p95':>8} {'p99':>8} "
        f"{'itl p50':>8} {'p95':>8} {'p99':>8} {'tok/chunk':>9}"
    )
    print(header)
    for level in levels:
        s = level.summary()
        t, i = s["ttft_ms"], s["itl_ms"]
        print(
            f"{s['mode']:<12} {s['streams']:>7} {s['tokens_per_s']:>8} {t['p50']:>9} "
            f"{t['p95']:>8} {t['p99']:>8} {i['p50']:>8} {i['p95']:>8} {i['p99']:>8} "
            f"{s['tokens_per_chunk']:>9}"
        )
    print("(latencies in ms; ITL = gap between SSE chunks of one stream)")
    for level in levels:
        print(f"engine steps, {level.mode}, {level.streams} streams: {describe_steps(level.steps)}")
    for level in levels:
        print(f"held-back text, {level.mode}, {level.streams} streams: {describe_held_back(level)}")
    for level in levels:
        if any(r.long_prompt for r in level.results):
            print(f"ttft, {level.mode}, {level.streams} streams: {describe_ttft(level)}")


def describe_ttft(level: LevelResult) -> str:
    """``short prompts p50 2100 / p95 4800 ms (16), long prompts p50 ... (16)``"""
    parts = []
    for label, flag in (("short", False), ("long", True)):
        ttft = [r.ttft for r in level.results if r.long_prompt is flag]
        if ttft:
            t = percentiles(ttft)
            parts.append(f"{label} prompts p50 {t['p50']} / p95 {t['p95']} ms ({len(ttft)})")
    return ", ".join(parts)


def describe_held_back(level: LevelResult) -> str:
    """``11 steps, 0.64 % of 1712 gaps; the p99 is the 18.1th largest gap (...)``.

    Each held-back step makes one gap span two steps or more, about the
    longest gaps there are; the p99 (``percentiles``: inclusive) is the
    ``1 + 0.01 * (gaps - 1)``th largest gap, so with at least that many
    held-back steps it is likely one of those gaps.
    """
    s = level.summary()
    rank = 1 + 0.01 * (s["gaps"] - 1)
    verdict = (
        "so the p99 is likely a held-back gap, two steps or more"
        if s["held_back_steps"] >= rank
        else "the held-back gaps lie above the p99"
    )
    return (
        f"{s['held_back_steps']} steps, {s['held_back_share'] * 100:.2f} % of {s['gaps']} gaps; "
        f"the p99 is the {rank:.1f}th largest gap ({verdict})"
    )


def describe_steps(steps: dict[str, dict[str, float]]) -> str:
    """``decode 412 x 1210 ms, mixed 80 x 1490 ms (1.23x decode), ...``"""
    parts = []
    decode = steps.get("decode", {}).get("mean_ms")
    for kind in ("decode", "mixed", "prefill"):
        if kind not in steps:
            continue
        count, mean_ms = int(steps[kind]["count"]), steps[kind]["mean_ms"]
        part = f"{kind} {count} x {mean_ms:.1f} ms"
        if kind == "mixed" and decode:
            part += f" ({mean_ms / decode:.2f}x decode)"
        parts.append(part)
    return ", ".join(parts) or "none reported"


def goal_ratios(levels: list[LevelResult]) -> dict[str, float]:
    """p99 ITL at the highest concurrency over the single-stream p99, per mode."""
    ratios = {}
    for mode in sorted({level.mode for level in levels}):
        mine = sorted((lv for lv in levels if lv.mode == mode), key=lambda lv: lv.streams)
        single, top = mine[0].summary(), mine[-1].summary()
        if single["streams"] == 1 and single["itl_ms"]["p99"] > 0:
            ratios[mode] = round(top["itl_ms"]["p99"] / single["itl_ms"]["p99"], 2)
    return ratios


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def describe_round(levels: list[LevelResult], mode: str) -> str:
    """``1.28x (487 / 380 ms)``: one round's goal ratio and the two p99s it divides."""
    mine = sorted((lv for lv in levels if lv.mode == mode), key=lambda lv: lv.streams)
    ratio = goal_ratios(mine).get(mode)
    if ratio is None:
        return "-"
    top, single = (lv.summary()["itl_ms"]["p99"] for lv in (mine[-1], mine[0]))
    return f"{ratio}x ({top:.0f} / {single:.0f} ms)"


def parse_streams(text: str) -> list[int]:
    values = sorted({int(part) for part in text.split(",") if part.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="runtime config file of the pair")
    source.add_argument("--tiny", action="store_true", help="build the tiny test pair")
    source.add_argument(
        "--real-pair",
        action="store_true",
        help="the Qwen pair of make models (int4-weight draft on CPU)",
    )
    parser.add_argument(
        "--draft-quantization",
        choices=get_args(Quantization),
        help="with --real-pair: the draft's quantization (default: int4-weight on the CPU)",
    )
    parser.add_argument("--streams", type=parse_streams, default=[1, 8], metavar="N,N")
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        metavar="N",
        help="run the levels N times, interleaved (1, 8, 8, 1, ...); gaps pool over rounds",
    )
    parser.add_argument(
        "--requests-per-stream",
        type=positive_int,
        default=4,  # per round: each round sends the whole load
        metavar="N",
        help="at least N; more when needed for every prompt to be sent equally often",
    )
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--modes", default="speculation,target-only", metavar="M,M")
    parser.add_argument("--device", help="passed to serve --device")
    parser.add_argument(
        "--cpu-threads", type=int, metavar="N", help="passed to serve --cpu-threads"
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, metavar="S")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument(
        "--long-prompt-words",
        type=int,
        default=0,
        metavar="N",
        help="N words of context before every other prompt (long prompts arriving)",
    )
    parser.add_argument(
        "--runtime-src",
        type=Path,
        metavar="DIR",
        help="serve from DIR/runtime (another revision's tree) instead of this checkout",
    )
    args = parser.parse_args()
    if args.draft_quantization is not None and not args.real_pair:
        parser.error("--draft-quantization goes with --real-pair (a --config names its own)")
    if (
        args.runtime_src is not None
        and not (args.runtime_src / "runtime" / "specpair_runtime").is_dir()
    ):
        parser.error(f"--runtime-src: {args.runtime_src}/runtime/specpair_runtime does not exist")

    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        workdir = Path(tmp)
        if args.tiny:
            config = tiny_config(workdir)
        elif args.real_pair:
            config = real_pair_config(args.device, args.draft_quantization)
        else:
            config = yaml.safe_load(args.config.read_text())
        per_round: list[list[LevelResult]] = []  # one list per mode and round
        for mode in args.modes.split(","):
            per_round += bench_mode(config, mode.strip(), args, workdir)
    levels = [
        merge_rounds([lv for rnd in per_round for lv in rnd if (lv.mode, lv.streams) == key])
        for key in dict.fromkeys((lv.mode, lv.streams) for rnd in per_round for lv in rnd)
    ]
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(), **cpu_info()}
    print("machine: " + ", ".join(f"{key}: {value}" for key, value in machine.items()))
    print_table(levels)
    ratios = goal_ratios(levels)
    round_ratios = [goal_ratios(rnd) for rnd in per_round]
    for mode, ratio in ratios.items():
        verdict = "meets" if ratio <= 1.5 else "misses"
        each = ", ".join(
            describe_round(rnd, mode) for rnd in per_round if any(lv.mode == mode for lv in rnd)
        )
        print(
            f"{mode}: p99 ITL at {max(args.streams)} streams = {ratio}x single ({verdict} 1.5x); "
            f"rounds on their own: {each}"
        )
    if args.json:
        payload = {
            "machine": machine,
            "levels": [lv.summary() for lv in levels],
            "rounds": args.rounds,
            "p99_itl_ratio": ratios,
            "p99_itl_ratio_per_round": round_ratios,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
