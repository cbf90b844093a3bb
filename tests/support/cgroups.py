"""Real cgroup v1 children for tests: made under this process's own cgroup, always removed.

Needs a writable cgroup v1 hierarchy (root in a container or VM whose cgroup
filesystem is mounted read-write); the tests that use it skip elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

V1_ROOT = Path("/sys/fs/cgroup")


def own_v1_cgroup(controller: str) -> Path:
    """This process's cgroup directory in the v1 hierarchy of ``controller``."""
    mount = V1_ROOT / controller
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return mount / path.lstrip("/")
    return mount


@contextlib.contextmanager
def child_cgroup(controller: str, needs: str) -> Iterator[Path]:
    """A new child of this process's ``controller`` cgroup; skips the test when the
    hierarchy lacks the file ``needs`` or is not writable. Removed afterwards."""
    if not (V1_ROOT / controller / needs).exists():
        pytest.skip(f"no cgroup v1 {controller} hierarchy at {V1_ROOT / controller}")
    group = own_v1_cgroup(controller) / f"specpair-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a cgroup ({error})")
    try:
        yield group
    finally:
        group.rmdir()  # the process run in it has exited, so the group is empty


def run_in_cgroup(group: Path, code: str, env: dict[str, str] | None = None) -> str:
    """Run ``python -c code`` as a process that starts inside ``group``; its last stdout line."""
    # The shell joins the cgroup, then becomes the Python process.
    command = f'echo $$ > "{group}/cgroup.procs" && exec "{sys.executable}" -c "{code}"'
    done = subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]
