"""A request's grammar and penalties as logits processors, the same for draft and target.

Both follow the engine's processor protocol (``process(proposed, logits)``,
``commit(tokens)``): ``logits`` are ``n`` consecutive positions of one row,
the last of which follows every token of ``proposed`` (so position ``i``
follows ``proposed[: len(proposed) - n + 1 + i]``). A verify passes the
row's ``k`` drafts with ``k + 1`` positions; draft forward ``j`` passes the
``j`` drafts so far with one position. Neither keeps anything from
``process``: the grammar's tentative tokens are re-aligned to ``proposed``
on every call (``grammar_state.py``) and the penalties count ``proposed``
afresh (``penalties.py``); both advance only in ``commit``.

Order within a request: penalties and bias first, the grammar's mask last,
so a masked token stays at -inf whatever its bias.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specpair_runtime.engine import token_bitmask
from specpair_runtime.engine.api import LogitsProcessorFactory
from specpair_runtime.engine.grammar import CompiledGrammar
from specpair_runtime.engine.grammar_state import GrammarState
from specpair_runtime.engine.penalties import Penalties, PenaltyRow, apply_penalties


def _first_context(proposed: Sequence[int], positions: int) -> int:
    """How many proposed tokens the first of ``positions`` positions follows."""
    first = len(proposed) - positions + 1
    if first < 0:
        raise ValueError(f"{positions} positions need at least {positions - 1} proposed tokens")
    return first


class GrammarProcessor:
    """Masks every position to what the grammar allows after the tokens before it."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.state = GrammarState(grammar, grammar.vocab_size)
        # Host time in ``process`` and the positions it masked (the benchmark's mask cost).
        self.seconds = 0.0
        self.positions = 0
        # An end token was committed: output past it (``ignore_eos``) is not constrained.
        self._ended = False

    def process(self, proposed: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if self._ended:
            return logits
        start = time.perf_counter()
        try:
            return self._mask(proposed, logits)
        finally:
            self.seconds += time.perf_counter() - start

    def _mask(self, proposed: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        positions = logits.shape[0]
        first = _first_context(proposed, positions)
        # Past a token the grammar refuses nothing is masked: the target rejects
        # that token first, so those positions are never used. Past an end token
        # nothing is masked either, as after a committed one.
        consumed = self.state.align(proposed)
        rows = [i for i in range(positions) if first + i <= consumed]
        masks = [self.state.mask(first + i) for i in rows]
        self.positions += len(rows)
        if not rows:
            return logits
        index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        token_bitmask.apply_bitmask(logits, torch.stack(masks), index)
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        if not self._ended:
            self._ended = self.state.commit(tokens)


class PenaltyProcessor:
    """Presence, frequency and repetition penalties and logit bias, counted per position."""

    def __init__(self, penalties: Penalties, prompt_ids: Sequence[int]) -> None:
        self.penalties = penalties
        self.prompt_ids = list(prompt_ids) if penalties.repetition != 1.0 else []
        self.output_ids: list[int] = []

    def process(self, proposed: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        positions = logits.shape[0]
        first = _first_context(proposed, positions)
        drafts = torch.tensor(list(proposed), dtype=torch.long).to(logits.device)
        row = PenaltyRow(
            self.penalties,
            first_position=0,
            positions=positions,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            draft_start=0,
            drafts_before=first,
        )
        apply_penalties(logits, [row], drafts)
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        if self.penalties.counts_output:
            self.output_ids += tokens


def processor_factories(
    grammar: CompiledGrammar | None, penalties: Penalties, prompt_ids: Sequence[int]
) -> tuple[LogitsProcessorFactory, ...]:
    """A request's ``SamplingParams.logits_processors``: penalties first, the grammar last."""
    factories: list[LogitsProcessorFactory] = []
    if penalties.active:
        prompt = tuple(prompt_ids)
        factories.append(lambda: PenaltyProcessor(penalties, prompt))
    if grammar is not None:
        factories.append(lambda: GrammarProcessor(grammar))
    return tuple(factories)
