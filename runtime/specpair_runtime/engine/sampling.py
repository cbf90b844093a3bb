"""Logits processing and lossless rejection sampling (pure tensor functions).

Vocabulary (as in vLLM's rejection sampler): the draft proposes ``k`` tokens;
the target accepts a prefix of them (*accepted* tokens); at the first
rejection a *recovered* token is sampled from the residual distribution
``norm(max(0, p - q))``; when all ``k`` are accepted a *bonus* token is
sampled from the target's distribution after the last draft token.

Shapes: ``B`` rows (requests), ``K`` the padded draft length, ``V`` the
vocabulary. Every probability here is a *processed* distribution: the same
temperature / top-k / top-p (``process_logits``) is applied to target and
draft logits, so the output follows the target's processed distribution
exactly (Leviathan et al. 2023, Chen et al. 2023). Temperature 0 (greedy) is
the special case of one-hot distributions: a draft token is accepted iff it
is the target's argmax, and the recovered/bonus token is the target's argmax.

Each row draws its random numbers only from its own ``torch.Generator``, so
batch companions never consume a request's random stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors on the logits' device.

    temperature [B] float (0 = greedy), top_k [B] long (0 = off), top_p [B] float.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy_rows: tuple[bool, ...]

    @staticmethod
    def build(
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        device: torch.device,
    ) -> SamplingTensors:
        return SamplingTensors(
            temperature=torch.tensor(list(temperatures), dtype=torch.float32, device=device),
            top_k=torch.tensor(list(top_ks), dtype=torch.long, device=device),
            top_p=torch.tensor(list(top_ps), dtype=torch.float32, device=device),
            greedy_rows=tuple(t == 0.0 for t in temperatures),
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy_rows)

    @property
    def needs_top_k(self) -> bool:
        return bool((self.top_k > 0).any())

    @property
    def needs_top_p(self) -> bool:
        return bool((self.top_p < 1.0).any())


def process_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF's order); returns float32 logits.

    logits: [B, S, V] (S positions per row). Masked tokens get -inf. Greedy
    rows (temperature 0) are left unscaled; ``probabilities`` makes them
    one-hot. Top-p keeps the smallest set of most likely tokens whose
    probability reaches ``top_p`` (always at least one token).
    """
    out = logits.float()
    temperature = torch.where(params.temperature > 0, params.temperature, 1.0)
    out = out / temperature[:, None, None]
    vocab = out.shape[-1]
    if params.needs_top_k:
        k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
        kth = out.topk(int(k.max()), dim=-1).values  # [B, S, kmax], descending
        threshold = kth.gather(-1, (k - 1)[:, None, None].expand(-1, out.shape[1], 1))
        out = out.masked_fill(out < threshold, _NEG_INF)
    if params.needs_top_p:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p[:, None, None]
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, _NEG_INF)
    return out


