"""Time to first token with and without prefix reuse: chat turns under one long system prompt.

A deployment's requests usually share a system prompt (instructions, a
product's documentation), and a chat's next turn repeats every turn before
it. With ``serving.prefixReuse`` the engine skips the prefix a KV slot still
holds (``engine/prefix_reuse.py``); this measures what that saves on the real
pair. Two engines over the same loaded models, one with reuse and one
without, one slot each (a request at a time, as one stream sees it). In each
round both first answer an untimed priming question under the system
prompt, then the same ``--questions`` one after the other; per question the
time to its first token and to its last is taken. The engines alternate
within a round, so a slow spell of the machine hits both. Ratios (without
reuse over with) are computed within a round; the table shows their median
and [min-max] over the rounds, and the median seconds. Greedy output must
be the same with and without reuse (it is checked and printed).

    .venv/bin/python bench/bench_prefix_reuse.py [--system-words 300] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads sleep when idle but spin briefly between ops (before torch loads).
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.fetch_models import cached_pair_or_report

SYSTEM_TEXT = (
    "You are the support assistant of a shoe shop. Orders ship within two working days. "
    "Returns are free within thirty days if the shoes are unworn and in their box. "
    "Refunds reach the original payment method within five working days of the return. "
    "A delivery address can be changed until the parcel leaves the warehouse. "
)
PRIMING = "Hello, I have a question about my order."
QUESTIONS = (
    "How long does a refund take?",
    "Can I still change my delivery address?",
    "Can I return shoes that I wore once?",
)


@dataclass
class Timing:
    """One question's time to first token and to its last, in seconds."""

    first: float
    total: float
    tokens: list[int] = field(default_factory=list)
    cached: int = 0


def system_prompt(words: int) -> str:
    """``words`` words of the shop's instructions, repeated as needed."""
    vocabulary = SYSTEM_TEXT.split()
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words))


def timed_request(engine: Any, prompt: list[int], max_new_tokens: int) -> Timing:
    from specpair_runtime.engine.api import SamplingParams

    request_id = f"q-{time.monotonic_ns()}"
    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens))
    timing = Timing(first=0.0, total=0.0)
    finished = False
    while not finished:
        for event in engine.step():
            if event.request_id != request_id:
                continue
            if event.token_ids and not timing.tokens:
                timing.first = time.perf_counter() - started
            timing.tokens += event.token_ids
            timing.cached += event.cached_prompt_tokens
            finished = finished or event.finished
    timing.total = time.perf_counter() - started
    return timing


def ratio_cell(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--system-words", type=int, default=300, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    args = parser.parse_args(argv)
    for name in ("system_words", "rounds", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    dirs = cached_pair_or_report()
    if dirs is None:
        return 2
    import torch

    from specpair_runtime.config import ModelSpec, SpeculationKnobs, recommended_draft_quantization
    from specpair_runtime.engine.options import EngineOptions
    from specpair_runtime.engine.pair import load_pair
    from specpair_runtime.server.prompts import encode_chat

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pair = load_pair(
        ModelSpec(source=str(dirs["target"])),
        ModelSpec(source=str(dirs["draft"]), quantization=recommended_draft_quantization(device)),
        SpeculationKnobs(),
        device,
    )
    tokenizer = pair.target.tokenizer
    system = system_prompt(args.system_words)
    # As the server's chat endpoint encodes a system and a user message.
    priming = encode_chat(tokenizer, [("system", system), ("user", PRIMING)])
    prompts = [encode_chat(tokenizer, [("system", system), ("user", q)]) for q in QUESTIONS]
    length = max(len(p) for p in [priming, *prompts]) + args.max_new_tokens
    engines = {
        reuse: pair.engine(
            options=EngineOptions(max_slots=1, max_length=length, prefix_reuse=reuse)
        )
        for reuse in (True, False)
    }
    print(
        f"device {device}, torch threads {torch.get_num_threads()}; system prompt "
        f"{args.system_words} words, prompts of {[len(p) for p in prompts]} tokens, "
        f"{args.max_new_tokens} new tokens, greedy, {args.rounds} rounds",
        flush=True,
    )
    rows: dict[bool, list[list[Timing]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        for reuse in order:
            timed_request(engines[reuse], priming, 2)  # untimed: leaves the system prompt
        per_question: dict[bool, list[Timing]] = {True: [], False: []}
        for prompt in prompts:
            for reuse in order:
                per_question[reuse].append(
                    timed_request(engines[reuse], prompt, args.max_new_tokens)
                )
        for reuse in (True, False):
            rows[reuse].append(per_question[reuse])
    identical = all(
        a.tokens == b.tokens
        for with_reuse, without in zip(rows[True], rows[False], strict=True)
        for a, b in zip(with_reuse, without, strict=True)
    )
    report: list[dict[str, Any]] = []
    print(f"{'question':42s} cached  TTFT with / without (s)  TTFT ratio          total ratio")
    for index, question in enumerate(QUESTIONS):
        on = [r[index] for r in rows[True]]
        off = [r[index] for r in rows[False]]
        first_ratio = [b.first / a.first for a, b in zip(on, off, strict=True)]
        total_ratio = [b.total / a.total for a, b in zip(on, off, strict=True)]
        first_on = statistics.median(t.first for t in on)
        first_off = statistics.median(t.first for t in off)
        print(
            f"{question:42s} {on[0].cached:6d}  {first_on:8.2f} / {first_off:8.2f}"
            f"          {ratio_cell(first_ratio):18s}  {ratio_cell(total_ratio)}"
        )
        report.append(
            {
                "question": question,
                "prompt_tokens": len(prompts[index]),
                "cached_tokens": on[0].cached,
                "ttft_seconds_with_reuse": first_on,
                "ttft_seconds_without_reuse": first_off,
                "ttft_ratio_per_round": first_ratio,
                "total_ratio_per_round": total_ratio,
            }
        )
    print(f"greedy output identical with and without reuse: {'yes' if identical else 'NO'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"identical": identical, "questions": report}, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
