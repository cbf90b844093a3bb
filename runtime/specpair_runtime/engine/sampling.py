"""Logits processing and lossless rejection sampling over a flat batch.

Layout (vLLM's rejection sampler): a step has ``R`` rows (requests). Row r
proposed ``num_draft[r]`` draft tokens (0 for a plain decode step or the end of
a prefill); they lie back to back in ``draft_token_ids [D]`` (``D = sum
num_draft``), and the target scored ``num_draft[r] + 1`` positions per row,
back to back in ``[D + R, V]``. The offsets come from ``FlatLayout``.

The target accepts a prefix of each row's drafts (*accepted* tokens); at the
first rejection a *recovered* token is sampled from ``norm(max(0, p - q))``;
when all are accepted a *bonus* token is sampled from the target's
distribution after the last draft token. A row without drafts just samples
from p (target-only decoding is the special case ``num_draft = 0``).

Every probability is a *processed* distribution: the same temperature / top-k
/ top-p is applied to target and draft logits, so the output follows the
target's processed distribution exactly (Leviathan et al. 2023, Chen et al.
2023). A temperature below ``SAMPLING_EPS`` is greedy: one-hot distributions,
a draft token is accepted iff it is the target's argmax.

Random numbers: rows share batched draws from the global generator
(``rejection_sample``, ``sample_rows``; a row may bring its own
``torch.Generator`` instead). A request with a seed is sampled differently,
so that its output is a function of the seed and the target alone: its token
at output position ``t`` is ``argmax(log p_t + g_t)``, the Gumbel-max trick,
with Gumbel noise ``g_t`` drawn from a generator keyed by (seed, t)
(``race_noise``, computed as the equivalent exponential race). The draft
proposes with the same noise (``argmax(log q_t + g_t)``), a draft token is
accepted iff it is the target's token there, and the first mismatch commits
the target's own token (``coupled_tokens`` beside ``greedy_verify``). Every
committed token is then the target's own
Gumbel-max sample given the committed tokens before it, so the output is
distributed exactly as the target's processed distribution, and identical
whatever the depth, the draft, the batch or the timing; a draft token is
accepted a little less often than under rejection sampling (which couples p
and q optimally), and only there.

Nothing here synchronises with the host; the engine reads the results once
per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpair_runtime.engine.api import SamplingParams

# vLLM's _SAMPLING_EPS: a temperature below it is greedy. Dividing logits by
# anything smaller risks float32 overflow (1e-38 turns every logit into inf),
# and the distribution is one-hot to float32 precision long before that.
SAMPLING_EPS = 1e-5

_NEG_INF = float("-inf")


def is_greedy_temperature(temperature: float) -> bool:
    return temperature < SAMPLING_EPS


@dataclass(frozen=True)
class FlatLayout:
    """Offsets of a flat step; built on the host from ``num_draft`` (no device sync)."""

    num_draft: list[int]  # per row
    draft_start: list[int]  # per row: offset in the flat draft tokens
    target_start: list[int]  # per row: offset in the flat target positions

    @staticmethod
    def of(num_draft: Sequence[int]) -> FlatLayout:
        draft_start, target_start = [], []
        d = t = 0
        for n in num_draft:
            draft_start.append(d)
            target_start.append(t)
            d += n
            t += n + 1
        return FlatLayout(list(num_draft), draft_start, target_start)

    @property
    def rows(self) -> int:
        return len(self.num_draft)

    @property
    def max_draft(self) -> int:
        return max(self.num_draft, default=0)

    @property
    def total_draft(self) -> int:
        return sum(self.num_draft)

    def draft_rows(self) -> list[int]:
        """The row of every flat draft token."""
        return [r for r, n in enumerate(self.num_draft) for _ in range(n)]

    def draft_target_index(self) -> list[int]:
        """The target position that scores every flat draft token."""
        return [
            t + j for t, n in zip(self.target_start, self.num_draft, strict=True) for j in range(n)
        ]

    def draft_offset(self) -> list[int]:
        """Every flat draft token's index within its row."""
        return [j for n in self.num_draft for j in range(n)]

    def target_rows(self) -> list[int]:
        """The row of every flat target position."""
        return [r for r, n in enumerate(self.num_draft) for _ in range(n + 1)]


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling parameters per flat logits position (built from host lists, no sync).

    temperature [N] float (1 where greedy), top_k [N] long (0 = off),
    top_p [N] float, greedy [N] bool.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    max_top_k: int

    @staticmethod
    def build(
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        device: torch.device,
    ) -> SamplingTensors:
        greedy = [is_greedy_temperature(t) for t in temperatures]
        temps = [1.0 if g else float(t) for g, t in zip(greedy, temperatures, strict=True)]
        packed = torch.tensor([temps, list(top_ps), greedy], dtype=torch.float32).to(device)
        return SamplingTensors(
            temperature=packed[0],
            top_k=torch.tensor(list(top_ks), dtype=torch.long).to(device),
            top_p=packed[1],
            greedy=packed[2].bool(),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_top_k=any(k > 0 for k in top_ks),
            needs_top_p=any(p < 1.0 for p in top_ps),
            max_top_k=max(top_ks, default=0),
        )

    @staticmethod
    def for_rows(
        params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device
    ) -> SamplingTensors:
        """The parameters of ``positions[r]`` consecutive positions of each row ``r``."""
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        for p, count in zip(params, positions, strict=True):
            temps += [p.temperature] * count
            top_ks += [p.top_k] * count
            top_ps += [p.top_p] * count
        return SamplingTensors.build(temps, top_ks, top_ps, device)

    def select(self, index: torch.Tensor, host_index: Sequence[int]) -> SamplingTensors:
        """The parameters of some positions (``index`` and ``host_index`` name the same ones)."""
        greedy = self.greedy.index_select(0, index)
        return SamplingTensors(
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            greedy=greedy,
            all_greedy=self.all_greedy,
            any_greedy=self.any_greedy,
            needs_top_k=self.needs_top_k,
            needs_top_p=self.needs_top_p,
            max_top_k=self.max_top_k,
        )


