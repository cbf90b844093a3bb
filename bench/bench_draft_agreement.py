"""How often the draft's top token is the target's greedy token, per draft quantization.

A quantized draft is cheaper per forward, but it pays only while the target
still accepts its tokens. This measures the agreement that acceptance rests
on, without timing anything: for each prompt (``make bench``'s three, with
the chat template) the target decodes ``--max-new-tokens`` greedily; then each
draft variant reads the prompt in one forward and the target's tokens one at
a time, as a draft decodes (for ``int4-weight`` that is the int4 kernel),
and the share of positions where its argmax is the target's next token is
printed per prompt. ``--one-forward`` reads prompt and continuation in one
forward instead, as a draft sees many rows at once (a prompt chunk, a batch
of streams): ``int8-dynamic`` then shares one activation scale across them.

    .venv/bin/python bench/bench_draft_agreement.py \
        [--quantizations none,int8-dynamic,int4-weight] [--max-new-tokens 64] [--one-forward]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tools.fetch_models import cached_pair_or_report

from specpair_runtime.config import Quantization


def parse_quantizations(text: str) -> list[Quantization]:
    """``--quantizations``: comma-separated names out of the runtime's choices."""
    known: tuple[Quantization, ...] = get_args(Quantization)
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected names out of {', '.join(known)}, got {text!r}")
    return [name for name in known if name in names]


def target_greedy(target: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy continuation of ``prompt`` (stops early at its end of text)."""
    ids = torch.tensor([prompt])
    out = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    return [int(token) for token in out[0, len(prompt) :]]


@dataclass(frozen=True)
class DraftPosition:
    """The draft at one position of the target's continuation, given every token before it."""

    agrees: bool  # its argmax is the target's greedy token
    confidence: float  # the probability it gives its argmax
    second_agrees: bool = False  # its second most likely token is the target's token


def draft_trace(draft: Any, prompt: list[int], continuation: list[int]) -> list[DraftPosition]:
    """``draft`` reads ``prompt``, then ``continuation`` one token at a time, as it decodes."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = draft(torch.tensor([prompt]), cache=cache, use_cache=True)
    positions = []
    for token in continuation:
        probs = out.logits[0, -1].float().softmax(-1)
        top = probs.topk(2)
        best, second = (int(i) for i in top.indices)
        positions.append(DraftPosition(best == token, float(top.values[0]), second == token))
        out = draft(torch.tensor([[token]]), cache=cache, use_cache=True)
    return positions


def trace_agreement(trace: Sequence[DraftPosition]) -> float:
    """Share of the trace's positions where the draft's argmax is the target's token."""
    return sum(p.agrees for p in trace) / len(trace)


def agreement(draft: Any, prompt: list[int], continuation: list[int]) -> float:
    """Share of ``continuation``'s tokens that are ``draft``'s argmax given all before them."""
    return trace_agreement(draft_trace(draft, prompt, continuation))


def agreement_in_one_forward(draft: Any, prompt: list[int], continuation: list[int]) -> float:
    """``agreement`` with prompt and continuation read in one forward (teacher forcing)."""
    logits = draft(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 : -1]
    return float((logits.argmax(-1) == torch.tensor(continuation)).float().mean())


def agreement_table(
    target: Any,
    drafts: Mapping[str, Any],
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    one_forward: bool = False,
) -> dict[str, list[float]]:
    """Draft name -> agreement per prompt, against the target's greedy continuations."""
    measure = agreement_in_one_forward if one_forward else agreement
    with torch.inference_mode():
        continuations = [target_greedy(target, p, max_new_tokens) for p in prompts]
        return {
            name: [measure(draft, p, c) for p, c in zip(prompts, continuations, strict=True)]
            for name, draft in drafts.items()
        }


def format_table(table: Mapping[str, Sequence[float]]) -> str:
    width = max(len(name) for name in table)
    count = len(next(iter(table.values())))
    header = " ".join(f"prompt {i + 1:d}" for i in range(count))
    lines = [f"{'draft':{width}s}  {header}  median", "-" * (width + 10 * count + 10)]
    for name, values in table.items():
        cells = " ".join(f"{v:8.3f}" for v in values)
        lines.append(f"{name:{width}s}  {cells}  {statistics.median(values):6.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quantizations",
        type=parse_quantizations,
        default=list(get_args(Quantization)),
        metavar="Q,Q",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    parser.add_argument(
        "--one-forward", action="store_true", help="read each continuation in one forward"
    )
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    dirs = cached_pair_or_report()
    if dirs is None:
        return 2
    from bench.engine_harness import DEFAULT_PROMPTS

    from specpair_runtime.config import ModelSpec
    from specpair_runtime.engine.loading import load_model
    from specpair_runtime.engine.prompting import encode_prompt

    target = load_model(ModelSpec(source=str(dirs["target"])), "target", "cpu")
    prompts = [encode_prompt(target.tokenizer, text, chat=True) for text in DEFAULT_PROMPTS]
    drafts = {
        name: load_model(ModelSpec(source=str(dirs["draft"]), quantization=name), "draft", "cpu")
        for name in args.quantizations
    }
    table = agreement_table(
        target.model,
        {n: d.model for n, d in drafts.items()},
        prompts,
        args.max_new_tokens,
        one_forward=args.one_forward,
    )
    how = "in one forward" if args.one_forward else "one token at a time"
    print(f"top-1 agreement with the target's greedy token, {args.max_new_tokens} tokens, {how}")
    print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
