"""How many threads torch's CPU kernels get: the CPUs this process may really use.

torch sizes its intra-op pool from the CPUs it can see, not from the
container's CPU quota. A pod limited to 2 CPUs on a 64-core node would run a
thread per core, and the kernel's CFS quota would stop the whole pod for most
of every period. So without a configured count the runtime caps torch's
default at the cgroup's quota (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us``
over ``cpu.cfs_period_us`` in v1; the smallest over the process's cgroup and
those above it), rounded down and at least one.

A parallel op ends only when its last thread does, so a thread without a
core stalls the whole op. Measured on 2 cores (Xeon, AVX-512) with the tiny
Llama pair's target, 8 decoding rows plus a 32-token prompt chunk, while a
busy loop held one core: 4.7 ms a step on 2 threads against 1.3 ms on 1
(1.55 and 1.27 ms without the busy loop; ``bench/bench_cpu_threads.py``).
``serving.cpuThreads`` pins the count; docs/operations.md has the trade.

``OMP_NUM_THREADS``, when set, is torch's own knob and is left alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specpair_runtime.cgroups import is_unified, limit_dirs, read_text

CONFIG_FIELD = "serving.cpuThreads"


@dataclass(frozen=True)
class ThreadPlan:
    """The intra-op thread count to set (None: keep torch's) and why, for the log."""

    threads: int | None
    reason: str


def _quota(quota: str | None, period: str | None) -> float | None:
    """CPUs from a quota and a period in microseconds; None when unlimited or unreadable."""
    if quota is None or period is None or quota in ("max", "-1"):
        return None
    try:
        cpus = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return cpus if cpus > 0 else None


def cgroup_cpu_limit(root: Path = Path("/")) -> float | None:
    """The CPUs the process's cgroup may use per period (a fraction allowed), or None.

    Reads the process's own cgroup (``/proc/self/cgroup``) and every cgroup
    above it, and takes the smallest quota. Inside a container with its own
    cgroup namespace the path is ``/``: the mount root is the container's.
    ``root`` lets tests lay out their own files.
    """
    limits: list[float] = []
    if is_unified(root):
        for directory in limit_dirs(root, "", ()):
            parts = (read_text(directory / "cpu.max") or "").split()  # "max 100000"
            limit = _quota(parts[0], parts[1]) if len(parts) == 2 else None
            limits += [limit] if limit is not None else []
    else:
        for directory in limit_dirs(root, "cpu", ("cpu", "cpu,cpuacct")):
            quota = read_text(directory / "cpu.cfs_quota_us")
            limit = _quota(quota, read_text(directory / "cpu.cfs_period_us"))
            limits += [limit] if limit is not None else []
    return min(limits) if limits else None


def plan_cpu_threads(
    configured: int | None,
    environ: Mapping[str, str],
    torch_default: int,
    cpu_limit: float | None,
) -> ThreadPlan:
    """The thread count: configured, else ``OMP_NUM_THREADS``, else torch's capped by the quota."""
    if configured is not None:
        return ThreadPlan(configured, f"{CONFIG_FIELD} is {configured}")
    if "OMP_NUM_THREADS" in environ:
        value = environ["OMP_NUM_THREADS"]
        return ThreadPlan(None, f"OMP_NUM_THREADS is {value!r}: torch's own setting")
    if cpu_limit is not None and cpu_limit < torch_default:
        threads = max(1, math.floor(cpu_limit))
        cpus = f"{cpu_limit:g} CPU" + ("" if cpu_limit == 1 else "s")
        return ThreadPlan(
            threads, f"the cgroup's CPU quota: {cpus}; torch's default: {torch_default}"
        )
    return ThreadPlan(None, f"torch's default: {torch_default}; no lower CPU quota")


def apply_cpu_threads(configured: int | None, root: Path = Path("/")) -> tuple[int, str]:
    """Set torch's intra-op threads for this process; returns (threads in force, reason).

    Call it before the models load: every thread started later gets the count.
    """
    import torch

    plan = plan_cpu_threads(configured, os.environ, torch.get_num_threads(), cgroup_cpu_limit(root))
    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    return torch.get_num_threads(), plan.reason
