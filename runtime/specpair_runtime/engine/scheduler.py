"""The scheduler: admission, prefix reuse, the token budget and the row plan.

Every running request becomes one row of a step (``Row``). A decoding row
feeds the target ``[last, d1..dn]`` (the drafts are placed by the verify
pass); a prefilling row feeds the next chunk of its prompt. Decoding rows
always run, so running streams never wait for a prompt; prompt chunks fill
what the per-step token budget (``budget.py``) leaves, the prompt with the
fewest tokens left first, aged by the steps it waited (``prefill_order``).
The draft gets a budget of the same size for its catch-up chunks, so it keeps
pace with the target's prefill: with the draft on the plain budget while the
target took the ceiling, a fifth to a half of the decoding rows at 8 streams
on the 1.5B pair could not draft, their drafts dozens of tokens behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specpair_runtime.engine.budget import StepBudget, chunk_size, prefill_order
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.prefix_reuse import (
    Admission,
    SlotContents,
    awaits_prefix,
    plan_admission,
)
from specpair_runtime.engine.requests import Request


@dataclass
class Row:
    """One request's part of a step."""

    request: Request
    target_tokens: list[int]  # fed to the target (the drafts are appended by the verify pass)
    samples: bool  # the target's logits at the end of this chunk pick tokens
    num_draft: int = 0  # drafts planned; the drafter may cut it (the confidence stop)
    draft_tokens: list[int] = field(default_factory=list)  # fed to draft forward 0
    draft_samples: bool = False  # draft forward 0 yields this row's first draft token
    accepted: int = 0  # set at commit


# Copies a slot's first ``length`` positions into another slot, in both models' storage.
PrefixCopy = Callable[[Admission], None]


