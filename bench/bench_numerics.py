"""How far apart are the target's logits along different kernel shapes?

Calibrates the golden check's near-tie margin (docs/architecture.md, "Golden
check"). For each prompt the real target (``make models``) decodes greedily
with 1-token steps over a cache; then the same tokens are scored by one full
forward and by 5-token chunks over a cache (the shape of a depth-4 verify).
It prints, per prompt, one JSON line: the largest logit differences between
those paths, how many greedy tokens flip, and the smallest top-2 margins.
Plain transformers forwards, none of the engine's code.

    .venv/bin/python bench/bench_numerics.py [--device cuda] [--dtype bfloat16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from specpair_runtime.openmp import openmp_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads sleep when idle but spin briefly between ops (before torch loads).
os.environ.update(openmp_defaults(os.environ))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tools.fetch_models import cached_pair_or_report

PROMPTS = (
    "Write a Python function that returns the sum of a list.",
    "My order has not arrived yet. What should I do?",
)
CHUNK = 5


def step_logits(model: Any, prompt: list[int], tokens: int, device: str) -> tuple[Any, list[int]]:
    """Greedy decode with 1-token steps; the logits of each step and the tokens."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache)
    rows = [out.logits[0, -1].float()]
    generated = [int(rows[-1].argmax())]
    for _ in range(tokens - 1):
        ids = torch.tensor([[generated[-1]]], device=device)
        out = model(input_ids=ids, past_key_values=cache)
        rows.append(out.logits[0, -1].float())
        generated.append(int(rows[-1].argmax()))
    return torch.stack(rows), generated


def chunk_logits(model: Any, prompt: list[int], generated: list[int], device: str) -> Any:
    """The same positions scored ``CHUNK`` tokens at a time over a cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt], device=device), past_key_values=cache)
    rows = [out.logits[0, -1].float()]
    for start in range(0, len(generated) - 1, CHUNK):
        piece = generated[start : min(start + CHUNK, len(generated) - 1)]
        out = model(input_ids=torch.tensor([piece], device=device), past_key_values=cache)
        rows.extend(out.logits[0].float())
    return torch.stack(rows[: len(generated)])


def measure(model: Any, tokenizer: Any, text: str, tokens: int, device: str) -> dict[str, object]:
    messages = [{"role": "user", "content": text}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    started = time.perf_counter()
    with torch.inference_mode():
        step, generated = step_logits(model, prompt, tokens, device)
        full_ids = torch.tensor([prompt + generated], device=device)
        full = model(input_ids=full_ids, use_cache=False).logits[0].float()
        full = full[len(prompt) - 1 : len(prompt) - 1 + tokens]
        chunk = chunk_logits(model, prompt, generated, device)
    top2 = torch.topk(full, 2).values
    margins = top2[:, 0] - top2[:, 1]
    return {
        "prompt": text,
        "tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1),
        "max_abs_diff_step_vs_full": float((step - full).abs().max()),
        f"max_abs_diff_step_vs_chunk{CHUNK}": float((step - chunk).abs().max()),
        "greedy_flips_full": int((full.argmax(-1) != step.argmax(-1)).sum()),
        f"greedy_flips_chunk{CHUNK}": int((chunk.argmax(-1) != step.argmax(-1)).sum()),
        "smallest_top2_margins": [round(float(m), 4) for m in margins.sort().values[:3]],
        "median_top_logit": float(full.max(-1).values.median()),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    dirs = cached_pair_or_report()
    if dirs is None:
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = dirs["target"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    for text in PROMPTS:
        record = measure(model, tokenizer, text, args.tokens, args.device)
        print(json.dumps({"device": args.device, "dtype": args.dtype, **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
