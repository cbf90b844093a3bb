"""Why `serve` died: the runtime writes its fatal start-up reason to the termination log.

The real ``specpair-runtime serve`` writes it to the file that
``SPECPAIR_TERMINATION_LOG`` names (as the kubelet's bind mount of
``/dev/termination-log`` would), and never fails because the file cannot be
written. That the kubelet reads it and the operator rolls a crash-looping
revision back with it runs on the real node: tests/e2e/test_node_e2e.py,
scenario 7.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.server_harness import free_port

pytestmark = pytest.mark.integration

DEADLINE_SECONDS = 600  # the rollback must not wait for this


def serve(config: Path, termination_log: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPECPAIR_TERMINATION_LOG": str(termination_log)}
    return subprocess.run(
        [sys.executable, "-m", "specpair_runtime", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def runtime_config(target: Path, draft: Path, **serving: Any) -> dict[str, Any]:
    return {
        "pair": {"name": "t", "version": "v1"},
        "target": {"source": str(target)},
        "draft": {"source": str(draft)},
        "serving": {"host": "127.0.0.1", "port": free_port(), **serving},
    }


def test_serve_writes_why_it_could_not_start(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    empty_key = tmp_path / "api-key"
    empty_key.write_text("")
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump(runtime_config(*pair, apiKeyFile=str(empty_key))))
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet provides an empty file
    done = serve(config, log)
    assert done.returncode != 0
    message = log.read_text()
    assert message.startswith("specpair-runtime serve: ConfigError: ")
    assert "serving.apiKeyFile" in message and "empty" in message

    # Outside a pod the file is usually missing: the same exit, no traceback, no file.
    missing = tmp_path / "no-such-dir" / "termination-log"
    again = serve(config, missing)
    assert again.returncode == done.returncode
    assert "Traceback" not in again.stderr and not missing.exists()
