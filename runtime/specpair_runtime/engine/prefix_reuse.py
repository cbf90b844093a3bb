"""Prefix reuse: a new request starts after the longest prefix of its prompt that a slot holds.

A slot's keys and values stay in the fixed storage after its request leaves
(``kvcache.py`` never clears or moves them), and the position of a token's KV
is its index in the sequence. So a new prompt that begins with tokens a slot
still holds (a deployment's system prompt, the earlier turns of a chat) need
not be read again: the request takes that slot, and its lengths start past
the shared prefix. This is vLLM's automatic prefix caching, on slots instead
of hashed blocks.

- A free slot remembers the committed tokens its last request left in the
  target's storage, and how many of them the draft's storage holds
  (``SlotContents``). A request that failed leaves nothing to reuse.
- At admission (``plan_admission``, pure) the longest match among free
  slots and running requests is the source. A free source that holds
  little past the match is taken as it is; otherwise the match is copied
  into the free slot that holds the fewest tokens, so a slot holding a
  longer conversation is kept for its next turn. One copy per model per
  admission, never one per step.
- A request waits (``awaits_prefix``) while a running request is still
  reading at least ``MIN_AWAITED_PREFIX`` more tokens of a prefix they share
  than any slot holds now: the ``n`` choices of one prompt, or the same
  prompt sent twice at once, read it once, the others start past it as soon
  as it is in the cache, instead of each reading it beside the first.
- At most ``len(prompt) - 2`` tokens are reused. The last prompt token is
  always computed, since its logits give the first output token, and it
  enters in a prompt chunk of at least two tokens, as without reuse: with
  only it left, the request would start as a decoding row, draft, and
  sample its first token through a verify, so a seeded request would draw
  other random numbers than it does when it reads its prompt in full.

The reused keys and values are the bits a fresh prefill would write: the
engine's kernels give a token's KV the same bits whatever else shares the
forward (``cpu_kernels.py``), which greedy identity with target-only decoding
already rests on. On CUDA they agree up to floating-point numerics, as every
chunking of a prompt does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotContents:
    """What a slot's storage holds: KV of ``tokens`` at positions 0..len - 1."""

    tokens: tuple[int, ...]  # in the target's storage
    draft_len: int  # the first draft_len of them are in the draft's storage too

    def __post_init__(self) -> None:
        if not 0 <= self.draft_len <= len(self.tokens):
            raise ValueError(f"draft_len {self.draft_len} is outside [0, {len(self.tokens)}]")


@dataclass(frozen=True)
class Admission:
    """Where a new request goes, and how much of its prompt it need not read."""

    slot: int
    reused: int  # leading prompt tokens whose target KV the slot holds (after any copy)
    draft_reused: int  # of those, in the draft's storage
    copy_from: int | None = None  # the slot to copy positions [0, reused) from (running or free)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


# Shared prompt tokens still being read elsewhere that make a new request wait for them.
MIN_AWAITED_PREFIX = 16


def awaits_prefix(
    prompt: Sequence[int],
    available: int,
    reading: Sequence[tuple[Sequence[int], int]],
) -> bool:
    """Whether a new request should wait for a prefix that a running request is reading.

    ``available``: the prefix the request could reuse now (``plan_admission``'s
    ``reused``). ``reading``: each running request's prompt and the tokens of
    it whose KV it has computed.
    """
    limit = max(len(prompt) - 2, 0)
    for other, computed in reading:
        shared = min(common_prefix_length(prompt, other), limit)
        if computed < shared and shared - available >= MIN_AWAITED_PREFIX:
            return True
    return False


def _match(prompt: Sequence[int], contents: SlotContents, limit: int) -> tuple[int, int]:
    """(target tokens, draft tokens) of ``contents`` that ``prompt`` can reuse."""
    shared = min(common_prefix_length(prompt, contents.tokens), limit)
    return shared, min(shared, contents.draft_len)


def plan_admission(
    prompt: Sequence[int],
    free_slots: Sequence[int],
    retained: Mapping[int, SlotContents],
    running: Mapping[int, SlotContents],
) -> Admission:
    """The slot for a new request with ``prompt``, and the prefix it reuses.

    ``free_slots``: at least one. ``retained``: what free slots still hold.
    ``running``: the committed, cached tokens of running requests, by slot.

    The longest match anywhere is the source (a free slot before a running
    one, then the lowest). The request overwrites what a slot holds past the
    reused prefix, so it takes the source itself only where that loses no
    more than the free slot holding the fewest tokens would (that slot, the
    lowest first, is also where a request without any match goes);
    otherwise the prefix is copied there. So a chat whose earlier turns a
    slot holds is not overwritten by a request that shares only its system
    prompt.
    """
    if not free_slots:
        raise ValueError("plan_admission needs a free slot")
    limit = max(len(prompt) - 2, 0)
    empty = SlotContents((), 0)
    free = set(free_slots)
    best: tuple[int, int, int] | None = None  # reused, draft reused, slot
    for slot, contents in [*((s, retained.get(s, empty)) for s in free_slots), *running.items()]:
        reused, draft_reused = _match(prompt, contents, limit)
        if reused > (best[0] if best else 0):
            best = (reused, draft_reused, slot)
    least = min(free_slots, key=lambda s: (len(retained.get(s, empty).tokens), s))
    if best is None:
        return Admission(least, 0, 0)
    reused, draft_reused, source = best
    if source in free:
        lost_at_source = len(retained.get(source, empty).tokens) - reused
        if source == least or lost_at_source <= len(retained.get(least, empty).tokens):
            return Admission(source, reused, draft_reused)
    return Admission(least, reused, draft_reused, copy_from=source)
