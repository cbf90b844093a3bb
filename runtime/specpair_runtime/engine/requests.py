"""A request's state inside the engine, and the checks a new request must pass.

A request owns one KV slot for its life. Its committed tokens are the prompt
plus the output; ``target_len`` and ``draft_len`` say how many of them each
model's storage holds. Rolling back a rejected draft is not advancing these
lengths: the stale positions are overwritten by the next forward. Everything
that depends on the output so far (the logits processors) advances on the
committed tokens only, so it rolls back with the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specpair_runtime.engine.api import LogitsProcessor, RequestStats, SamplingParams
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.logprobs import MAX_TOP_LOGPROBS
from specpair_runtime.engine.sampling import is_greedy_temperature
from specpair_runtime.engine.stopping import OutputStream


def validate_params(params: SamplingParams) -> None:
    """Raise ValueError naming the first bad field."""
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (or None), got {params.logprobs}"
        )


def validate_ids(field_name: str, ids: Sequence[int], vocab: int) -> None:
    """Raise ValueError naming ``field_name`` when an id lies outside the target's ids."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{field_name}: token id {bad[0]} is outside [0, {vocab})")


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """Every EOS id the tokenizer, the model config and the generation config name."""
    ids: set[int] = set()
    sources = [
        getattr(loaded.tokenizer, "eos_token_id", None),
        getattr(getattr(loaded.model, "config", None), "eos_token_id", None),
        getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None),
    ]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value if isinstance(v, int))
    return ids


@dataclass
class Request:
    """One request's committed tokens, its slot and its cache lengths."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: OutputStream
    processors: tuple[LogitsProcessor, ...] = ()
    stats: RequestStats = field(default_factory=RequestStats)
    output_ids: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    slot: int = -1
    admitted_step: int = 0  # the engine's step count when it got its slot
    target_len: int = 0  # tokens whose KV is in the target's slot
    draft_len: int = 0  # tokens whose KV is in the draft's slot

    @property
    def sequence_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Committed tokens [start, stop) of prompt + output."""
        prompt = len(self.prompt_ids)
        if stop <= prompt:
            return self.prompt_ids[start:stop]
        if start >= prompt:
            return self.output_ids[start - prompt : stop - prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt]

    @property
    def decoding(self) -> bool:
        """Only the last committed token is missing from the target's cache."""
        return self.target_len == self.sequence_len - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def seed(self) -> int | None:
        """The seed of a sampled request: its tokens follow ``sampling.coupled_tokens``.

        A greedy request draws nothing, so its seed does not matter.
        """
        return None if is_greedy_temperature(self.params.temperature) else self.params.seed
