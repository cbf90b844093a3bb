"""What CPU a benchmark ran on: model name, the ISA torch dispatches to, native bf16.

Benchmark figures depend on the CPU far more than on its core count: on two
vCPUs, a Xeon with AVX-512 and an AMD EPYC with AVX2 only gave target-only
3.08 and 0.96-1.57 tok/s on the same pair, and the int4 draft runs its many-row
calls as bf16 GEMMs only where oneDNN has native bf16 (see
``engine/cpu/int4.py``). So every benchmark report names the CPU.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from specpair_runtime.cgroups import read_text

CPUINFO = Path("/proc/cpuinfo")


def native_bf16_gemm() -> bool:
    """True where oneDNN runs bf16 GEMMs natively (AVX-512 BF16, AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_model(cpuinfo: str) -> str | None:
    """The first ``model name`` of /proc/cpuinfo's text (x86), else ``Hardware``/``CPU part``."""
    for key in ("model name", "Hardware", "CPU part"):
        for line in cpuinfo.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return value.strip()
    return None


def cpu_info(cpuinfo_path: Path = CPUINFO) -> dict[str, object]:
    """``cpu_model``, ``cpu_isa`` (torch's dispatch level, e.g. AVX2, AVX512) and ``bf16_gemm``."""
    return {
        "cpu_model": cpu_model(read_text(cpuinfo_path) or "") or platform.processor() or "unknown",
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),
        "bf16_gemm": native_bf16_gemm(),
    }
