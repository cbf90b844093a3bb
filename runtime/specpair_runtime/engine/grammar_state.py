"""One request's grammar position under speculation: drafts are proposed, only accepted tokens stay.

Speculative decoding scores positions past tokens that may be rejected. The
grammar follows the same rule as the KV cache: it advances over committed
tokens, and the drafts of a step are consumed only *tentatively*:

    mask(0)           the mask at the committed state: draft forward 0 and
                      the target's first verified position use it
    propose(d1)       d1 is consumed tentatively; mask(1) is the state after it
    ...               (the draft proposes d2 under mask(1), and so on)
    commit(a, tokens) the step's verdict: the proposals past the a accepted
                      drafts are rolled back, then the committed tokens that
                      are not yet consumed (the recovered or bonus token) are

So the draft's proposals and the target's verification see the same mask at
every position, each computed once, and a rejected draft never moves the
grammar. A token the grammar refuses is never consumed (llguidance's matcher
cannot leave its error state): ``propose`` returns False instead, and the
engine stops that row's drafting there, which is lossless (what the draft
proposes never changes what the target accepts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpair_runtime.engine import token_bitmask
from specpair_runtime.engine.grammar import CompiledGrammar


class GrammarViolation(RuntimeError):
    """A committed token the grammar refuses (the mask should have made that impossible)."""


class GrammarState:
    """A request's matcher, its tentative proposals and the masks of the current step."""

    def __init__(self, grammar: CompiledGrammar, vocab_size: int) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self._matcher = grammar.new_matcher()
        self._proposed = 0  # tokens consumed tentatively in this step
        self._tokens: list[int] = []  # those tokens
        self._masks: list[torch.Tensor | None] = []  # per proposal count, this step

    @property
    def proposed(self) -> int:
        return self._proposed

    @property
    def stopped(self) -> bool:
        """No token can follow the committed ones but an end-of-generation token."""
        return self._proposed == 0 and bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        """The committed tokens form a complete match (an end token may follow)."""
        return self._proposed == 0 and bool(self._matcher.is_accepting())

    def mask(self, after: int) -> torch.Tensor:
        """The bitmask [W] (host int32) after ``after`` of this step's proposals."""
        if not 0 <= after <= self._proposed:
            raise ValueError(f"after must be in [0, {self._proposed}], got {after}")
        while len(self._masks) <= after:
            self._masks.append(None)
        cached = self._masks[after]
        if cached is not None:
            return cached
        row = token_bitmask.allocate(1, self.vocab_size)[0]
        back = self._proposed - after
        if back:  # only when asked out of order: roll back, fill, consume again
            tokens = self._proposals_tail(back)
            self._matcher.rollback(back)
            self._fill(row)
            self._matcher.consume_tokens(tokens)
        else:
            self._fill(row)
        self._masks[after] = row
        return row

    def masks(self, count: int) -> torch.Tensor:
        """[count, W]: the masks after 0, 1, ..., count - 1 proposals."""
        return torch.stack([self.mask(j) for j in range(count)])

    def propose(self, token: int) -> bool:
        """Consume a draft token tentatively; False (nothing consumed) if the grammar refuses it."""
        if not token_bitmask.allows(self.mask(self._proposed), token):
            return False
        if not self._matcher.consume_token(token):
            raise GrammarViolation(self._matcher.get_error())  # the mask allowed it
        self._proposed += 1
        self._tokens.append(token)
        return True

    def commit(self, accepted: int, tokens: Sequence[int]) -> None:
        """The step's committed tokens: the first ``accepted`` proposals, then the rest.

        Proposals past ``accepted`` are rolled back; ``tokens[accepted:]`` are
        consumed. Raises GrammarViolation when the grammar refuses one of them.
        """
        if not 0 <= accepted <= min(self._proposed, len(tokens)):
            raise ValueError(f"accepted must be in [0, {self._proposed}], got {accepted}")
        if self._proposed > accepted:
            self._matcher.rollback(self._proposed - accepted)
        for token in tokens[accepted:]:
            if not self._matcher.validate_tokens([token]):
                raise GrammarViolation(f"the grammar refuses token {token}")
            self._matcher.consume_token(token)
        self._proposed = 0
        self._tokens.clear()
        self._masks.clear()

    def abandon(self) -> None:
        """Roll back every proposal of this step (the step did not run)."""
        self.commit(0, [])

    def _proposals_tail(self, count: int) -> list[int]:
        return self._tokens[len(self._tokens) - count :]

    def _fill(self, row: torch.Tensor) -> None:
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
