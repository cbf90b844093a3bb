"""A real cgroup CPU quota caps torch's threads in a process started inside it.

Needs a writable cgroup v1 ``cpu`` hierarchy (root in a container or VM
whose cgroup filesystem is mounted read-write); skips elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CPU_MOUNT = Path("/sys/fs/cgroup/cpu")
PROBE = (
    "import json, torch; "
    "from specpair_runtime.cpu_threads import apply_cpu_threads; "
    "before = torch.get_num_threads(); threads, why = apply_cpu_threads(None); "
    "print(json.dumps({'before': before, 'threads': threads, 'why': why}))"
)


def _own_cpu_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return CPU_MOUNT / path.lstrip("/")
    return CPU_MOUNT


@pytest.fixture
def one_cpu_cgroup() -> Iterator[Path]:
    """A child of this process's cpu cgroup with a quota of one CPU; removed afterwards."""
    if not (CPU_MOUNT / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: a one-CPU quota would not cap anything")
    group = _own_cpu_cgroup() / f"specpair-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a cgroup ({error})")
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(period))
        yield group
    finally:
        group.rmdir()  # the probe process has exited, so the group is empty


def test_a_process_in_a_one_cpu_cgroup_runs_one_thread(one_cpu_cgroup: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    # The shell joins the cgroup, then becomes the probe: it starts inside the quota.
    command = f'echo $$ > "{one_cpu_cgroup}/cgroup.procs" && exec "{sys.executable}" -c "{PROBE}"'
    done = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["before"] >= 2, report  # torch's own default ignores the quota
    assert report["threads"] == 1, report
    assert "CPU quota: 1 CPU;" in report["why"], report
