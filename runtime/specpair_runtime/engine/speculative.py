"""The speculative decoding engine: one ragged forward per model per step, lossless.

A step, for every running request at once (``plan.py`` decides the shapes):

1. Admit waiting requests into free KV slots (``kvcache.py``: fixed storage).
   A request starts past the longest prefix of its prompt whose KV a slot
   still holds (``prefix_reuse.py``).
2. One depth ``k`` for the step (``depth.py``); 0 makes it a target-only step.
   A step that reads a prompt chunk beside decoding rows takes ``k = 0``
   where ``duringPrefill`` is off (the CPU's default, ``config.py``); its
   drafts still catch up.
3. Draft (when ``k > 0``, or to catch up): forward 0 is one flat ragged batch in which
   every decoding row feeds the committed tokens its draft has not seen
   (usually 1-2) and gets logits for its first draft token, and every other
   row catches its draft up by a chunk. Forwards 1..k-1 feed one drafted
   token per row that still drafts. A row near ``max_new_tokens`` drafts
   fewer tokens (it leaves the later forwards), never wasted ones, and so
   does a row whose drafts so far the draft itself expects to be rejected
   (the product of its probabilities below ``draftConfidence``).
4. Target: ONE flat forward over every row's tokens: ``[last, d1..dn]`` for a
   decoding row, a prompt chunk for a prefilling row (the token budget,
   ``budget.py``, bounds the chunks, so admissions never stall the running
   streams; unless ``max_step_tokens`` fixes it, it is measured so that a
   step with chunks stays close to a pure decode step).
5. Sampling over the flat batch (``sampling.py``): accepted, recovered and
   bonus tokens; a prefill that reaches its last prompt token samples its
   first output token. One host sync reads the results.
6. Commit: each request's lengths advance over its accepted tokens only; a
   rejected draft is rolled back by not advancing (its positions are
   overwritten later). Stop handling (``stopping.py``), finished requests
   free their slots. A request whose probabilities are not finite finishes
   alone with ``finish_reason="error"``.

Target-only decoding runs through the same forwards and the same kernels, so
on the CPU greedy speculative output equals greedy target-only output token
for token (on CUDA, up to floating-point numerics: see the golden check).

Seeds: a request with a seed owns a generator and draws only from it, and
only as many numbers as its own drafts need, so with a fixed depth it gives
the same tokens alone or in any batch. Other requests share batched draws
from torch's global generator (``torch.manual_seed`` makes runs repeatable).

Single-threaded: call ``add_request``/``abort``/``step`` from one thread.
"""

from __future__ import annotations

import functools
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from specpair_runtime.config import (
    SpeculationKnobs,
    measured_draft_confidence,
    resolved_draft_confidence,
)
from specpair_runtime.engine.api import (
    FinishReason,
    RequestStats,
    SamplingParams,
    StepEvent,
    TokenLogprob,
)
from specpair_runtime.engine.budget import (
    StepTiming,
    chunk_size,
    draft_catch_up,
    prefill_order,
)
from specpair_runtime.engine.cpu_kernels import use_onednn_linears
from specpair_runtime.engine.depth import PREFILL, DepthController
from specpair_runtime.engine.kvcache import RowSpan
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.logprobs import (
    MAX_TOP_LOGPROBS,
    LogprobRequest,
    read_committed,
    score_committed,
)
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.prefix_reuse import Admission, SlotContents, plan_admission
from specpair_runtime.engine.runner import ModelRunner
from specpair_runtime.engine.sampling import (
    FlatLayout,
    SamplingTensors,
    StepIndex,
    draft_confidence,
    draft_sample,
    finite_rows,
    greedy_verify,
    probabilities,
    rejection_sample,
    sanitize,
)
from specpair_runtime.engine.stopping import OutputStream

KEEP_FINISHED_STATS = 4096
MEMORY_PRESSURE = "memory_pressure"


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
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # only for seeded requests
    stream: OutputStream
    stats: RequestStats = field(default_factory=RequestStats)
    output_ids: list[int] = field(default_factory=list)
    started: float = 0.0
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


@dataclass
class _Row:
    """One request's part of this step."""

    request: _Request
    target_tokens: list[int]  # fed to the target (placeholders where drafts go)
    samples: bool  # the target's logits at the end of this chunk pick tokens
    num_draft: int = 0
    draft_tokens: list[int] = field(default_factory=list)  # fed to draft forward 0
    draft_samples: bool = False  # draft forward 0 yields this row's first draft token
    accepted: int = 0  # set at commit


