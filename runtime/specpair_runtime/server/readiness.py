"""Readiness: what /readyz reports while the pair loads and checks itself.

Ready only after both models are loaded, the alignment check passes,
when configured the golden prompts pass, and on CUDA every graph step shape
is captured. Until then the body says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

Phase = Literal[
    "loading", "checking_alignment", "golden_prompts", "warming_up", "ready", "failed", "draining"
]


@dataclass(frozen=True)
class ReadinessState:
    phase: Phase
    reason: str

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def body(self) -> dict[str, object]:
        return {"ready": self.ready, "phase": self.phase, "reason": self.reason}


class Readiness:
    """Thread-safe holder: the loader thread writes, HTTP handlers read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = ReadinessState("loading", "loading the target and draft models")

    def set(self, phase: Phase, reason: str) -> None:
        with self._lock:
            # A failure or a drain is final: later progress must not hide it.
            if self._state.phase in ("failed", "draining") and phase != "draining":
                return
            self._state = ReadinessState(phase, reason)

    @property
    def state(self) -> ReadinessState:
        with self._lock:
            return self._state
