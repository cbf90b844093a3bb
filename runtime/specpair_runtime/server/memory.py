"""Memory-pressure probe and the hysteresis gate that turns readings into pauses.

CUDA: the caching allocator's reserved bytes over the device's total memory.
CPU: the process's resident memory over the cgroup limit, or over the
system's memory when the cgroup sets none.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

CGROUP_V2_MAX = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
# cgroup v1 reports "no limit" as a huge page-aligned number.
_UNLIMITED = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _UNLIMITED else None


def _system_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemTotal missing from /proc/meminfo")


def _rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def cpu_memory_limit_bytes() -> int:
    """The cgroup limit when one is set, else the system's memory."""
    return _read_int(CGROUP_V2_MAX) or _read_int(CGROUP_V1_LIMIT) or _system_total_bytes()


class MemoryProbe:
    """Fraction of device memory in use, with a test hook to force a reading."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._forced: float | None = None
        self._lock = threading.Lock()
        self._cpu_limit = cpu_memory_limit_bytes() if device == "cpu" else 0

    def force(self, fraction: float | None) -> None:
        """Test hook: report ``fraction`` until called again with None."""
        with self._lock:
            self._forced = fraction

    def reading(self) -> float:
        with self._lock:
            if self._forced is not None:
                return self._forced
        if self.device.startswith("cuda"):
            import torch

            device = torch.device(self.device)
            total = torch.cuda.get_device_properties(device).total_memory
            # Reserved (cached) blocks count: they are not free for other use.
            return float(torch.cuda.memory_reserved(device)) / total
        return _rss_bytes() / self._cpu_limit


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
