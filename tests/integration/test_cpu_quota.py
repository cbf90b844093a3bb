"""A real cgroup CPU quota caps torch's threads in a process started inside it.

Needs a writable cgroup v1 ``cpu`` hierarchy; skips elsewhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cgroups import child_cgroup, run_in_cgroup

pytestmark = pytest.mark.integration

PROBE = (
    "import json, torch; "
    "from specpair_runtime.cpu_threads import apply_cpu_threads; "
    "before = torch.get_num_threads(); threads, why = apply_cpu_threads(None); "
    "print(json.dumps({'before': before, 'threads': threads, 'why': why}))"
)


@pytest.fixture
def one_cpu_cgroup() -> Iterator[Path]:
    """A child of this process's cpu cgroup with a quota of one CPU."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: a one-CPU quota would not cap anything")
    with child_cgroup("cpu", "cpu.cfs_quota_us") as group:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(period))
        yield group


def test_a_process_in_a_one_cpu_cgroup_runs_one_thread(one_cpu_cgroup: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    report = json.loads(run_in_cgroup(one_cpu_cgroup, PROBE, env))
    assert report["before"] >= 2, report  # torch's own default ignores the quota
    assert report["threads"] == 1, report
    assert "CPU quota: 1 CPU;" in report["why"], report
