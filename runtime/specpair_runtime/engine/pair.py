"""Load a target/draft pair, check alignment and build the engine: one way for CLI and server."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specpair_runtime.config import ModelSpec, SpeculationKnobs
from specpair_runtime.engine.alignment import AlignmentReport, check_alignment
from specpair_runtime.engine.loading import LoadedModel, load_model
from specpair_runtime.engine.options import EngineOptions

if TYPE_CHECKING:
    from specpair_runtime.engine.speculative import SpeculativeEngine

log = logging.getLogger(__name__)


@dataclass
class LoadedPair:
    target: LoadedModel
    draft: LoadedModel | None
    alignment: AlignmentReport | None  # None when no draft was loaded
    knobs: SpeculationKnobs
    options: EngineOptions = field(default_factory=EngineOptions)  # KV sizing, step budget

    @property
    def speculation_refused(self) -> str | None:
        """Why this pair can never speculate (no draft, misaligned), or None."""
        if self.draft is None:
            return "no draft model loaded"
        assert self.alignment is not None
        return self.alignment.refusal_reason

    def engine(
        self,
        *,
        speculate: bool = True,
        knobs: SpeculationKnobs | None = None,
        options: EngineOptions | None = None,
    ) -> SpeculativeEngine:
        """A fresh engine over the loaded models; ``speculate=False`` gives target-only.

        ``knobs`` overrides the pair's knobs for this engine (the bench sweeps
        depths); ``options`` overrides the pair's sizing (the CLI sizes the KV
        storage to one request).
        """
        from specpair_runtime.engine.speculative import SpeculativeEngine

        chosen = knobs if knobs is not None else self.knobs
        sizing = options if options is not None else self.options
        if not speculate or self.draft is None:
            return SpeculativeEngine(self.target, None, chosen, options=sizing)
        return SpeculativeEngine(
            self.target,
            self.draft,
            chosen,
            speculation_refused=self.speculation_refused,
            options=sizing,
        )


def check_pair(target: LoadedModel, draft: LoadedModel) -> AlignmentReport:
    """Alignment of two loaded models (tokenizers, plus each model's logits width)."""
    return check_alignment(
        target.tokenizer, draft.tokenizer, target_model=target.model, draft_model=draft.model
    )


def load_pair(
    target_spec: ModelSpec,
    draft_spec: ModelSpec | None,
    knobs: SpeculationKnobs,
    device: str | None = None,
    options: EngineOptions | None = None,
    *,
    keep_plain: bool = False,
) -> LoadedPair:
    """Load both models on one device (never split: moving activations erases the gain).

    ``keep_plain``: keep the plain fp32 weights beside the CPU's packed ones
    (``loading.prepare_model``), for a benchmark's stock-kernel baseline.
    """
    target = load_model(target_spec, "target", device, keep_plain=keep_plain)
    draft = None
    alignment = None
    if draft_spec is not None:
        draft = load_model(draft_spec, "draft", str(target.device), keep_plain=keep_plain)
        alignment = check_pair(target, draft)
        for problem in alignment.problems:
            log.warning("alignment: %s", problem)
        if not alignment.aligned:
            log.warning("speculation refused; decoding with the target only")
    return LoadedPair(target, draft, alignment, knobs, options or EngineOptions())
