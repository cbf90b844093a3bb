"""Memory-pressure hysteresis, the CPU reading (anonymous memory), the test hook, the pause."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.server.memory import CpuMemory, MemoryProbe, PressureGate
from specpair_runtime.server.scheduler import pause_reason


def test_gate_turns_on_above_threshold_and_off_only_below_the_margin() -> None:
    gate = PressureGate(threshold=0.9, margin=0.05)
    readings = [0.5, 0.9, 0.91, 0.92, 0.88, 0.86, 0.91, 0.84, 0.86, 0.95]
    changes = [gate.update(r) for r in readings]
    # 0.9 itself is not above; 0.88 and 0.86 are inside the band, so no flapping.
    assert changes == [None, None, True, None, None, None, None, False, None, True]
    assert gate.under_pressure


def test_low_threshold_keeps_a_positive_release_point() -> None:
    gate = PressureGate(threshold=0.04, margin=0.05)
    assert gate.release_below == pytest.approx(0.02)
    assert gate.update(0.05) is True
    assert gate.update(0.03) is None
    assert gate.update(0.01) is False


def test_probe_reads_a_real_fraction_and_the_hook_overrides_it() -> None:
    probe = MemoryProbe("cpu")
    real = probe.reading()
    assert 0.0 < real < 1.0
    probe.force(0.99)
    assert probe.reading() == 0.99
    probe.force(None)
    assert 0.0 < probe.reading() < 1.0


def test_a_reading_is_reused_for_max_age_seconds_and_a_forced_one_at_once() -> None:
    now = [100.0]
    probe = MemoryProbe("cpu", max_age=0.05, clock=lambda: now[0])
    measured: list[float] = []

    def measure() -> float:
        measured.append(now[0])
        return 0.1 * len(measured)

    probe._measure = measure  # type: ignore[method-assign]  # count what reaches the files
    assert probe.reading() == pytest.approx(0.1)
    now[0] += 0.049
    assert probe.reading() == pytest.approx(0.1)  # within 50 ms: the files are not read
    now[0] += 0.002
    assert probe.reading() == pytest.approx(0.2)  # 51 ms after the last reading
    probe.force(0.95)
    assert probe.reading() == 0.95  # the test hook never waits
    probe.force(None)
    assert probe.reading() == pytest.approx(0.2) and len(measured) == 2


def test_pause_reason_prefers_memory_pressure_then_batch_size() -> None:
    knobs = SpeculationKnobs(disable_above_batch_size=2)
    assert pause_reason(False, 2, knobs) is None
    assert pause_reason(False, 3, knobs) == "batch_size"
    assert pause_reason(True, 3, knobs) == "memory_pressure"
    assert pause_reason(True, 1, knobs) == "memory_pressure"
    assert pause_reason(False, 100, SpeculationKnobs()) is None


def lay_out(root: Path, files: dict[str, str]) -> CpuMemory:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return CpuMemory(root)


PROC = {
    "proc/meminfo": "MemTotal:       16000000 kB\nMemFree:  100 kB\n",
    "proc/self/status": "VmRSS:\t 9000000 kB\nRssAnon:\t 1000000 kB\nRssFile:\t 8000000 kB\n",
}


def test_cpu_reading_counts_anonymous_memory_not_file_pages(tmp_path: Path) -> None:
    # No cgroup limit: the process's anonymous memory over the system's memory.
    memory = lay_out(tmp_path / "none", PROC)
    assert memory.reading() == pytest.approx(1_000_000 / 16_000_000)
    # cgroup v2 with a limit: the cgroup's anon against it (file pages left out).
    v2 = lay_out(
        tmp_path / "v2",
        {**PROC, "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
         "sys/fs/cgroup/memory.max": "4000000000\n",
         "sys/fs/cgroup/memory.stat": "anon 1000000000\nfile 8000000000\n"},
    )  # fmt: skip
    assert v2.reading() == pytest.approx(0.25) and v2.limit_bytes() == 4_000_000_000
    # cgroup v2 without a limit ("max") falls back to the process and the system.
    unlimited = lay_out(
        tmp_path / "v2max",
        {**PROC, "sys/fs/cgroup/cgroup.controllers": "memory\n",
         "sys/fs/cgroup/memory.max": "max\n"},
    )  # fmt: skip
    assert unlimited.reading() == pytest.approx(1 / 16)
    # cgroup v1: total_rss is the anonymous part.
    v1 = lay_out(
        tmp_path / "v1",
        {**PROC, "sys/fs/cgroup/memory/memory.limit_in_bytes": "2000000000\n",
         "sys/fs/cgroup/memory/memory.stat": "cache 9000000000\ntotal_rss 500000000\n"},
    )  # fmt: skip
    assert v1.reading() == pytest.approx(0.25)


def test_real_probe_ignores_a_memory_mapped_file(tmp_path: Path) -> None:
    """Touching a 64 MiB mapped file grows RSS, not the pressure reading."""
    path = tmp_path / "weights.bin"
    size = 64 << 20
    with path.open("wb") as out:
        out.truncate(size)
    memory = CpuMemory()
    before = memory.reading() * memory.limit_bytes()
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ) as mapped:
        total = sum(mapped[offset] for offset in range(0, size, mmap.PAGESIZE))
        assert total == 0
        grown = memory.reading() * memory.limit_bytes() - before
        rss_file = int(Path("/proc/self/status").read_text().split("RssFile:")[1].split()[0])
        assert rss_file * 1024 >= size  # the pages really are resident
    assert grown < size / 4, grown


def test_cpu_reading_follows_the_process_cgroup_and_the_nearest_limit_wins(
    tmp_path: Path,
) -> None:
    # The mount root says "no limit"; the process's cgroup, two levels down, has one.
    nested = lay_out(
        tmp_path / "v2nested",
        {**PROC, "proc/self/cgroup": "0::/slice/pod\n",
         "sys/fs/cgroup/cgroup.controllers": "memory\n",
         "sys/fs/cgroup/slice/pod/memory.max": "8000000000\n",
         "sys/fs/cgroup/slice/pod/memory.stat": "anon 2000000000\n"},
    )  # fmt: skip
    assert nested.limit_bytes() == 8_000_000_000 and nested.reading() == pytest.approx(0.25)
    # A parent shares its limit with siblings: 9 of its 10 GB are in use, so it is
    # nearer to its limit than the process's own cgroup (2 of 8 GB).
    shared = lay_out(
        tmp_path / "v1shared",
        {**PROC, "proc/self/cgroup": "4:memory:/slice/pod\n2:cpu,cpuacct:/other\n",
         "sys/fs/cgroup/memory/slice/memory.limit_in_bytes": "10000000000\n",
         "sys/fs/cgroup/memory/slice/memory.stat": "total_rss 9000000000\n",
         "sys/fs/cgroup/memory/slice/pod/memory.limit_in_bytes": "8000000000\n",
         "sys/fs/cgroup/memory/slice/pod/memory.stat": "total_rss 2000000000\n"},
    )  # fmt: skip
    assert shared.reading() == pytest.approx(0.9) and shared.limit_bytes() == 10_000_000_000