def process_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF's order) on logits [N, V]; float32 out.

    Masked tokens get -inf. Greedy positions are left unscaled (``probabilities``
    makes them one-hot). Top-p keeps the smallest set of most likely tokens
    whose probability reaches ``top_p`` (always at least one token).
    """
    out = logits.float() / params.temperature[:, None]
    vocab = out.shape[-1]
    if params.needs_top_k:
        widest = min(params.max_top_k, vocab)
        k = params.top_k.clamp(min=1, max=widest)
        kth = out.topk(widest, dim=-1).values.gather(-1, (k - 1)[:, None])
        kth = torch.where(params.top_k > 0, kth[:, 0], _NEG_INF)[:, None]  # 0 = off
        out = out.masked_fill(out < kth, _NEG_INF)
    if params.needs_top_p:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p[:, None]
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, _NEG_INF)
    return out


def probabilities(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Processed probabilities [N, V] (float32); greedy positions are one-hot at the argmax."""
    probs = process_logits(logits, params).softmax(dim=-1)
    if params.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(params.greedy[:, None], one_hot, probs)
    return probs


def finite_rows(probs: torch.Tensor) -> torch.Tensor:
    """[N] bool: the position's distribution is usable (finite, non-negative, positive mass)."""
    finite = torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1)
    return finite & (probs.sum(dim=-1) > 0)


