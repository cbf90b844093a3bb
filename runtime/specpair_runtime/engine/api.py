"""The engine's public, step-based API.

The CLI (one-shot batches) and the server (continuous batching) both drive
the engine through this interface:

    engine.add_request(request_id, prompt_ids, params)
    while engine.has_unfinished():
        for event in engine.step():   # one speculation round for every running request
            ...                       # event.token_ids / event.text are target-verified

Requests may join (``add_request``) and leave (``abort``) between steps.
``step`` never returns an unverified draft token: every token in a
``StepEvent`` has been accepted by the target (accepted, recovered or bonus
token, in vLLM's vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from specpair_runtime.config import SpeculationKnobs

if TYPE_CHECKING:
    import torch

# "error": this request alone failed inside the engine (e.g. non-finite
# probabilities in its row); its batch-mates go on. `StepEvent.error` says why,
# for the logs only: clients get a generic message.
FinishReason = Literal["stop", "length", "content_filter", "abort", "error"]


class LogitsProcessor(Protocol):
    """One request's logits processing (``engine/logits_processors.py``); may keep state."""

    def process(self, proposed: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Processed logits [n, V] of n consecutive positions (the input may be changed).

        The last row scores the token after the committed output plus all of
        ``proposed``, so row ``i`` follows ``proposed[: len(proposed) - n + 1 + i]``
        (``len(proposed) >= n - 1``): a verify of k drafts passes them with
        ``n = k + 1`` (row ``i`` follows ``proposed[:i]``); draft forward ``j``
        passes the row's ``j`` drafts so far with ``n = 1``.
        """
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """The target committed ``tokens`` after the ones committed before."""
        ...


# Builds one request's processor (processors keep per-request state).
LogitsProcessorFactory = Callable[[], LogitsProcessor]


# What a request's ``seed`` guarantees (the server's API reference, docs/api.md).
SEED_GUARANTEE = (
    "A sampled request (temperature above 0) with a seed gets the same output every "
    "time it is sent with the same prompt and sampling parameters, with the default "
    "knobs too: whatever the speculation depth, the other requests in the batch, prefix "
    "reuse and the server's timing. Each output token is the target's own Gumbel-max "
    "sample of its processed distribution (temperature, top-k, top-p) under noise keyed "
    "by the seed and the token's position, and the draft proposes with the same noise, "
    "so the output is what the target alone gives with that seed and follows its "
    "distribution exactly; a request with a smaller max_tokens gets a prefix of it. On "
    'the CPU "the same" is token for token. On CUDA it holds up to floating-point '
    "differences between batch shapes, which can change a token where two are nearly "
    "tied, as for greedy output. Another pair version, dtype or device may give other "
    "output. Greedy requests ignore the seed; sampled requests without one draw from "
    "the server's shared random state and differ from run to run."
)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature == 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Token ids that end the request like EOS (the token itself is kept, as EOS is).
    stop_token_ids: tuple[int, ...] = ()
    # Decode past the model's EOS tokens (load tests that want a fixed output length).
    ignore_eos: bool = False
    # Log-probabilities of the committed tokens (``engine/logprobs.py``): None = off,
    # 0 = the chosen token's only, n = also the n most likely tokens at each position.
    logprobs: int | None = None
    # Per-request logits processing (``engine/logits_processors.py``): each factory
    # builds one processor for the request, applied to draft and target logits alike.
    logits_processors: tuple[LogitsProcessorFactory, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability under the target, and the best alternatives.

    ``top``: (token id, log-probability) pairs, most likely first; empty unless
    the request asked for alternatives.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepEvent:
    """What one request got from one engine step (all of it verified)."""

    request_id: str
    token_ids: list[int]  # newly committed tokens (may be empty while text is held back)
    text: str  # newly releasable text; a possible stop-string prefix is held back
    drafted: int  # draft tokens proposed for this request in this step (0 = no speculation)
    accepted: int  # of those, how many the target accepted (accepted positions 0..accepted-1)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None  # set only with finish_reason == "error"; internal detail
    # On a request's first event with output: how many of its prompt tokens were not
    # computed but found in the KV storage (prefix reuse), OpenAI's ``cached_tokens``.
    cached_prompt_tokens: int = 0
    # One entry per token of ``token_ids``, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestStats:
    """Cumulative per-request statistics."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_passes: int = 0
    speculation_steps: int = 0
    generated_tokens: int = 0
    elapsed_seconds: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV was reused, not computed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per speculation step: accepted / steps + 1."""
        if not self.speculation_steps:
            return 0.0
        return self.accepted_tokens / self.speculation_steps + 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_seconds if self.elapsed_seconds else 0.0


class Engine(Protocol):
    """What the server and the CLI need from the decoding engine."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; it joins the running batch at the next step."""

    def abort(self, request_id: str) -> None:
        """Drop a request and free its KV cache slots. Unknown ids are ignored."""

    def step(self) -> list[StepEvent]:
        """Run one decoding round for all running requests."""

    def has_unfinished(self) -> bool: ...

    def stats(self, request_id: str) -> RequestStats:
        """Stats of a running or just-finished request."""

    def update_knobs(self, knobs: SpeculationKnobs) -> None:
        """Apply new live knobs (depth, adaptive, floor, ...) from the next step on."""

    def set_speculation_paused(self, reason: str | None) -> None:
        """Pause speculation for a reason (e.g. 'memory_pressure', 'batch_size'); None resumes.

        While paused for memory pressure the engine also frees the draft's KV caches
        and re-prefills the draft lazily on resume.
        """

    @property
    def speculation_active(self) -> bool:
        """False when speculation is off for any reason (knobs, alignment, floor, pause)."""
