"""A real cgroup memory limit is the one the memory-pressure probe reads.

The process's own cgroup sits below the mount root, whose file says "no
limit": the probe must follow ``/proc/self/cgroup``. Needs a writable cgroup
v1 ``memory`` hierarchy; skips elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cgroups import child_cgroup, run_in_cgroup

pytestmark = pytest.mark.integration

LIMIT = 3 << 30  # below this machine's memory, far above what the probe uses
PROBE = (
    "import json; "
    "from specpair_runtime.server.memory import CpuMemory; "
    "memory = CpuMemory(); "
    "print(json.dumps({'limit': memory.limit_bytes(), 'reading': memory.reading()}))"
)


def system_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("MemTotal missing from /proc/meminfo")


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A child of this process's memory cgroup, limited to ``LIMIT`` bytes."""
    if system_memory() <= LIMIT:
        pytest.skip("the machine has no more memory than the test's limit")
    with child_cgroup("memory", "memory.limit_in_bytes") as group:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        yield group


def test_the_probe_reads_the_limit_of_its_own_cgroup(limited_cgroup: Path) -> None:
    report = json.loads(run_in_cgroup(limited_cgroup, PROBE))
    assert report["limit"] == LIMIT, report  # not the machine's memory
    # The probe's own anonymous memory (a Python process) against 3 GiB.
    assert 0 < report["reading"] < 0.1, report
