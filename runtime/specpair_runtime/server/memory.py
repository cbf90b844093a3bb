"""Memory-pressure probe and the hysteresis gate that turns readings into pauses.

CUDA: the caching allocator's reserved bytes over the device's total memory.

CPU: anonymous memory (heap, KV caches, tensors) over the cgroup limit (of
the process's own cgroup or any above it, whichever is nearest to its
limit), or the process's anonymous memory over the system's memory when no
cgroup limit is set. File-backed pages (memory-mapped safetensors weights) are left
out: the kernel can drop and re-read them, and counting them made a large
target look like pressure before a single request ran.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from specpair_runtime.cgroups import is_unified, limit_dirs, read_text

# cgroup v1 reports "no limit" as a huge page-aligned number.
_UNLIMITED = 1 << 60


def _read_int(path: Path) -> int | None:
    text = read_text(path)
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _UNLIMITED else None


def _field(path: Path, name: str, scale: int = 1) -> int | None:
    """``name value`` (memory.stat) or ``Name: value kB`` (/proc files), times ``scale``."""
    for line in (read_text(path) or "").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].rstrip(":") == name:
            return int(parts[1]) * scale
    return None


@dataclass(frozen=True)
class CpuMemory:
    """Where the CPU reading comes from; ``root`` lets tests lay out their own files."""

    root: Path = Path("/")

    @cached_property
    def _layout(self) -> tuple[list[Path], str, str]:
        """(the process's cgroup directories, nearest first, the limit file, the
        anonymous-memory field of memory.stat): found once, the path does not change."""
        if is_unified(self.root):
            return limit_dirs(self.root, "", ()), "memory.max", "anon"
        # v1's total_rss is anonymous memory (and swap cache), not file pages.
        return limit_dirs(self.root, "memory", ("memory",)), "memory.limit_in_bytes", "total_rss"

    def _cgroup(self) -> tuple[int, int] | None:
        """(anonymous bytes, limit) of the cgroup nearest to its limit, on the process's
        cgroup path (``cgroups.py``); None when no cgroup on it sets a limit."""
        directories, limit_file, anon_field = self._layout
        nearest: tuple[int, int] | None = None
        for directory in directories:
            limit = _read_int(directory / limit_file)
            anon = None if limit is None else _field(directory / "memory.stat", anon_field)
            if limit is None or anon is None:
                continue
            # A cgroup's memory.stat counts the cgroups below it, so an ancestor's
            # reading includes siblings that share its limit.
            if nearest is None or anon / limit > nearest[0] / nearest[1]:
                nearest = (anon, limit)
        return nearest

    def _system_memory(self) -> int:
        total = _field(self.root / "proc/meminfo", "MemTotal", 1024)
        if total is None:
            raise RuntimeError("MemTotal missing from /proc/meminfo")
        return total

    def limit_bytes(self) -> int:
        cgroup = self._cgroup()
        return cgroup[1] if cgroup is not None else self._system_memory()

    def reading(self) -> float:
        """Anonymous memory in use as a fraction of the limit."""
        cgroup = self._cgroup()
        if cgroup is not None:
            return cgroup[0] / cgroup[1]
        anon = _field(self.root / "proc/self/status", "RssAnon", 1024)
        if anon is None:
            raise RuntimeError("RssAnon missing from /proc/self/status")
        # No cgroup limit: the path was just walked, limit_bytes() would walk it again.
        return anon / self._system_memory()


class MemoryProbe:
    """Fraction of device memory in use, with a test hook to force a reading.

    The scheduler asks twice a step, and a CPU reading reads several cgroup
    and /proc files (about 0.07-0.18 ms on 2 cores, a few percent of a small
    model's step), so a reading younger than ``max_age`` seconds is reused:
    memory that grows within 50 ms is caught at the next one.
    """

    def __init__(
        self,
        device: str = "cpu",
        max_age: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self.max_age = max_age
        self._clock = clock
        self._forced: float | None = None
        self._last: tuple[float, float] | None = None  # (when, reading)
        self._lock = threading.Lock()
        self._cpu = CpuMemory()

    def force(self, fraction: float | None) -> None:
        """Test hook: report ``fraction`` until called again with None."""
        with self._lock:
            self._forced = fraction

    def reading(self) -> float:
        with self._lock:
            if self._forced is not None:
                return self._forced
            last = self._last
        now = self._clock()
        if last is not None and now - last[0] < self.max_age:
            return last[1]
        value = self._measure()
        with self._lock:
            self._last = (now, value)
        return value

    def _measure(self) -> float:
        if self.device.startswith("cuda"):
            import torch

            device = torch.device(self.device)
            total = torch.cuda.get_device_properties(device).total_memory
            # Reserved (cached) blocks count: they are not free for other use.
            return float(torch.cuda.memory_reserved(device)) / total
        return self._cpu.reading()


@dataclass
class PressureGate:
    """Hysteresis: on above ``threshold``, off only below ``threshold - margin``."""

    threshold: float
    margin: float = 0.05
    under_pressure: bool = False

    @property
    def release_below(self) -> float:
        # A low threshold still gets a usable release point.
        return self.threshold - min(self.margin, self.threshold / 2)

    def update(self, reading: float) -> bool | None:
        """Feed one reading; return the new state when it changed, else None."""
        if not self.under_pressure and reading > self.threshold:
            self.under_pressure = True
            return True
        if self.under_pressure and reading < self.release_below:
            self.under_pressure = False
            return False
        return None