def _cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


class _StepTimer:
    """Draft and target time of one step without extra host syncs.

    On the CPU wall time is compute time. On CUDA the host runs ahead, so the
    boundaries are CUDA events, read after the step's one sync.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self.middle = self.start
        self.events: list[torch.cuda.Event] = []
        if self.cuda:
            self.events.append(_cuda_event())

    def mark(self) -> None:
        self.middle = time.perf_counter()
        if self.cuda:
            self.events.append(_cuda_event())

    def split(self) -> tuple[float, float]:
        """(seconds before the mark, seconds after it)."""
        if not self.cuda:
            return self.middle - self.start, time.perf_counter() - self.middle
        end = _cuda_event()
        end.synchronize()  # already reached: the step's results were read
        start, middle = self.events
        return start.elapsed_time(middle) / 1e3, middle.elapsed_time(end) / 1e3


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's id range: cut extra columns, pad missing ones with -inf."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class SpeculativeEngine:
    """Implements ``specpair_runtime.engine.api.Engine``.

    ``draft=None`` (or ``speculation_refused``) gives target-only decoding
    through the same code path.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        knobs: SpeculationKnobs,
        *,
        speculation_refused: str | None = None,
        options: EngineOptions | None = None,
        cpu_kernels: Literal["onednn", "default"] = "onednn",
    ) -> None:
        """``cpu_kernels="onednn"`` switches the fp32 linears of both models to
        oneDNN in place when they run on the CPU (see ``cpu_kernels.py``)."""
        if draft is not None and draft.device != target.device:
            raise ValueError(
                f"draft device {draft.device} differs from target device {target.device}: "
                "the pair is never split across devices"
            )
        self.options = options or EngineOptions()
        if cpu_kernels == "onednn":
            for loaded in (target, draft):
                if loaded is not None and loaded.device.type == "cpu":
                    use_onednn_linears(loaded.model)
        runner = functools.partial(
            ModelRunner,
            slots=self.options.max_slots,
            max_length=self.options.max_length,
            cuda_graphs=self.options.cuda_graphs,
            compile_graphs=self.options.cuda_graph_compile,
        )
        self.target = runner(target)
        self.draft = runner(draft) if draft is not None else None
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.budget = self.options.step_budget(self.device)
        self.knobs = knobs
        self.refused = speculation_refused
        self.controller = DepthController(knobs, self.device.type)
        self.eos_ids = eos_token_ids(target)
        self._paused: str | None = None
        self._floor_reason: str | None = None
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []  # admission order
        self._free_slots = list(range(self.options.max_slots))
        # What free slots still hold, for prefix reuse (prefix_reuse.py).
        self._retained: dict[int, SlotContents] = {}
        self._steps = 0  # steps run, for the prefill order's aging
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
        bad = [t for t in prompt_ids if not 0 <= t < self.target.vocab]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} is outside [0, {self.target.vocab})")
        validate_params(params)
        outside = [t for t in params.stop_token_ids if not 0 <= t < self.target.vocab]
        if outside:
            raise ValueError(
                f"stop_token_ids: token id {outside[0]} is outside [0, {self.target.vocab})"
            )
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.options.max_length:
            raise ValueError(
                f"max_new_tokens: prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} exceeds the engine's max length "
                f"{self.options.max_length}"
            )
        if self._find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        stream = OutputStream(
            self.tokenizer,
            prompt_ids,
            eos_ids=(set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids),
            stop=params.stop,
            max_new_tokens=params.max_new_tokens,
        )
        request = _Request(
            id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            generator=generator,
            stream=stream,
            started=time.perf_counter(),
        )
        self._done.pop(request_id, None)
        self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        for index, request in enumerate(self._waiting):
            if request.id == request_id:
                del self._waiting[index]
                self._finish_stats(request)
                return
        for request in self._running:
            if request.id == request_id:
                self._release(request)
                self._finish_stats(request)
                return

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self, request_id: str) -> RequestStats:
        request = self._find(request_id)
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
            for request in self._running:
                request.draft_len = 0
            self._retained = {
                slot: SlotContents(kept.tokens, 0) for slot, kept in self._retained.items()
            }
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def confidence_threshold(self, depth: int) -> float:
        """The confidence stop's threshold for a step of ``depth`` (0 = off).

        A fixed knob, or, unset with adaptive depth on the CPU, the break-even
        acceptance of one more draft token from the measured step costs (the
        device's default until they are measured).
        """
        fixed = resolved_draft_confidence(self.knobs, self.device.type)
        if measured_draft_confidence(self.knobs, self.device.type):
            batch = max(self._decoding_count(), 1)  # the controller's key, as in _plan_depth
            measured = self.controller.cost.break_even_confidence(batch, depth)
            if measured is not None:
                return measured
        return fixed

    @property
    def speculation_active(self) -> bool:
        return self.speculation_off_reason is None

    @property
    def speculation_off_reason(self) -> str | None:
        """Why speculation is off right now (None when it is on)."""
        if self.draft is None:
            return self.refused or "no draft model"
        if self.refused is not None:
            return self.refused
        if not self.knobs.enabled:
            return "disabled by knobs"
        if self._paused is not None:
            return self._paused
        return self._floor_reason

    def _off_label(self) -> str:
        """A short metric label for why speculation is off (``fallback_counts`` keys)."""
        if self.draft is None:
            return "no_draft"
        if self.refused is not None:
            return "refused"
        if not self.knobs.enabled:
            return "disabled"
        if self._paused is not None:
            return self._paused
        return "acceptance_floor"

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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

    def step(self) -> list[StepEvent]:
        self.last_step = None
        self._steps += 1
        with torch.inference_mode():
            self._admit()
            if not self._running:
                return []
            depth, reason = self._plan_depth()
            rows = self._plan_rows(depth, drafts_read=depth > 0 or reason == PREFILL)
            decoding = [r for r in rows if r.request.decoding and r.samples]
            if depth == 0 and reason is not None and decoding:
                self.fallback_counts[reason] = self.fallback_counts.get(reason, 0) + 1
            return self._run(rows, depth, reason)

    # ---- planning -------------------------------------------------------------

    def _find(self, request_id: str) -> _Request | None:
        for request in [*self._waiting, *self._running]:
            if request.id == request_id:
                return request
        return None

    def _finish_stats(self, request: _Request) -> None:
        request.stats.elapsed_seconds = time.perf_counter() - request.started
        self._done[request.id] = request.stats
        while len(self._done) > KEEP_FINISHED_STATS:
            self._done.popitem(last=False)

    def _release(self, request: _Request, *, keep_contents: bool = True) -> None:
        """Free the request's slot; its committed KV stays there for prefix reuse
        unless ``keep_contents`` is False (a request that failed)."""
        self._running.remove(request)
        self._free_slots.append(request.slot)
        self._free_slots.sort()
        if keep_contents and self.options.prefix_reuse:
            self._retained[request.slot] = self._contents(request)
        request.slot = -1

    def _contents(self, request: _Request) -> SlotContents:
        """The committed tokens whose KV the request's slot holds."""
        tokens = tuple(request.tokens(0, request.target_len))
        draft_len = request.draft_len if self.draft_storage_allocated else 0
        return SlotContents(tokens, min(draft_len, len(tokens)))

    def _admit(self) -> None:
        now = time.perf_counter()
        while self._waiting and self._free_slots:
            request = self._waiting.pop(0)
            if self.options.prefix_reuse:
                running = {r.slot: self._contents(r) for r in self._running}
                admission = plan_admission(
                    request.prompt_ids, self._free_slots, self._retained, running
                )
            else:
                admission = Admission(self._free_slots[0], 0, 0)
            self._free_slots.remove(admission.slot)
            self._retained.pop(admission.slot, None)
            if admission.copy_from is not None:
                self._copy_prefix(admission)
            request.slot = admission.slot
            request.target_len = admission.reused
            request.draft_len = admission.draft_reused if self.draft_storage_allocated else 0
            request.stats.cached_prompt_tokens = admission.reused
            request.admitted_step = self._steps
            request.started = min(request.started, now)
            self._running.append(request)

    def _copy_prefix(self, admission: Admission) -> None:
        """The source slot's cached prefix into the new request's slot (both models)."""
        assert admission.copy_from is not None and self.target.storage is not None
        self.target.storage.copy_prefix(admission.copy_from, admission.slot, admission.reused)
        if self.draft is not None and self.draft.storage is not None:
            self.draft.storage.copy_prefix(
                admission.copy_from, admission.slot, admission.draft_reused
            )

    def _decoding_count(self) -> int:
        """Running requests past their prompt (the depth controller keys its costs by it)."""
        return sum(1 for r in self._running if r.decoding)

    def _plan_depth(self) -> tuple[int, str | None]:
        """The step's draft depth, and why it is 0 if it is."""
        off = self.speculation_off_reason
        if off is not None:
            return 0, self._off_label()
        decoding = self._decoding_count()
        # Only a step without prompt chunks is timed (``_record``); ``_admit`` ran already.
        # The first prefilling request gets a chunk; with duringPrefill off such a
        # step does not speculate (PREFILL).
        plan = self.controller.plan(max(decoding, 1), timed=decoding == len(self._running))
        return plan.cap, plan.reason

    def _plan_rows(self, depth: int, drafts_read: bool) -> list[_Row]:
        """Every running request's tokens for this step, within the token budget.

        Decoding rows always run (the streams never wait); prefill chunks fill
        what the budget leaves, shortest remaining prompt first with aging
        (``prefill_order``; ``arrival``: oldest first), at least
        ``MIN_PREFILL_CHUNK`` tokens (the budget's ceiling when no row
        decodes; only the floor until the budget has timed a step with prompt
        work, ``StepBudget.chunk_room``). The draft gets its own budget of the
        same size, floor and ceiling for catch-up chunks, so it keeps pace with
        the target's prefill: a row whose draft lags decodes without drafting
        until it has caught up. (With the draft at the plain budget while the
        target took the ceiling, and without the floor, 18-50 % of the decoding
        rows at 8 streams on the 1.5B pair did not draft, their drafts lagging
        by a median of 49-126 tokens: docs/benchmarks-history.md, stop 30.)
        ``drafts_read``: the drafts catch up in this step. They do in a step that
        does not speculate only because it reads a prompt (``duringPrefill``):
        speculation then resumes at once when the prompts are read.
        """
        budget = self.step_tokens
        draft_budget = self.step_tokens
        rows: list[_Row] = []
        for request in self._running:
            if not request.decoding:
                continue
            last = request.tokens(request.sequence_len - 1, request.sequence_len)
            row = _Row(request, last, samples=True)
            if depth > 0:
                wanted = min(depth, request.remaining - 1)
                pending = request.sequence_len - request.draft_len
                if wanted > 0 and pending <= max(draft_budget, 1):
                    row.num_draft = wanted
                    row.draft_tokens = request.tokens(request.draft_len, request.sequence_len)
                    row.draft_samples = True
                    draft_budget -= pending
            budget -= 1 + row.num_draft
            rows.append(row)
        if not rows:  # nothing decodes: nobody waits on this step
            budget = draft_budget = self.budget.ceiling
        else:  # an unmeasured budget probes with the floor first
            budget = self.budget.chunk_room(budget)
            draft_budget = self.budget.chunk_room(draft_budget)
        first_prefill = True
        prefilling = [r for r in self._running if not r.decoding]
        if self.options.prefill_order == "shortest-first":
            order = prefill_order(
                [r.sequence_len - r.target_len for r in prefilling],
                [self._steps - r.admitted_step for r in prefilling],
            )
            prefilling = [prefilling[i] for i in order]
        for request in prefilling:
            pending = request.sequence_len - request.target_len
            size = chunk_size(pending, budget, first_prefill)
            if size <= 0:
                continue
            first_prefill = False
            budget -= size
            start = request.target_len
            rows.append(_Row(request, request.tokens(start, start + size), size == pending))
        if drafts_read:  # drafts of rows that do not draft now catch up in chunks
            first_catch_up = True
            for row in rows:
                request = row.request
                # A request with one token left never drafts again: its last token
                # comes from the target alone, so a catch-up would be wasted.
                if row.draft_samples or request.remaining <= 1:
                    continue
                lag = request.sequence_len - 1 - request.draft_len
                size = chunk_size(lag, draft_budget, first_catch_up)
                if size > 0:
                    first_catch_up = False
                    row.draft_tokens = request.tokens(request.draft_len, request.draft_len + size)
                    draft_budget -= size
        rows.sort(key=lambda r: r.request.slot)
        return rows

    # ---- running ----------------------------------------------------------------

    def _sampling(self, rows: Sequence[_Row], per_row: Sequence[int]) -> SamplingTensors:
        temps, top_ks, top_ps = [], [], []
        for row, count in zip(rows, per_row, strict=True):
            p = row.request.params
            temps += [p.temperature] * count
            top_ks += [p.top_k] * count
            top_ps += [p.top_p] * count
        return SamplingTensors.build(temps, top_ks, top_ps, self.device)

    def _draft(self, rows: list[_Row], depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the draft's forwards; returns flat draft tokens [D] and probs [D, V] or None."""
        assert self.draft is not None
        drafting = [r for r in rows if r.num_draft > 0]
        layout = FlatLayout.of([r.num_draft for r in drafting])
        total = layout.total_draft
        vocab = self.target.vocab
        tokens = torch.empty(total, dtype=torch.long, device=self.device)
        probs: torch.Tensor | None = None
        generators = [r.request.generator for r in drafting]
        params = self._sampling(drafting, [1] * len(drafting))
        threshold = self.confidence_threshold(depth)
        # Per drafting row, the draft's estimate that all its drafts so far are accepted.
        reach = [1.0] * len(drafting)
        # Forward 0: catch-up chunks for every row with draft tokens.
        spans: list[RowSpan] = []
        ids: list[int] = []
        sample_at: list[int] = []
        for row in rows:
            if not row.draft_tokens:
                continue
            request = row.request
            spans.append(RowSpan(request.slot, len(ids), len(row.draft_tokens), request.draft_len))
            ids += row.draft_tokens
            if row.draft_samples:
                sample_at.append(len(ids) - 1)
        if not spans:
            return tokens, probs
        logits = self.draft.forward(
            spans, self._ids(ids), self._ids(sample_at) if sample_at else None
        )
        for position in range(depth):
            active = [i for i, r in enumerate(drafting) if r.num_draft > position]
            if not active:
                break
            assert logits is not None
            if len(active) < len(drafting):
                index = self._ids(active)
                step_params = params.select(index, active)
            else:
                step_params = params
            fitted = _fit_vocab(logits, vocab)
            drafted, step_probs = draft_sample(fitted, step_params, [generators[i] for i in active])
            where = self._ids([layout.draft_start[i] + position for i in active])
            tokens[where] = drafted
            if step_probs is not None:
                if probs is None:
                    probs = torch.zeros((total, vocab), dtype=torch.float32, device=self.device)
                probs[where] = step_probs
            following = [i for i in active if drafting[i].num_draft > position + 1]
            if following and threshold > 0.0:
                # The confidence stop: a row drafts no further once the draft's estimate
                # that all its drafts so far are accepted (the product of its
                # probabilities) is below the threshold; the last token is still
                # verified. A token pays only if every one before it is accepted, as the
                # break-even bar assumes (depth rule 5 in architecture.md). A host read,
                # on the CPU free.
                confidence = draft_confidence(fitted, drafted, step_probs, step_params)
                for i, sure in zip(active, confidence.tolist(), strict=True):
                    reach[i] *= sure
                    if reach[i] < threshold and drafting[i].num_draft > position + 1:
                        drafting[i].num_draft = position + 1
                following = [i for i in following if drafting[i].num_draft > position + 1]
            if not following:
                break
            keep = [active.index(i) for i in following]
            next_ids = (
                drafted.index_select(0, self._ids(keep)) if len(keep) < len(active) else drafted
            )
            spans = [
                RowSpan(
                    drafting[i].request.slot,
                    j,
                    1,
                    drafting[i].request.sequence_len + position,
                )
                for j, i in enumerate(following)
            ]
            logits = self.draft.forward(spans, next_ids, self._ids(list(range(len(following)))))
        return self._drop_unused(layout, [r.num_draft for r in drafting], tokens, probs)

    def _drop_unused(
        self,
        layout: FlatLayout,
        num_draft: list[int],
        tokens: torch.Tensor,
        probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The flat draft tokens [D'] (and probs) of the rows' final ``num_draft``,
        where the confidence stop cut rows short of ``layout``."""
        if num_draft == layout.num_draft:
            return tokens, probs
        kept = [
            start + j
            for start, n in zip(layout.draft_start, num_draft, strict=True)
            for j in range(n)
        ]
        index = self._ids(kept)
        return tokens.index_select(0, index), (
            probs.index_select(0, index) if probs is not None else None
        )

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long).to(self.device, non_blocking=True)

    def _run(self, rows: list[_Row], depth: int, reason: str | None) -> list[StepEvent]:
        decoding = sum(1 for r in rows if r.request.decoding)
        # Prompt work of the step: the target's chunks and the drafts' catch-up chunks.
        prompt_tokens = sum(len(r.target_tokens) for r in rows if not r.request.decoding)
        catch_up = sum(draft_catch_up(len(r.draft_tokens), r.draft_samples) for r in rows)
        timer = _StepTimer(self.device)
        draft_tokens, draft_probs = (
            self._draft(rows, depth)
            if self.draft is not None and any(r.draft_tokens for r in rows)
            else (torch.empty(0, dtype=torch.long, device=self.device), None)
        )
        timer.mark()  # the draft is done
        self.last_step_depth = max((r.num_draft for r in rows), default=0)  # after any cut
        sampling_rows = [r for r in rows if r.samples]
        layout = FlatLayout.of([r.num_draft for r in sampling_rows])
        # The target's flat batch; drafted tokens are placed on the device.
        spans: list[RowSpan] = []
        ids: list[int] = []
        sample_at: list[int] = []
        draft_at: list[int] = []
        for row in rows:
            request = row.request
            start = len(ids)
            spans.append(
                RowSpan(
                    request.slot, start, len(row.target_tokens) + row.num_draft, request.target_len
                )
            )
            ids += row.target_tokens
            if row.num_draft:
                draft_at += range(len(ids), len(ids) + row.num_draft)
                ids += [0] * row.num_draft
            if row.samples:
                first = len(ids) - 1 - row.num_draft
                sample_at += range(first, len(ids))
        flat_ids = self._ids(ids)
        if draft_at:
            flat_ids[self._ids(draft_at)] = draft_tokens
        logits = self.target.forward(spans, flat_ids, self._ids(sample_at) if sample_at else None)
        events: list[StepEvent] = []
        if logits is not None:
            events = self._sample_and_commit(
                sampling_rows, layout, logits, draft_tokens, draft_probs
            )
        draft_seconds, verify_seconds = timer.split()  # after the step's sync
        seconds = draft_seconds + verify_seconds
        # Keyed by the depth the rows really drafted: a step that the confidence stop
        # cut short is cheaper than one of its planned depth, and taken as that
        # depth's pure step it would make every prompt chunk look expensive.
        self.budget.record(decoding, self.last_step_depth, prompt_tokens, seconds, catch_up)
        self.last_step = StepTiming.of(decoding, prompt_tokens + catch_up, seconds)
        self._advance_prefills(rows)
        self._record(rows, depth, reason, draft_seconds, verify_seconds, catch_up)
        return events

    def _sample_and_commit(
        self,
        rows: list[_Row],
        layout: FlatLayout,
        logits: torch.Tensor,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> list[StepEvent]:
        index = StepIndex.of(layout, self.device)
        params = self._sampling(rows, [n + 1 for n in layout.num_draft])
        generators = [r.request.generator for r in rows]
        if draft_probs is None and layout.total_draft and not params.all_greedy:
            # Greedy drafting rows beside sampled ones: q is one-hot at the draft token.
            draft_probs = torch.zeros(
                (layout.total_draft, logits.shape[-1]), dtype=torch.float32, device=self.device
            ).scatter_(1, draft_tokens[:, None], 1.0)
        if params.all_greedy:
            position_ok = torch.isfinite(logits).all(dim=-1)
            output, accepted = greedy_verify(draft_tokens, logits.argmax(dim=-1), index, layout)
        else:
            probs = probabilities(logits, params)
            position_ok = finite_rows(probs)
            probs = sanitize(probs, position_ok)
            output, accepted = rejection_sample(
                draft_tokens, draft_probs, probs, generators, index, layout
            )
        row_ok = torch.ones(layout.rows, dtype=torch.long, device=self.device)
        row_ok.scatter_reduce_(0, index.target_row, position_ok.long(), reduce="amin")
        wanted = LogprobRequest.of([row.request.params.logprobs for row in rows])
        pending = score_committed(logits, output, layout, wanted) if wanted.rows else None
        # The one host sync of the step (the logprobs, queued before it, are read after).
        packed = torch.cat([output.flatten(), accepted, row_ok]).tolist()
        width = layout.max_draft + 1
        accepted_counts = packed[layout.rows * width : layout.rows * width + layout.rows]
        oks = packed[layout.rows * width + layout.rows :]
        committed = [packed[r * width : r * width + n + 1] for r, n in enumerate(accepted_counts)]
        scored = read_committed(pending, [committed[r] for r in wanted.rows]) if pending else {}
        return [
            self._commit(row, committed[r], accepted_counts[r], bool(oks[r]), scored.get(r))
            for r, row in enumerate(rows)
        ]

    def _commit(
        self,
        row: _Row,
        tokens: list[int],
        accepted: int,
        ok: bool,
        logprobs: list[TokenLogprob] | None = None,
    ) -> StepEvent:
        request = row.request
        before = request.sequence_len
        first_output = not request.output_ids
        stats = request.stats
        stats.target_passes += 1
        if not ok:
            self._release(request, keep_contents=False)
            self._finish_stats(request)
            return StepEvent(
                request_id=request.id,
                token_ids=[],
                text="",
                drafted=0,
                accepted=0,
                finished=True,
                finish_reason="error",
                error="the target's probabilities are not finite for this request",
            )
        row.accepted = accepted
        # The accepted prefix is valid in both caches; the rest is overwritten later.
        request.target_len = before + accepted
        if row.num_draft:
            request.draft_len = before + min(accepted, row.num_draft - 1)
        elif row.draft_tokens:
            request.draft_len += len(row.draft_tokens)
        pushed = request.stream.push(tokens)
        request.output_ids.extend(pushed.token_ids)
        stats.generated_tokens += len(pushed.token_ids)
        if row.num_draft:
            stats.drafted_tokens += row.num_draft
            stats.accepted_tokens += accepted
            stats.speculation_steps += 1
            while len(stats.accepted_per_position) < row.num_draft:
                stats.accepted_per_position.append(0)
            for position in range(accepted):
                stats.accepted_per_position[position] += 1
        stats.elapsed_seconds = time.perf_counter() - request.started
        reason: FinishReason | None = pushed.finish_reason
        if reason is not None:
            self._release(request)
            self._finish_stats(request)
        return StepEvent(
            request_id=request.id,
            token_ids=pushed.token_ids,
            text=pushed.text,
            drafted=row.num_draft,
            accepted=accepted,
            finished=reason is not None,
            finish_reason=reason,
            cached_prompt_tokens=stats.cached_prompt_tokens if first_output else 0,
            # The kept tokens are a prefix of the committed ones (cut at a stop).
            logprobs=logprobs[: len(pushed.token_ids)] if logprobs is not None else None,
        )

    def _advance_prefills(self, rows: list[_Row]) -> None:
        """Rows that did not sample: their chunks are now in the caches."""
        for row in rows:
            if row.samples:
                continue
            row.request.target_len += len(row.target_tokens)
            row.request.draft_len += len(row.draft_tokens)

    def _record(
        self,
        rows: list[_Row],
        depth: int,
        reason: str | None,
        draft_seconds: float,
        verify_seconds: float,
        catch_up: int,
    ) -> None:
        """Feed the depth controller: timings of pure decode steps, acceptance, the floor.

        ``catch_up``: the step's draft catch-up tokens (``draft_catch_up``).
        """
        drafting = [r for r in rows if r.num_draft > 0]
        # No prompt work for either model: a draft's catch-up would be timed as drafting.
        pure = catch_up == 0 and all(r.samples and len(r.target_tokens) == 1 for r in rows)
        cost = self.controller.cost
        batch = len(rows)
        if pure and not drafting:
            # A target-only step, whatever made it one: a probe, a fallback, or rows
            # with one token left (at depth 0 no row drafts).
            cost.record_verify(batch, 1, verify_seconds)
        if depth == 0:
            self.controller.record_target_only_step(reason)
            return
        if not drafting:
            return
        drafted_depth = drafting[0].num_draft  # below ``depth`` where the confidence stop cut
        if pure and len(drafting) == batch and all(r.num_draft == drafted_depth for r in drafting):
            cost.record_draft(batch, draft_seconds / drafted_depth)
            cost.record_verify(batch, drafted_depth + 1, verify_seconds)
        drafted = accepted = 0
        for row in drafting:
            drafted += row.num_draft
            accepted += row.accepted
            cost.record_acceptance(row.num_draft, row.accepted)
        self.controller.record_speculation_step(drafted, accepted)
        if self._floor_reason is None:
            self._floor_reason = self.controller.floor_verdict()


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
