"""The speculative decoding engine: one ragged forward per model per step, lossless.

``SpeculativeEngine.step`` runs one round for every running request; each
role is a module of its own:

1. ``scheduler.py`` admits waiting requests into free KV slots (past any
   prefix a slot still holds) and plans the step's rows within the token
   budget.
2. ``depth.py`` picks one draft depth for the step (0: target-only).
3. ``drafter.py`` runs the draft: one flat forward that feeds every row what
   its draft has not seen, then one token per row that still drafts.
4. ``verifier.py`` runs the target: ONE flat forward over every row's tokens.
5. ``sampler.py`` accepts, recovers and adds bonus tokens over the flat
   batch (``sampling.py``), and reads the results in one host sync.
6. ``commit.py`` advances each request over its committed tokens only (a
   rejected draft is rolled back by not advancing); finished requests free
   their slots.

Target-only decoding runs through the same forwards and the same kernels, so
on the CPU greedy speculative output equals greedy target-only output token
for token (on CUDA, up to floating-point numerics: see the golden check).

Seeds: a sampled request with a seed takes at each output position the
Gumbel-max token of the target's processed distribution under noise keyed
by (seed, position), and its draft proposes with the same noise
(``sampling.coupled_tokens``), so its output depends on the seed and the
target alone: the same whatever the depth, the batch or the timing. Other
requests share batched draws from torch's global generator
(``torch.manual_seed`` makes runs repeatable).

Single-threaded: call ``add_request``/``abort``/``step`` from one thread.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import FinishReason, RequestStats, SamplingParams, StepEvent
from specpair_runtime.engine.budget import StepTiming, draft_catch_up
from specpair_runtime.engine.commit import advance_prefill, commit_row
from specpair_runtime.engine.depth import PREFILL, DepthController, StepOutcome
from specpair_runtime.engine.drafter import Drafter, Proposal
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.logits_processors import processors_for
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.prefix_reuse import Admission
from specpair_runtime.engine.requests import (
    Request,
    eos_token_ids,
    validate_ids,
    validate_params,
)
from specpair_runtime.engine.runner import ModelRunner
from specpair_runtime.engine.sampler import RowResult, sample
from specpair_runtime.engine.sampling import FlatLayout
from specpair_runtime.engine.scheduler import Row, Scheduler
from specpair_runtime.engine.step_timer import StepTimer
from specpair_runtime.engine.stopping import OutputStream
from specpair_runtime.engine.verifier import verify

__all__ = ["GenerationResult", "SpeculativeEngine", "eos_token_ids", "generate"]

KEEP_FINISHED_STATS = 4096
MEMORY_PRESSURE = "memory_pressure"


@dataclass(frozen=True)
class _StepWork:
    """What a step carries besides decoding, for the budget and the step histogram."""

    decoding: int  # rows past their prompt
    prompt_tokens: int  # the target's prompt chunks
    catch_up: int  # the drafts' catch-up tokens (``draft_catch_up``)

    @staticmethod
    def of(rows: list[Row]) -> _StepWork:
        return _StepWork(
            sum(1 for r in rows if r.request.decoding),
            sum(len(r.target_tokens) for r in rows if not r.request.decoding),
            sum(draft_catch_up(len(r.draft_tokens), r.draft_samples) for r in rows),
        )


class SpeculativeEngine:
    """Implements ``specpair_runtime.engine.api.Engine``.

    ``draft=None`` (or ``speculation_refused``) gives target-only decoding
    through the same code path. The models come as the loader left them
    (``loading.py``: fused projections, the CPU's kernels, the draft's
    quantization); the engine never rewrites them.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        knobs: SpeculationKnobs,
        *,
        speculation_refused: str | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        if draft is not None and draft.device != target.device:
            raise ValueError(
                f"draft device {draft.device} differs from target device {target.device}: "
                "the pair is never split across devices"
            )
        self.options = options or EngineOptions()
        runner = functools.partial(
            ModelRunner,
            slots=self.options.max_slots,
            max_length=self.options.max_length,
            cuda_graphs=self.options.cuda_graphs,
            compile_graphs=self.options.cuda_graph_compile,
        )
        self.target = runner(target)
        self.draft = runner(draft) if draft is not None else None
        self.drafter = Drafter(self.draft, self.target.vocab) if self.draft is not None else None
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.budget = self.options.step_budget(self.device)
        self.scheduler = Scheduler(self.options, self.budget)
        self.knobs = knobs
        self.refused = speculation_refused
        self.controller = DepthController(knobs, self.device.type)
        self.eos_ids = eos_token_ids(target)
        self._paused: str | None = None
        self._floor_reason: str | None = None
        self._done: OrderedDict[str, RequestStats] = OrderedDict()
        # Target-only steps by reason: no_draft, refused, disabled, a pause reason,
        # acceptance_floor, batch_size, probe (cost measurement), not_paying, prefill
        # (a step that reads a prompt chunk, with ``duringPrefill`` off).
        self.fallback_counts: dict[str, int] = {}
        self.last_step_depth = 0
        # The last step's time, for the server's step histogram; None when step() ran nothing.
        self.last_step: StepTiming | None = None

    # ---- the Engine protocol -------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        validate_ids("prompt_ids", prompt_ids, self.target.vocab)
        validate_params(params)
        validate_ids("stop_token_ids", params.stop_token_ids, self.target.vocab)
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.options.max_length:
            raise ValueError(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} exceeds the engine's max length "
                f"{self.options.max_length}"
            )
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = OutputStream(
            self.tokenizer,
            prompt_ids,
            eos_ids=(set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids),
            stop=params.stop,
            max_new_tokens=params.max_new_tokens,
        )
        request = Request(request_id, list(prompt_ids), params, stream, processors_for(params))
        self._done.pop(request_id, None)
        self.scheduler.waiting.append(request)

    def abort(self, request_id: str) -> None:
        request = self.scheduler.find(request_id)
        if request is None:
            return
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
            self._finish_stats(request)
        else:
            self._finish(request)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def stats(self, request_id: str) -> RequestStats:
        request = self.scheduler.find(request_id)
        if request is not None:
            return request.stats
        if request_id in self._done:
            return self._done[request_id]
        raise KeyError(f"unknown request id {request_id!r}")

    def update_knobs(self, knobs: SpeculationKnobs) -> None:
        self.knobs = knobs
        self.controller.update_knobs(knobs)
        self._floor_reason = None

    def set_speculation_paused(self, reason: str | None) -> None:
        self._paused = reason
        if reason == MEMORY_PRESSURE and self.draft is not None and self.draft.storage is not None:
            self.draft.free()  # reallocated, and caught up in chunks, on resume
            self.scheduler.forget_draft_cache()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def step(self) -> list[StepEvent]:
        """One round for every running request: plan, draft, verify, sample, commit."""
        self.last_step = None
        with torch.inference_mode():
            self.scheduler.admit(self.draft_storage_allocated, self._copy_prefix)
            if not self.scheduler.running:
                return []
            depth, reason, bar = self._plan_depth()
            rows = self.scheduler.plan_rows(depth, drafts_read=depth > 0 or reason == PREFILL)
            self._count_fallback(rows, depth, reason)
            work = _StepWork.of(rows)
            timer = StepTimer(self.device)
            proposal = self._propose(rows, depth, bar)
            timer.mark()  # the draft is done
            self.last_step_depth = max((r.num_draft for r in rows), default=0)  # after any cut
            sampling = [r for r in rows if r.samples]
            logits = verify(self.target, rows, proposal)
            results: list[RowResult] = []
            if logits is not None:
                layout = FlatLayout.of([r.num_draft for r in sampling])
                results = sample(sampling, layout, logits, proposal)
            events = [
                self._commit(row, result) for row, result in zip(sampling, results, strict=True)
            ]
            for row in rows:
                if not row.samples:
                    advance_prefill(row)
            self._record(rows, depth, reason, work, timer)
            return events

    # ---- speculation state ------------------------------------------------------

    def confidence_threshold(self) -> float:
        """The confidence stop's bar (``depth.py``, rule 3; 0 = off)."""
        return self.controller.confidence()

    @property
    def speculation_active(self) -> bool:
        return self.speculation_off_reason is None

    @property
    def speculation_off_reason(self) -> str | None:
        """Why speculation is off right now (None when it is on)."""
        off = self._off()
        return off[0] if off is not None else None

    def _off(self) -> tuple[str, str] | None:
        """Why speculation is off, and its short label (``fallback_counts``), or None."""
        if self.draft is None:
            return self.refused or "no draft model", "no_draft"
        if self.refused is not None:
            return self.refused, "refused"
        if not self.knobs.enabled:
            return "disabled by knobs", "disabled"
        if self._paused is not None:
            return self._paused, self._paused
        if self._floor_reason is not None:
            return self._floor_reason, "acceptance_floor"
        return None

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def step_tokens(self) -> int:
        """The current per-step token budget (fixed, or as measured so far)."""
        return self.budget.tokens

    @property
    def draft_storage_allocated(self) -> bool:
        return self.draft is not None and self.draft.storage is not None

    def warm_up_graphs(self) -> int:
        """Record every graph step shape of both models (``graphs.py``); returns how many.

        0 where no model runs graph steps (the CPU, or ``cuda_graphs`` off).
        Under ``inference_mode`` as ``step`` runs, since the compiled code is
        guarded on it.
        """
        with torch.inference_mode():
            return sum(
                runner.graphs.warm_up()
                for runner in (self.target, self.draft)
                if runner is not None and runner.graphs is not None
            )

    # ---- the parts of a step ------------------------------------------------------

    def _plan_depth(self) -> tuple[int, str | None, float]:
        """The step's draft depth, why it is 0 if it is, and the confidence stop's bar."""
        off = self._off()
        if off is not None:
            return 0, off[1], 0.0
        decoding = self.scheduler.decoding_count
        # Only a step without prompt chunks is timed (``_record``). The first
        # prefilling request gets a chunk; with duringPrefill off such a step
        # does not speculate (PREFILL).
        plan = self.controller.plan(max(decoding, 1), timed=decoding == len(self.scheduler.running))
        return plan.cap, plan.reason, plan.confidence

    def _count_fallback(self, rows: list[Row], depth: int, reason: str | None) -> None:
        """Count a target-only step by its reason, where some row decodes in it."""
        if (
            depth == 0
            and reason is not None
            and any(r.request.decoding and r.samples for r in rows)
        ):
            self.fallback_counts[reason] = self.fallback_counts.get(reason, 0) + 1

    def _propose(self, rows: list[Row], depth: int, bar: float) -> Proposal:
        """The draft's tokens for the step (and its catch-up chunks)."""
        if self.drafter is None or not any(r.draft_tokens for r in rows):
            return Proposal(torch.empty(0, dtype=torch.long, device=self.device), None)
        return self.drafter.propose(rows, depth, bar)

    def _commit(self, row: Row, result: RowResult) -> StepEvent:
        event = commit_row(row, result)
        if event.finished:
            self._finish(row.request, keep_contents=event.finish_reason != "error")
        return event

    def _record(
        self,
        rows: list[Row],
        depth: int,
        reason: str | None,
        work: _StepWork,
        timer: StepTimer,
    ) -> None:
        """The step's time to the budget, the step histogram and the depth controller.

        Keyed by the depth the rows really drafted: a step that the confidence
        stop cut short is cheaper than one of its planned depth, and taken as
        that depth's pure step it would make every prompt chunk look expensive.
        """
        draft_seconds, verify_seconds = timer.split()  # after the step's sync
        seconds = draft_seconds + verify_seconds
        self.budget.record(
            work.decoding, self.last_step_depth, work.prompt_tokens, seconds, work.catch_up
        )
        self.last_step = StepTiming.of(work.decoding, work.prompt_tokens + work.catch_up, seconds)
        # No prompt work for either model: a draft's catch-up would be timed as drafting.
        pure = work.catch_up == 0 and all(r.samples and len(r.target_tokens) == 1 for r in rows)
        drafts = [(r.num_draft, r.accepted) for r in rows if r.num_draft > 0]
        outcome = StepOutcome(depth, reason, len(rows), pure, drafts, draft_seconds, verify_seconds)
        self.controller.record(outcome)
        if self._floor_reason is None:
            self._floor_reason = self.controller.floor_verdict()

    # ---- request bookkeeping ----------------------------------------------------

    def _copy_prefix(self, admission: Admission) -> None:
        """The source slot's cached prefix into the new request's slot (both models)."""
        assert admission.copy_from is not None and self.target.storage is not None
        self.target.storage.copy_prefix(admission.copy_from, admission.slot, admission.reused)
        if self.draft is not None and self.draft.storage is not None:
            self.draft.storage.copy_prefix(
                admission.copy_from, admission.slot, admission.draft_reused
            )

    def _finish(self, request: Request, *, keep_contents: bool = True) -> None:
        """A running request leaves: its slot is freed, its stats are kept."""
        self.scheduler.release(
            request, draft_cached=self.draft_storage_allocated, keep_contents=keep_contents
        )
        self._finish_stats(request)

    def _finish_stats(self, request: Request) -> None:
        request.stats.elapsed_seconds = time.perf_counter() - request.started
        self._done[request.id] = request.stats
        while len(self._done) > KEEP_FINISHED_STATS:
            self._done.popitem(last=False)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stats: RequestStats


def generate(
    engine: SpeculativeEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
) -> list[GenerationResult]:
    """Decode a batch of prompts together (one running batch) to completion."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"params: {len(per_prompt)} entries for {len(prompts)} prompts")
    ids = [f"generate-{id(engine)}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    texts: dict[str, list[str]] = {i: [] for i in ids}
    reasons: dict[str, FinishReason | None] = dict.fromkeys(ids)
    for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
        engine.add_request(request_id, list(prompt), p)
    pending = set(ids)
    try:
        while pending:
            for event in engine.step():
                if event.request_id not in pending:
                    continue
                tokens[event.request_id].extend(event.token_ids)
                texts[event.request_id].append(event.text)
                if event.finished:
                    reasons[event.request_id] = event.finish_reason
                    pending.discard(event.request_id)
    finally:
        for request_id in pending:
            engine.abort(request_id)
    return [
        GenerationResult(tokens[i], "".join(texts[i]), reasons[i], engine.stats(i)) for i in ids
    ]
