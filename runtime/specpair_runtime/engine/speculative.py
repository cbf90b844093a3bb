"""The speculative decoding engine: batched, lossless, continuous batching.

Per step, for the whole running batch at once:

1. Admit waiting requests: prefill prompt[:-1] in both models (a separate
   batched forward), then merge the new rows into the running caches.
2. Plan depths (``depth.py``). With depth 0 the step is target-only: one
   target forward over each row's last committed token.
3. Otherwise the draft runs ``K = max depth`` batched forwards: the first
   one catches the draft up on committed tokens it has not seen (usually
   one or two), each next one feeds the token just drafted.
4. The target scores ``[last committed, d1..dK]`` in ONE batched forward.
5. Rejection sampling (``sampling.py``) picks each row's accepted prefix
   plus one recovered or bonus token; both caches roll back per row
   (``kvcache.py``: holes in a shared batched cache, cropped when common).
6. Committed tokens go through stop handling (``stopping.py``); finished
   rows leave the batch.

Target-only decoding runs through the same forwards, so greedy speculative
output equals greedy target-only output token for token.

Sampling with a seed: each request draws random numbers only from its own
generator, and only as many as its own depth needs, so with a fixed depth
(``adaptive: false``, ``minDepth == maxDepth``) a seeded request gives the
same tokens alone or in any batch. Adaptive depth follows measured timings,
so there a seed fixes the distribution, not the exact tokens.

Limits: attention masks with holes are built here (4-D, additive), which
suits the ``sdpa`` and ``eager`` attention implementations; sliding-window
attention is not applied to batches with holes (Qwen2.5 has none).

The engine is single-threaded: call ``add_request``/``abort``/``step`` from
one thread (the server runs it in one executor thread).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import (
    FinishReason,
    RequestStats,
    SamplingParams,
    StepEvent,
)
from specpair_runtime.engine.cpu_kernels import use_onednn_linears
from specpair_runtime.engine.depth import DepthController, next_heuristic_depth
from specpair_runtime.engine.kvcache import RaggedCache
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.sampling import (
    SamplingTensors,
    draft_sample,
    greedy_verify,
    probabilities,
    rejection_sample,
    target_sample,
)
from specpair_runtime.engine.stopping import OutputStream

KEEP_FINISHED_STATS = 4096
CATCH_UP_INLINE = 4  # longer draft catch-ups run as a separate prefill forward
MEMORY_PRESSURE = "memory_pressure"

LogitsWanted = Literal["all", "last", "none"]


def validate_params(params: SamplingParams) -> None:
    """Raise ValueError naming the first bad field."""
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0 or params.temperature != params.temperature:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")


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
    generator: torch.Generator
    stream: OutputStream
    depth: int  # the request's heuristic depth
    stats: RequestStats = field(default_factory=RequestStats)
    output_ids: list[int] = field(default_factory=list)
    draft_pending: list[int] = field(default_factory=list)  # committed, not in the draft cache
    started: float = 0.0

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)


class _Runner:
    """One model and how to run it over ragged chunks."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        # out_features also exists on quantized heads, whose .weight is a method.
        head = self.model.get_output_embeddings()
        width = getattr(head, "out_features", None)
        self.vocab = int(width if width is not None else self.model.config.vocab_size)
        embeddings = self.model.get_input_embeddings()
        self.embedding_rows = int(getattr(embeddings, "num_embeddings", self.vocab))

    def new_cache(self, rows: int) -> RaggedCache:
        return RaggedCache(rows, self.device, self.dtype)

    def forward(
        self,
        cache: RaggedCache,
        input_ids: torch.Tensor,
        chunk_lens: Sequence[int],
        wanted: LogitsWanted,
    ) -> torch.Tensor | None:
        """Append ``input_ids`` [B, W] (row i: first chunk_lens[i] real) to ``cache``.

        wanted="all": logits [B, W, V]; "last": logits at each row's last real
        token [B, V]; "none": no logits (prefill).
        """
        width = int(input_ids.shape[1])
        # A draft with fewer embedding rows than the target's logits (vocab
        # padding) must still read every committed id; past the tokenizer
        # these ids are junk anyway, and the draft only proposes.
        input_ids = input_ids.clamp(max=self.embedding_rows - 1)
        inputs = cache.prepare(chunk_lens, width)
        uniform = all(n == width for n in chunk_lens)
        keep = 1 if wanted == "none" or (wanted == "last" and uniform) else 0
        out = self.model(
            input_ids=input_ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            cache=cache.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        logits: torch.Tensor = out.logits
        if wanted == "none":
            return None
        if wanted == "all":
            return logits
        if uniform:
            return logits[:, -1]
        last = torch.tensor([max(n - 1, 0) for n in chunk_lens], device=self.device)
        return logits[torch.arange(logits.shape[0], device=self.device), last]

    def prefill(self, sequences: Sequence[Sequence[int]]) -> RaggedCache:
        """A new cache holding each sequence (right-padded batch, one forward)."""
        cache = self.new_cache(len(sequences))
        width = max((len(s) for s in sequences), default=0)
        if width == 0:
            return cache
        ids = torch.zeros((len(sequences), width), dtype=torch.long, device=self.device)
        for row, seq in enumerate(sequences):
            if seq:
                ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        self.forward(cache, ids, [len(s) for s in sequences], "none")
        return cache


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's id range: cut extra rows, pad missing ones with -inf."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def _ragged_ids(chunks: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    width = max(len(c) for c in chunks)
    ids = torch.zeros((len(chunks), width), dtype=torch.long)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk)] = torch.tensor(list(chunk), dtype=torch.long)
    return ids.to(device)


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
        cpu_kernels: Literal["onednn", "default"] = "onednn",
    ) -> None:
        """``cpu_kernels="onednn"`` switches the fp32 linears of both models to
        oneDNN in place when they run on the CPU (see ``cpu_kernels.py``)."""
        if draft is not None and draft.device != target.device:
            raise ValueError(
                f"draft device {draft.device} differs from target device {target.device}: "
                "the pair is never split across devices"
            )
        if cpu_kernels == "onednn":
            for loaded in (target, draft):
                if loaded is not None and loaded.device.type == "cpu":
                    use_onednn_linears(loaded.model)
        self.target = _Runner(target)
        self.draft = _Runner(draft) if draft is not None else None
        self.tokenizer = target.tokenizer
        self.device = target.device
        self.knobs = knobs
        self.refused = speculation_refused
        self.controller = DepthController(knobs)
        self.eos_ids = eos_token_ids(target)
        self._paused: str | None = None
        self._floor_reason: str | None = None
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._target_cache = self.target.new_cache(0)
        self._draft_cache: RaggedCache | None = (
            self.draft.new_cache(0) if self.draft is not None else None
        )
        self._done: OrderedDict[str, RequestStats] = OrderedDict()
        # Target-only steps by reason: no_draft, refused, disabled, a pause reason,
        # acceptance_floor, batch_size, probe (cost measurement), not_paying.
        self.fallback_counts: dict[str, int] = {}
        self.last_step_depth = 0

    # ---- the Engine protocol -------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.target.vocab]
        if bad:
            raise ValueError(f"prompt_ids: token id {bad[0]} is outside [0, {self.target.vocab})")
        validate_params(params)
        if self._find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed
        if seed is None:
            # From torch's global generator, so torch.manual_seed makes runs repeatable.
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        stream = OutputStream(
            self.tokenizer,
            prompt_ids,
            eos_ids=self.eos_ids,
            stop=params.stop,
            max_new_tokens=params.max_new_tokens,
        )
        request = _Request(
            id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            generator=generator,
            stream=stream,
            depth=self.knobs.max_depth,
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
        for index, request in enumerate(self._running):
            if request.id == request_id:
                self._remove_rows([index])
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
        for request in [*self._waiting, *self._running]:
            request.depth = max(knobs.min_depth, min(request.depth, knobs.max_depth))

    def set_speculation_paused(self, reason: str | None) -> None:
        self._paused = reason
        if reason == MEMORY_PRESSURE and self.draft is not None:
            self._draft_cache = None  # freed; rebuilt lazily on resume
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

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

    def step(self) -> list[StepEvent]:
        with torch.inference_mode():
            self._admit()
            if not self._running:
                return []
            depths, reason = self._plan()
            self.last_step_depth = max(depths, default=0)
            if self.last_step_depth == 0:
                if reason is not None:
                    self.fallback_counts[reason] = self.fallback_counts.get(reason, 0) + 1
                commits = self._target_only_step(reason)
            else:
                commits = self._speculative_step(depths)
            return self._commit(commits)

    # ---- internals ------------------------------------------------------------

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

    def _remove_rows(self, indices: Sequence[int]) -> None:
        gone = set(indices)
        keep = [i for i in range(len(self._running)) if i not in gone]
        self._running = [self._running[i] for i in keep]
        self._target_cache.select(keep)
        if self._draft_cache is not None:
            self._draft_cache.select(keep)

    def _admit(self) -> None:
        """Prefill waiting requests and merge them into the running batch."""
        if not self._waiting:
            return
        new, self._waiting = self._waiting, []
        now = time.perf_counter()
        for request in new:
            request.started = min(request.started, now)
        contexts = [r.prompt_ids[:-1] for r in new]
        self._target_cache.merge(self.target.prefill(contexts))
        if self.draft is not None and self._draft_cache is not None:
            if self.speculation_active:
                self._draft_cache.merge(self.draft.prefill(contexts))
                for request in new:
                    request.draft_pending = [request.prompt_ids[-1]]
            else:  # catch up later, only if speculation comes back
                self._draft_cache.merge(self.draft.new_cache(len(new)))
                for request in new:
                    request.draft_pending = list(request.prompt_ids)
        self._running.extend(new)

    def _plan(self) -> tuple[list[int], str | None]:
        """Per-row depths for this step, and why they are all 0 if they are."""
        off = self.speculation_off_reason
        if off is not None:
            return [0] * len(self._running), self._off_label()
        plan = self.controller.plan(len(self._running))
        if plan.cap == 0:
            return [0] * len(self._running), plan.reason
        depths = [max(0, min(r.depth, plan.cap, r.remaining - 1)) for r in self._running]
        return depths, None

    def _sampling(self) -> SamplingTensors:
        params = [r.params for r in self._running]
        return SamplingTensors.build(
            [p.temperature for p in params],
            [p.top_k for p in params],
            [p.top_p for p in params],
            self.device,
        )

    def _target_only_step(self, reason: str | None) -> list[tuple[list[int], int, int]]:
        rows = len(self._running)
        started = time.perf_counter()
        ids = torch.tensor([[r.last_token] for r in self._running], device=self.device)
        logits = self.target.forward(self._target_cache, ids, [1] * rows, "last")
        assert logits is not None
        generators = [r.generator for r in self._running]
        tokens = target_sample(logits.float(), self._sampling(), generators).tolist()
        self.controller.cost.record_verify(rows, 1, time.perf_counter() - started)
        self.controller.record_target_only_step(reason)
        if self.draft is not None:
            for request, token in zip(self._running, tokens, strict=True):
                request.draft_pending.append(token)
        return [([token], 0, 0) for token in tokens]

    def _ensure_draft_cache(self) -> RaggedCache:
        assert self.draft is not None
        if self._draft_cache is None:  # freed under memory pressure: re-prefill
            self._draft_cache = self.draft.prefill([r.sequence[:-1] for r in self._running])
            for request in self._running:
                request.draft_pending = [request.last_token]
        return self._draft_cache

    def _speculative_step(self, depths: list[int]) -> list[tuple[list[int], int, int]]:
        assert self.draft is not None
        draft_cache = self._ensure_draft_cache()
        rows, k = len(self._running), max(depths)
        params = self._sampling()
        generators = [r.generator for r in self._running]
        cuda = self.device.type == "cuda"

        # Draft: K batched forwards; the first also catches up on committed tokens.
        chunks = [r.draft_pending for r in self._running]
        if max(len(c) for c in chunks) > CATCH_UP_INLINE:
            # A long catch-up (after target-only steps) is a prefill: no logits.
            catch_up = [c[:-1] for c in chunks]
            self.draft.forward(
                draft_cache, _ragged_ids(catch_up, self.device), [len(c) for c in catch_up], "none"
            )
            chunks = [c[-1:] for c in chunks]
        started = time.perf_counter()
        inputs = _ragged_ids(chunks, self.device)
        chunk_lens = [len(c) for c in chunks]
        draft_tokens: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor | None] = []
        for position in range(k):
            logits = self.draft.forward(draft_cache, inputs, chunk_lens, "last")
            assert logits is not None
            # Rows already past their depth draft junk from the global RNG, so a
            # request's own random stream does not depend on its companions.
            row_generators = [
                g if d > position else None for g, d in zip(generators, depths, strict=True)
            ]
            tokens, probs = draft_sample(
                _fit_vocab(logits, self.target.vocab), params, row_generators
            )
            draft_tokens.append(tokens)
            draft_probs.append(probs)
            if position + 1 < k:
                inputs, chunk_lens = tokens[:, None], [1] * rows
        drafted = torch.stack(draft_tokens, dim=1)  # [B, K]
        if cuda:
            torch.cuda.synchronize(self.device)
        draft_done = time.perf_counter()

        # Verify: one target forward over [last committed, d1..dK].
        last = torch.tensor([[r.last_token] for r in self._running], device=self.device)
        verify_ids = torch.cat([last, drafted], dim=1)
        target_logits = self.target.forward(
            self._target_cache, verify_ids, [1 + d for d in depths], "all"
        )
        assert target_logits is not None
        num_draft = torch.tensor(depths, device=self.device)
        if params.all_greedy:
            output, accepted = greedy_verify(drafted, target_logits.argmax(dim=-1), num_draft)
        else:
            q = torch.stack([p for p in draft_probs if p is not None], dim=1)
            p = probabilities(target_logits, params)
            output, accepted = rejection_sample(drafted, q, p, generators, num_draft)
        output_rows: list[list[int]] = output.tolist()
        accepted_rows: list[int] = accepted.tolist()
        verify_done = time.perf_counter()

        # Roll both caches back to the accepted prefixes.
        self._target_cache.rollback([n + 1 for n in accepted_rows], k + 1)
        if k > 1:
            draft_cache.rollback([min(n, k - 1) for n in accepted_rows], k - 1)
        commits = []
        for request, row, n, depth in zip(
            self._running, output_rows, accepted_rows, depths, strict=True
        ):
            committed = row[: n + 1]
            request.draft_pending = ([row[k - 1]] if n == k else []) + [committed[-1]]
            commits.append((committed, depth, n))

        cost = self.controller.cost
        cost.record_draft(rows, (draft_done - started) / k)
        cost.record_verify(rows, k + 1, verify_done - draft_done)
        for depth, n in zip(depths, accepted_rows, strict=True):
            if depth:
                cost.record_acceptance(depth, n)
        self.controller.record_speculation_step(sum(depths), sum(accepted_rows))
        if self._floor_reason is None:
            self._floor_reason = self.controller.floor_verdict()
        self._target_cache.maybe_compact()
        draft_cache.maybe_compact()
        return commits

    def _commit(self, commits: list[tuple[list[int], int, int]]) -> list[StepEvent]:
        events: list[StepEvent] = []
        finished_rows: list[int] = []
        now = time.perf_counter()
        for index, (request, (tokens, drafted, accepted)) in enumerate(
            zip(self._running, commits, strict=True)
        ):
            pushed = request.stream.push(tokens)
            request.output_ids.extend(pushed.token_ids)
            stats = request.stats
            stats.target_passes += 1
            stats.generated_tokens += len(pushed.token_ids)
            if drafted:
                stats.drafted_tokens += drafted
                stats.accepted_tokens += accepted
                stats.speculation_steps += 1
                while len(stats.accepted_per_position) < drafted:
                    stats.accepted_per_position.append(0)
                for position in range(accepted):
                    stats.accepted_per_position[position] += 1
                request.depth = next_heuristic_depth(request.depth, drafted, accepted, self.knobs)
            stats.elapsed_seconds = now - request.started
            reason: FinishReason | None = pushed.finish_reason
            events.append(
                StepEvent(
                    request_id=request.id,
                    token_ids=pushed.token_ids,
                    text=pushed.text,
                    drafted=drafted,
                    accepted=accepted,
                    finished=reason is not None,
                    finish_reason=reason,
                )
            )
            if reason is not None:
                finished_rows.append(index)
                self._finish_stats(request)
        if finished_rows:
            self._remove_rows(finished_rows)
        return events


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
