"""``make run``: stream a coding answer from the real pair and show the speedup.

Loads the Qwen2.5-Coder 1.5B target and 0.5B draft that ``make models`` put in
the cache. The pair is made for code, so the main line is a coding prompt: its
speculative completion streams to the terminal (only verified text ever
reaches it), then the same prompt is decoded target-only for the speedup. A
support-chat prompt follows as a second, honest line: prose the coder draft
guesses less well. On a CPU the 1.5B target makes a few tokens a second, so
the demo keeps the answers short; on CUDA it decodes more.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads sleep when idle but spin briefly between ops (before torch loads).
os.environ.update(openmp_defaults(os.environ))

# The repo root, so `tools.fetch_models` imports when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from tools.fetch_models import cached_pair_or_report

PROMPT = (
    "Write a Python function is_palindrome(text) that ignores case, spaces and "
    "punctuation. Include a docstring with two doctest examples."
)
SYSTEM = "You are a helpful coding assistant. Answer with code."
SUPPORT_PROMPT = (
    "Hi, I ordered a blue backpack (order #4417) ten days ago and it still has not "
    "arrived. The tracking page has not changed since Monday. What can you do?"
)
SUPPORT_SYSTEM = "You are a friendly, concise customer-support assistant for an online shop."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: 24 CPU, 128 CUDA"
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="a fixed draft depth (default: the default knobs)"
    )
    parser.add_argument("--prompt", default=PROMPT, help="the coding request")
    parser.add_argument(
        "--no-support", action="store_true", help="skip the support-chat comparison line"
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.depth is not None and args.depth < 1:
        parser.error("--depth must be >= 1")
    return args


@dataclass(frozen=True)
class Comparison:
    kind: str
    spec_tokens: int
    spec_seconds: float
    base_tokens: int
    base_seconds: float
    acceptance: float
    tokens_per_pass: float
    identical: bool

    @property
    def speedup(self) -> float:
        return (self.spec_tokens / self.spec_seconds) / (self.base_tokens / self.base_seconds)

    def line(self) -> str:
        return (
            f"{self.kind:<8} speculative {self.spec_tokens / self.spec_seconds:5.2f} tok/s, "
            f"target-only {self.base_tokens / self.base_seconds:5.2f} tok/s, "
            f"speedup {self.speedup:.2f}x, acceptance {self.acceptance:.0%}, "
            f"{self.tokens_per_pass:.2f} tokens per target pass, "
            f"identical greedy output: {'yes' if self.identical else 'NO'}"
        )


def compare(
    pair: Any,
    kind: str,
    prompt_ids: list[int],
    max_new: int,
    knobs: Any,
    on_text: Callable[[str], None] | None,
) -> Comparison:
    """Decode ``prompt_ids`` speculatively (streamed to ``on_text``), then target-only."""
    from specpair_runtime.engine.api import SamplingParams
    from specpair_runtime.engine.oneshot import run_request
    from specpair_runtime.engine.options import EngineOptions

    params = SamplingParams(max_new_tokens=max_new)
    options = EngineOptions(max_slots=1, max_length=len(prompt_ids) + max_new)
    # Build both engines before timing: the first one prepares the CPU kernels
    # (oneDNN weight layout) in place, which neither run should pay for.
    speculative = pair.engine(knobs=knobs, options=options)
    target_only = pair.engine(speculate=False, options=options)
    start = time.perf_counter()
    spec = run_request(speculative, prompt_ids, params, on_text=on_text)
    spec_seconds = time.perf_counter() - start
    start = time.perf_counter()
    base = run_request(target_only, prompt_ids, params)
    base_seconds = time.perf_counter() - start
    return Comparison(
        kind,
        len(spec.token_ids),
        spec_seconds,
        len(base.token_ids),
        base_seconds,
        spec.stats.acceptance_rate,
        spec.stats.mean_accepted_length,
        spec.token_ids == base.token_ids,
    )


def chat_ids(tokenizer: Any, system: str, prompt: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dirs = cached_pair_or_report()
    if dirs is None:
        return 2

    # Heavy imports after the argument check, behind a progress bar.
    with tqdm(total=3, desc="loading", unit="step", file=sys.stderr) as bar:
        import torch

        from specpair_runtime.config import (
            ModelSpec,
            SpeculationKnobs,
            recommended_draft_quantization,
        )
        from specpair_runtime.engine.pair import load_pair

        bar.update(1)
        on_cuda = torch.cuda.is_available()
        draft_spec = ModelSpec(
            source=str(dirs["draft"]),
            # A cheap draft is what makes speculation pay on a CPU; the target is untouched.
            quantization=recommended_draft_quantization("cuda" if on_cuda else "cpu"),
        )
        knobs = (
            SpeculationKnobs()
            if args.depth is None
            else SpeculationKnobs(max_depth=args.depth, min_depth=args.depth, adaptive=False)
        )
        bar.set_postfix_str("target 1.5B")
        pair = load_pair(ModelSpec(source=str(dirs["target"])), draft_spec, knobs)
        bar.update(2)

    if pair.speculation_refused:
        print(f"note: speculation refused: {pair.speculation_refused}")
    max_new = args.max_new_tokens or (128 if on_cuda else 48)
    if not on_cuda:
        print(
            f"CPU only: the 1.5B target makes a few tokens/s here, so the demo decodes "
            f"{max_new} tokens per answer (use --max-new-tokens for more)."
        )
    tokenizer = pair.target.tokenizer
    print(f"\nuser: {args.prompt}\n\nassistant (speculative, streamed):\n", end="", flush=True)
    results = [
        compare(
            pair,
            "coding",
            chat_ids(tokenizer, SYSTEM, args.prompt),
            max_new,
            knobs,
            lambda t: print(t, end="", flush=True),
        )
    ]
    print("\n\ndecoded again target-only for the comparison.", flush=True)
    if not args.no_support:
        print("now a support-chat prompt (prose: the coder draft agrees less) ...", flush=True)
        support_ids = chat_ids(tokenizer, SUPPORT_SYSTEM, SUPPORT_PROMPT)
        results.append(compare(pair, "support", support_ids, max_new, knobs, None))
    print()
    for result in results:
        print(result.line())
    return 0 if all(r.identical for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
