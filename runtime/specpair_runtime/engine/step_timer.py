"""Draft and target time of one step, without extra host syncs."""

from __future__ import annotations

import time

import torch


def _cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


class StepTimer:
    """Seconds before and after ``mark`` (the draft's part and the target's part).

    On the CPU wall time is compute time. On CUDA the host runs ahead, so the
    boundaries are CUDA events, read after the step's one sync.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self.middle = self.start
        self.events: list[torch.cuda.Event] = []
        if self.cuda:
            self.events.append(_cuda_event())

    def mark(self) -> None:
        self.middle = time.perf_counter()
        if self.cuda:
            self.events.append(_cuda_event())

    def split(self) -> tuple[float, float]:
        """(seconds before the mark, seconds after it)."""
        if not self.cuda:
            return self.middle - self.start, time.perf_counter() - self.middle
        end = _cuda_event()
        end.synchronize()  # already reached: the step's results were read
        start, middle = self.events
        return start.elapsed_time(middle) / 1e3, middle.elapsed_time(end) / 1e3