def probabilities(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Processed probabilities [B, S, V] (float32); greedy rows are one-hot at the argmax."""
    probs = process_logits(logits, params).softmax(dim=-1)
    if any(params.greedy_rows):
        greedy = torch.tensor(params.greedy_rows, device=logits.device)
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row from probs [B, V], each row with its own generator -> [B] long."""
    if all(g is None for g in generators):  # global RNG: one batched call
        return torch.multinomial(probs, 1).squeeze(-1)
    picks = [
        torch.multinomial(probs[row], 1, generator=generators[row]) for row in range(probs.shape[0])
    ]
    return torch.cat(picks)


def uniform_rows(
    counts: Sequence[int],
    width: int,
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """[rows, width] uniforms in [0, 1); row i draws only counts[i] from its own generator.

    Drawing exactly as many numbers as the row uses keeps a request's random
    stream independent of the depths of its batch companions. The unused
    tail of a row is 1.0 (never below an acceptance ratio, never used).
    """
    if all(g is None for g in generators):
        return torch.rand((len(counts), width), device=device)
    out = torch.ones((len(counts), width), device=device)
    for row, count in enumerate(counts):
        if count:
            out[row, :count] = torch.rand(count, generator=generators[row], device=device)
    return out


def greedy_verify(
    draft_token_ids: torch.Tensor, target_argmax: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy special case, without probabilities.

    draft_token_ids [B, K], target_argmax [B, K+1], num_draft [B] (row i uses
    its first num_draft[i] drafts). Returns (output [B, K+1], num_accepted [B]);
    row i's committed tokens are output[i, : num_accepted[i] + 1], the rest is -1.
    """
    k = draft_token_ids.shape[1]
    positions = torch.arange(k, device=draft_token_ids.device)
    match = (draft_token_ids == target_argmax[:, :k]) & (positions[None, :] < num_draft[:, None])
    num_accepted = match.to(torch.long).cumprod(dim=1).sum(dim=1)
    return _assemble(target_argmax, num_accepted), num_accepted


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    num_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. / Chen et al.).

    draft_token_ids [B, K]: tokens the draft sampled from draft_probs.
    draft_probs [B, K, V]: the draft's processed distributions q.
    target_probs [B, K+1, V]: the target's processed distributions p, one per
        draft position plus one after the last draft token (for the bonus).
    num_draft [B]: how many of the K drafts row i really proposed (default K).

    Draft token j is accepted with probability min(1, p(x)/q(x)), scanning
    left to right until the first rejection. At a rejection the token is
    resampled from norm(max(0, p - q)) (recovered); if all are accepted, a
    bonus token comes from p at position num_draft. Returns (output [B, K+1],
    num_accepted [B]); row i commits output[i, : num_accepted[i] + 1], and the
    rest of the row is -1.
    """
    rows, k = draft_token_ids.shape
    device = draft_token_ids.device
    if num_draft is None:
        num_draft = torch.full((rows,), k, dtype=torch.long, device=device)
    ids = draft_token_ids[..., None]
    p_draft = target_probs[:, :k].gather(-1, ids).squeeze(-1)
    q_draft = draft_probs.gather(-1, ids).squeeze(-1)
    u = uniform_rows(num_draft.tolist(), k, generators, device)
    positions = torch.arange(k, device=device)
    # u < p/q written without the division (q > 0 for a sampled token).
    accept = (u * q_draft < p_draft) & (positions[None, :] < num_draft[:, None])
    num_accepted = accept.to(torch.long).cumprod(dim=1).sum(dim=1)

    row_index = torch.arange(rows, device=device)
    p_next = target_probs[row_index, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft
    q_next = draft_probs[row_index, num_accepted.clamp(max=k - 1)] if k > 0 else p_next
    residual = (p_next - q_next).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # A zero residual only arises from rounding when p == q; fall back to p.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
    next_probs = torch.where(rejected[:, None], residual, p_next)
    next_tokens = sample_rows(next_probs, generators)

    output = draft_token_ids.new_full((rows, k + 1), -1)
    output[:, :k] = torch.where(positions[None, :] < num_accepted[:, None], draft_token_ids, -1)
    output[row_index, num_accepted] = next_tokens
    return output, num_accepted


def _assemble(target_tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Greedy output: the target's own tokens up to and including position num_accepted."""
    positions = torch.arange(target_tokens.shape[1], device=target_tokens.device)
    return torch.where(positions[None, :] <= num_accepted[:, None], target_tokens, -1)


def draft_sample(
    logits: torch.Tensor, params: SamplingTensors, generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one draft token per row from logits [B, V].

    Returns (tokens [B], processed probs [B, V] or None when every row is
    greedy, where the tokens are the argmax and no probabilities are needed).
    """
    if params.all_greedy:
        return logits.argmax(dim=-1), None
    probs = probabilities(logits[:, None, :], params)[:, 0]
    return sample_rows(probs, generators), probs


def target_sample(
    logits: torch.Tensor, params: SamplingTensors, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One token per row from the target's logits [B, V] (target-only decoding)."""
    if params.all_greedy:
        return logits.argmax(dim=-1)
    probs = probabilities(logits[:, None, :], params)[:, 0]
    return sample_rows(probs, generators)
