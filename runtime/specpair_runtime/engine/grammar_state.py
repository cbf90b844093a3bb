"""One request's grammar position under speculation: drafts are proposed, only accepted tokens stay.

Speculative decoding scores positions past tokens that may be rejected. The
grammar follows the same rule as the KV cache: it advances over committed
tokens, and the drafts of a step are consumed only *tentatively*:

    align([])          the committed state: draft forward 0 and the target's
                       first verified position use mask(0)
    align([d1])        d1 is consumed tentatively; mask(1) is the state after
                       it (the draft proposes d2 under it, the target verifies
                       position 1 under it)
    ...
    commit(tokens)     the step's verdict: tentative tokens that are not a
                       prefix of ``tokens`` are rolled back, then the rest of
                       ``tokens`` (the recovered or bonus token) is consumed

So the draft's proposals and the target's verification see the same mask at
every position, each computed once, and a rejected draft never moves the
grammar. A token the grammar refuses is never consumed (llguidance's matcher
cannot leave its error state): ``align`` stops before it, and the positions
after it have no mask (the target rejects that draft, so they are never used).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpair_runtime.engine import token_bitmask
from specpair_runtime.engine.grammar import CompiledGrammar


class GrammarViolation(RuntimeError):
    """A committed token the grammar refuses (the mask should have made that impossible)."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    size = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        size += 1
    return size


class GrammarState:
    """A request's matcher, the step's tentative tokens and their masks."""

    def __init__(self, grammar: CompiledGrammar, vocab_size: int) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.end_ids = frozenset(grammar.end_ids)
        self._matcher = grammar.new_matcher()
        self._tokens: list[int] = []  # consumed tentatively in this step
        self._masks: list[torch.Tensor] = []  # _masks[j]: after j tentative tokens

    @property
    def proposed(self) -> int:
        """Tentative tokens consumed."""
        return len(self._tokens)

    @property
    def stopped(self) -> bool:
        """Nothing but an end-of-generation token can follow the committed tokens."""
        return not self._tokens and bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The committed tokens form a complete match (an end token may follow)."""
        return not self._tokens and bool(self._matcher.is_accepting())

    def align(self, proposed: Sequence[int]) -> int:
        """Make the tentative tokens ``proposed``, as far as the grammar allows.

        Returns how many of ``proposed`` are consumed: all of them, or up to
        the first one the grammar refuses or the first end token (allowed,
        but never consumed: it ends the match, and a matcher that consumed one
        does not roll back cleanly).
        """
        keep = _common_prefix(self._tokens, proposed)
        self._rollback_to(keep)
        for token in proposed[keep:]:
            if token in self.end_ids:
                break
            if not token_bitmask.allows(self.mask(len(self._tokens)), token):
                break
            if not self._matcher.consume_token(token):
                raise GrammarViolation(self._matcher.get_error())  # the mask allowed it
            self._tokens.append(token)
        return len(self._tokens)

    def mask(self, after: int) -> torch.Tensor:
        """The bitmask [W] (host int32) after ``after`` of the tentative tokens."""
        if not 0 <= after <= len(self._tokens):
            raise ValueError(f"after must be in [0, {len(self._tokens)}], got {after}")
        if after < len(self._masks):
            return self._masks[after]
        tail = self._tokens[after:]
        if tail:  # skipped earlier: roll back, fill, consume again
            self._matcher.rollback(len(tail))
        row = token_bitmask.allocate(1, self.vocab_size)[0]
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if tail:
            self._matcher.consume_tokens(tail)
        if after == len(self._masks):
            self._masks.append(row)
        return row

    def commit(self, tokens: Sequence[int]) -> bool:
        """The step's committed tokens; the grammar ends up after exactly these.

        Returns True when they hold an end token the grammar allowed: the
        match is complete, and what follows it is not the grammar's. Raises
        GrammarViolation when the grammar refuses one of them.
        """
        consumed = self.align(tokens)
        ended = consumed < len(tokens) and tokens[consumed] in self.end_ids
        if ended and not token_bitmask.allows(self.mask(consumed), tokens[consumed]):
            ended = False
        self._tokens.clear()
        self._masks.clear()
        if consumed < len(tokens) and not ended:
            raise GrammarViolation(f"the grammar refuses token {tokens[consumed]}")
        return ended

    def _rollback_to(self, size: int) -> None:
        extra = len(self._tokens) - size
        if extra > 0:
            self._matcher.rollback(extra)
            del self._tokens[size:]
        del self._masks[size + 1 :]