class Scheduler:
    """Waiting and running requests, the KV slots, and each step's rows."""

    def __init__(self, options: EngineOptions, budget: StepBudget) -> None:
        self.options = options
        self.budget = budget
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self.free_slots = list(range(options.max_slots))
        # What free slots still hold, for prefix reuse (prefix_reuse.py).
        self.retained: dict[int, SlotContents] = {}
        self.steps = 0  # steps planned, for the prefill order's aging

    def find(self, request_id: str) -> Request | None:
        for request in [*self.waiting, *self.running]:
            if request.id == request_id:
                return request
        return None

    def release(self, request: Request, *, draft_cached: bool, keep_contents: bool = True) -> None:
        """Free the request's slot; its committed KV stays there for prefix reuse
        unless ``keep_contents`` is False (a request that failed)."""
        self.running.remove(request)
        self.free_slots.append(request.slot)
        self.free_slots.sort()
        if keep_contents and self.options.prefix_reuse:
            self.retained[request.slot] = contents(request, draft_cached)
        request.slot = -1

    def forget_draft_cache(self) -> None:
        """The draft's storage was freed: no request or free slot holds draft KV."""
        for request in self.running:
            request.draft_len = 0
        self.retained = {slot: SlotContents(kept.tokens, 0) for slot, kept in self.retained.items()}

    def admit(self, draft_cached: bool, copy_prefix: PrefixCopy) -> None:
        """Waiting requests take free slots, first come first served, past any reused prefix.

        A request whose prompt shares a prefix that a running request is still
        reading waits for it, keeping its place (``prefix_reuse.awaits_prefix``).
        """
        self.steps += 1
        deferred: list[Request] = []  # waiting for a prefix another request is reading
        while self.waiting and self.free_slots:
            request = self.waiting.pop(0)
            if self.options.prefix_reuse:
                running = {r.slot: contents(r, draft_cached) for r in self.running}
                admission = plan_admission(
                    request.prompt_ids, self.free_slots, self.retained, running
                )
                reading = [(r.prompt_ids, r.target_len) for r in self.running]
                if awaits_prefix(request.prompt_ids, admission.reused, reading):
                    deferred.append(request)
                    continue
            else:
                admission = Admission(self.free_slots[0], 0, 0)
            self.free_slots.remove(admission.slot)
            self.retained.pop(admission.slot, None)
            if admission.copy_from is not None:
                copy_prefix(admission)
            request.slot = admission.slot
            request.target_len = admission.reused
            request.draft_len = admission.draft_reused if draft_cached else 0
            request.stats.cached_prompt_tokens = admission.reused
            request.admitted_step = self.steps
            self.running.append(request)
        self.waiting[:0] = deferred

    @property
    def decoding_count(self) -> int:
        """Running requests past their prompt (the depth policy's batch size)."""
        return sum(1 for r in self.running if r.decoding)

    def plan_rows(self, depth: int, drafts_read: bool) -> list[Row]:
        """Every running request's tokens for this step, within the token budget.

        ``drafts_read``: the drafts catch up in this step. They do in a step
        that does not speculate only because it reads a prompt
        (``duringPrefill``): speculation then resumes at once when the prompts
        are read.
        """
        rows, left, draft_left = self._decoding_rows(depth)
        rows += self._prefill_chunks(left)
        if drafts_read:
            _catch_up(rows, draft_left)
        rows.sort(key=lambda r: r.request.slot)
        return rows

    def _decoding_rows(self, depth: int) -> tuple[list[Row], int, int]:
        """The decoding rows, and what they leave of the target's and the draft's budgets.

        A row drafts ``min(depth, tokens left - 1)`` tokens when its draft
        can read what it missed within the draft's budget; a row whose draft
        lags further decodes without drafting until it has caught up.
        """
        left = draft_left = self.budget.tokens
        rows: list[Row] = []
        for request in self.running:
            if not request.decoding:
                continue
            last = request.tokens(request.sequence_len - 1, request.sequence_len)
            row = Row(request, last, samples=True)
            if depth > 0:
                wanted = min(depth, request.remaining - 1)
                pending = request.sequence_len - request.draft_len
                if wanted > 0 and pending <= max(draft_left, 1):
                    row.num_draft = wanted
                    row.draft_tokens = request.tokens(request.draft_len, request.sequence_len)
                    row.draft_samples = True
                    draft_left -= pending
            left -= 1 + row.num_draft
            rows.append(row)
        if not rows:  # nothing decodes: nobody waits on this step
            return rows, self.budget.ceiling, self.budget.ceiling
        # An unmeasured budget probes with the floor first (StepBudget.chunk_room).
        return rows, self.budget.chunk_room(left), self.budget.chunk_room(draft_left)

    def _prefill_chunks(self, left: int) -> list[Row]:
        """Prompt chunks within ``left`` tokens; the first gets at least the floor."""
        prefilling = [r for r in self.running if not r.decoding]
        if self.options.prefill_order == "shortest-first":
            order = prefill_order(
                [r.sequence_len - r.target_len for r in prefilling],
                [self.steps - r.admitted_step for r in prefilling],
            )
            prefilling = [prefilling[i] for i in order]
        rows: list[Row] = []
        for request in prefilling:
            pending = request.sequence_len - request.target_len
            size = chunk_size(pending, left, first=not rows)
            if size <= 0:
                continue
            left -= size
            start = request.target_len
            rows.append(Row(request, request.tokens(start, start + size), size == pending))
        return rows


def contents(request: Request, draft_cached: bool) -> SlotContents:
    """The committed tokens whose KV the request's slot holds."""
    tokens = tuple(request.tokens(0, request.target_len))
    draft_len = request.draft_len if draft_cached else 0
    return SlotContents(tokens, min(draft_len, len(tokens)))


def _catch_up(rows: list[Row], left: int) -> None:
    """Drafts of rows that do not draft now read what they missed, in budgeted chunks.

    A request with one token left never drafts again: its last token comes
    from the target alone, so a catch-up would be wasted.
    """
    first = True
    for row in rows:
        request = row.request
        if row.draft_samples or request.remaining <= 1:
            continue
        lag = request.sequence_len - 1 - request.draft_len
        size = chunk_size(lag, left, first)
        if size > 0:
            first = False
            row.draft_tokens = request.tokens(request.draft_len, request.draft_len + size)
            left -= size