def sanitize(probs: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Replace unusable rows by a one-hot at token 0, so sampling never raises.

    The caller reports such rows as errors (the token is never committed).
    """
    fallback = torch.zeros_like(probs)
    fallback[:, 0] = 1.0
    return torch.where(ok[:, None], probs, fallback)


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [N, V]; seeded rows use their own generator -> [N] long."""
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.multinomial(probs, 1).squeeze(-1)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        index = torch.tensor(shared, device=probs.device)
        out[index] = torch.multinomial(probs.index_select(0, index), 1).squeeze(-1)
    for i in seeded:
        out[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return out


_MASK = 2**64 - 1


def _splitmix(value: int) -> int:
    """One splitmix64 round: a well-mixed 64-bit function of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def race_noise(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[V] float32 Exp(1) noise of output position ``position`` of a seeded request.

    A function of (seed, position) alone; the positions' noises are independent.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix(_splitmix(seed & _MASK) ^ position) >> 1)
    # -log(u) for u in [0, 1): in (0, inf], so p / E is never NaN (u = 0 gives inf,
    # a token that cannot win). Five times faster than exponential_ on the CPU.
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float32, device=device)
    return uniform.log_().neg_()


def coupled_tokens(probs: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """The seeded tokens [n] of n consecutive positions from ``first_position`` on.

    ``probs`` [n, V]: a processed distribution (the target's p or the draft's
    q) at each position. The token is ``argmax(p / E)`` with ``E`` Exp(1)
    noise (``race_noise``): the exponential race, the Gumbel-max trick in
    the form vLLM samples with (``-log E`` is Gumbel noise), so it is a sample
    of p; a token of probability 0 is never chosen.
    """
    noise = torch.stack(
        [
            race_noise(seed, first_position + i, probs.shape[-1], probs.device)
            for i in range(probs.shape[0])
        ]
    )
    return (probs.float() / noise).argmax(dim=-1)


def uniforms(
    layout: FlatLayout, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[D] uniforms in [0, 1), one per flat draft token.

    A seeded row draws exactly num_draft[r] numbers from its own generator, so
    its random stream does not depend on its batch companions.
    """
    if all(g is None for g in generators):
        return torch.rand(layout.total_draft, device=device)
    parts = []
    for n, generator in zip(layout.num_draft, generators, strict=True):
        if n:
            parts.append(torch.rand(n, generator=generator, device=device))
    return torch.cat(parts) if parts else torch.empty(0, device=device)


@dataclass(frozen=True)
class StepIndex:
    """Device copies of a layout's index vectors (one host-to-device copy)."""

    draft_row: torch.Tensor  # [D]
    draft_target: torch.Tensor  # [D]
    draft_offset: torch.Tensor  # [D]
    target_row: torch.Tensor  # [D + R]
    num_draft: torch.Tensor  # [R]
    draft_start: torch.Tensor  # [R]
    target_start: torch.Tensor  # [R]

    @staticmethod
    def of(layout: FlatLayout, device: torch.device) -> StepIndex:
        flat = torch.tensor(
            [
                *layout.draft_rows(),
                *layout.draft_target_index(),
                *layout.draft_offset(),
                *layout.target_rows(),
            ],
            dtype=torch.long,
        )
        per_row = torch.tensor(
            [layout.num_draft, layout.draft_start, layout.target_start], dtype=torch.long
        )
        flat, per_row = flat.to(device), per_row.to(device)
        d = layout.total_draft
        return StepIndex(
            flat[:d],
            flat[d : 2 * d],
            flat[2 * d : 3 * d],
            flat[3 * d :],
            per_row[0],
            per_row[1],
            per_row[2],
        )


def _accepted_counts(accept: torch.Tensor, index: StepIndex, rows: int) -> torch.Tensor:
    """Per row, the number of leading accepted drafts (the first rejection's offset)."""
    first_reject = torch.where(accept, index.num_draft[index.draft_row], index.draft_offset)
    counts = index.num_draft.clone()
    if first_reject.numel():
        counts.scatter_reduce_(0, index.draft_row, first_reject, reduce="amin", include_self=True)
    return counts


def _assemble(
    draft_token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    next_tokens: torch.Tensor,
    index: StepIndex,
    layout: FlatLayout,
) -> torch.Tensor:
    """[R, K+1]: accepted drafts, then the recovered/bonus token, then -1."""
    rows, k = layout.rows, layout.max_draft
    output = torch.full((rows, k + 1), -1, dtype=torch.long, device=num_accepted.device)
    if draft_token_ids.numel():
        keep = index.draft_offset < num_accepted[index.draft_row]
        values = torch.where(keep, draft_token_ids, -1)
        output[index.draft_row, index.draft_offset] = values
    output[torch.arange(rows, device=output.device), num_accepted] = next_tokens
    return output


def greedy_verify(
    draft_token_ids: torch.Tensor, target_argmax: torch.Tensor, index: StepIndex, layout: FlatLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-greedy case, without probabilities.

    draft_token_ids [D]; target_argmax [D + R]. Returns (output [R, K+1],
    num_accepted [R]); row r commits output[r, : num_accepted[r] + 1].
    """
    accept = draft_token_ids == target_argmax.index_select(0, index.draft_target)
    num_accepted = _accepted_counts(accept, index, layout.rows)
    next_tokens = target_argmax.index_select(0, index.target_start + num_accepted)
    return _assemble(draft_token_ids, num_accepted, next_tokens, index, layout), num_accepted


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    index: StepIndex,
    layout: FlatLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over the flat batch (Leviathan et al. / Chen et al.).

    draft_token_ids [D]: tokens the draft sampled from draft_probs [D, V] (q).
    target_probs [D + R, V]: the target's processed distributions p.
    Draft token j of a row is accepted with probability min(1, p(x)/q(x)),
    left to right until the first rejection; then the recovered token comes
    from norm(max(0, p - q)), or the bonus token from p when all were accepted.
    Returns (output [R, K+1], num_accepted [R]); row r commits
    output[r, : num_accepted[r] + 1], the rest is -1.
    """
    device = target_probs.device
    rows = layout.rows
    if layout.total_draft:
        assert draft_probs is not None
        ids = draft_token_ids[:, None]
        p_draft = target_probs.index_select(0, index.draft_target).gather(-1, ids).squeeze(-1)
        q_draft = draft_probs.gather(-1, ids).squeeze(-1)
        u = uniforms(layout, generators, device)
        # u < p/q without the division (q > 0 for a sampled token).
        accept = u * q_draft < p_draft
        num_accepted = _accepted_counts(accept, index, rows)
    else:
        num_accepted = torch.zeros(rows, dtype=torch.long, device=device)
    p_next = target_probs.index_select(0, index.target_start + num_accepted)  # [R, V]
    if layout.total_draft:
        assert draft_probs is not None
        rejected = num_accepted < index.num_draft
        q_index = index.draft_start + torch.minimum(
            num_accepted, (index.num_draft - 1).clamp(min=0)
        )
        q_next = draft_probs.index_select(0, q_index.clamp(max=draft_probs.shape[0] - 1))
        residual = (p_next - q_next).clamp(min=0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # A zero residual only arises from rounding when p == q; fall back to p.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    next_tokens = sample_rows(p_next, generators)
    return _assemble(draft_token_ids, num_accepted, next_tokens, index, layout), num_accepted


def draft_sample(
    logits: torch.Tensor, params: SamplingTensors, generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of logits [N, V] -> (tokens [N], processed probs [N, V] or None).

    All-greedy rows need no probabilities: the token is the argmax. A row
    whose draft distribution is unusable proposes token 0 with q one-hot
    there, which stays lossless (the target decides) and never raises.
    """
    if params.all_greedy:
        return logits.argmax(dim=-1), None
    probs = probabilities(logits, params)
    probs = sanitize(probs, finite_rows(probs))
    return sample_rows(probs, generators), probs


def draft_confidence(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    probs: torch.Tensor | None,
    params: SamplingTensors,
) -> torch.Tensor:
    """The draft's probability of each drafted token [N], for the confidence stop.

    ``logits`` [N, V] and ``tokens`` [N] as ``draft_sample`` took and gave them;
    ``probs`` its processed probabilities (None when every row is greedy). A
    sampled row reads q, the distribution it drew from; a greedy row reads the
    plain softmax (its q is one-hot), so a greedy row stops where it would
    alone, whatever it is batched with.
    """
    index = tokens[:, None]
    plain = torch.softmax(logits.float(), dim=-1).gather(1, index)[:, 0]
    if probs is None:
        return plain
    return torch.where(params.greedy, plain, probs.gather(1, index)[:, 0])
