"""The per-request logits-processing hook: grammar masks, penalties, logit_bias.

The protocol (``api.LogitsProcessor``) has two methods, ``process`` and
``commit``; ``SamplingParams.logits_processors`` holds one factory per
processor, and each request builds its own.

A processor changes a request's logits before temperature, top-k and top-p.
For speculation to stay lossless it must change the draft's proposal logits
and the target's verify logits alike, at every position, with the context
that position really has: verify position ``i`` of a row follows the
committed output plus the row's first ``i`` draft tokens, so a penalty's
counts grow with the drafts a step accepts. So ``process`` gets the proposed
tokens beside the logits of consecutive positions, and derives whatever it
needs from them without keeping it; its state advances only in ``commit``,
with the tokens the target committed. A rejected draft is then rolled back
by never being committed, just as the KV cache rolls back by not advancing
a length.

The engine calls ``process`` only for requests that have processors, so the
default request pays nothing. It reads the proposed tokens on the host: on
CUDA a step with processors gets a device-to-host copy per draft forward and
one before the verify sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpair_runtime.engine.api import LogitsProcessor, SamplingParams


def processors_for(params: SamplingParams) -> tuple[LogitsProcessor, ...]:
    """A new request's processors, one fresh instance per factory in its params."""
    return tuple(factory() for factory in params.logits_processors)


def process_rows(
    logits: torch.Tensor,
    rows: Sequence[tuple[int, int, Sequence[LogitsProcessor], Sequence[int]]],
) -> torch.Tensor:
    """Run each row's processors over its positions of the flat ``logits`` [N, V].

    ``rows``: (first flat position, positions, processors, proposed tokens)
    for the rows that have processors. Returns a new tensor when any row
    changed, so the caller's raw logits (for logprobs) stay as they were.
    """
    if not rows:
        return logits
    out = logits.clone()
    for start, width, processors, proposed in rows:
        part = out[start : start + width]
        for processor in processors:
            part = processor.process(proposed, part)
        out[start : start + width] = part
    return out
