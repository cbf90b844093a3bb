"""Log-probabilities of the committed tokens, from the target's verify logits.

Every token that a step commits for a row (the accepted drafts, then the
recovered or bonus token) sits at one of the row's target positions: token
``j`` was scored at position ``target_start + j``. So the target's logits of
the verify forward give each committed token's log-probability, with no
extra forward, whatever the depth, and the same values a target-only step
gives (on the CPU the kernels are batch-invariant).

The values are the target model's own distribution, before temperature,
top-p and top-k, as vLLM reports them by default (``logprobs_mode``
``raw_logprobs``): they describe the model, not the sampler's settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpair_runtime.engine.api import TokenLogprob
from specpair_runtime.engine.sampling import FlatLayout

# The most alternatives a request may ask for per token (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogprobRequest:
    """The rows of a step that asked for log-probabilities, and how many alternatives."""

    rows: list[int]  # indices into the step's sampling rows
    top: list[int]  # per row: alternatives wanted (0: the chosen token's only)

    @staticmethod
    def of(asked: Sequence[int | None]) -> LogprobRequest:
        """From each sampling row's ``SamplingParams.logprobs`` (None: not asked)."""
        return LogprobRequest(
            [r for r, n in enumerate(asked) if n is not None], [n for n in asked if n is not None]
        )

    @property
    def max_top(self) -> int:
        return max(self.top, default=0)


@dataclass(frozen=True)
class PendingLogprobs:
    """Device tensors of one step's log-probabilities, read after the step's sync.

    chosen [P]: each position's log-probability of the token committed there
    (meaningless past a row's committed tokens); top_values / top_ids
    [P, max_top] or None: the best alternatives, best first.
    """

    request: LogprobRequest
    offsets: list[int]  # per requested row: its first position in ``chosen``
    chosen: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None


def score_committed(
    logits: torch.Tensor, output: torch.Tensor, layout: FlatLayout, wanted: LogprobRequest
) -> PendingLogprobs:
    """Queue the log-softmax of the requested rows' positions (no host sync).

    logits [D + R, V]: the target's verify logits, row r's positions at
    ``layout.target_start[r]`` onwards; output [R, K + 1]: the tokens each
    row commits, -1 past them.
    """
    positions: list[int] = []
    tokens: list[torch.Tensor] = []
    offsets: list[int] = []
    for r in wanted.rows:
        width = layout.num_draft[r] + 1
        offsets.append(len(positions))
        start = layout.target_start[r]
        positions += range(start, start + width)
        tokens.append(output[r, :width])
    index = torch.tensor(positions, dtype=torch.long).to(logits.device, non_blocking=True)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    committed = torch.cat(tokens).clamp(min=0)  # -1 past the committed tokens: read, then unused
    chosen = logprobs.gather(1, committed[:, None]).squeeze(1)
    top_values = top_ids = None
    if wanted.max_top:
        top_values, top_ids = logprobs.topk(min(wanted.max_top, logprobs.shape[-1]), dim=-1)
    return PendingLogprobs(wanted, offsets, chosen, top_values, top_ids)


def read_committed(
    pending: PendingLogprobs, committed: Sequence[Sequence[int]]
) -> dict[int, list[TokenLogprob]]:
    """Per requested row (its index among the sampling rows), one entry per committed token.

    ``committed[i]``: the tokens that the i-th requested row committed this step.
    """
    chosen = pending.chosen.tolist()
    values = pending.top_values.tolist() if pending.top_values is not None else None
    ids = pending.top_ids.tolist() if pending.top_ids is not None else None
    out: dict[int, list[TokenLogprob]] = {}
    for i, (row, top) in enumerate(zip(pending.request.rows, pending.request.top, strict=True)):
        entries = []
        for j, token in enumerate(committed[i]):
            at = pending.offsets[i] + j
            alternatives: tuple[tuple[int, float], ...] = ()
            if top and values is not None and ids is not None:
                alternatives = tuple(zip(ids[at][:top], values[at][:top], strict=True))
            entries.append(TokenLogprob(token, chosen[at], alternatives))
        out[row] = entries
    return out
