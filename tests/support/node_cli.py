"""`python -m tools.control_plane_cli start --node`, run as a user runs it.

`NodeProcess` starts the command, waits for the ``export KUBECONFIG=...`` line
it prints once the node is Ready and the images are in its Docker, and stops
it with SIGTERM. Where the command says this machine cannot run a node (exit
status 2), `start` raises `NodeUnavailable` with its reason.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tools.build_support import tail_file
from tools.node import NodeUnavailable

ROOT = Path(__file__).resolve().parents[2]
EXPORT = "export KUBECONFIG="
UNAVAILABLE = "this machine cannot run the node: "


class NodeProcess:
    """The CLI's node in a child process; always `stop()` it."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.process: subprocess.Popen[str] | None = None
        self.kubeconfig: Path | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self, timeout_s: float = 1800.0) -> Path:
        """The kubeconfig the command printed; raises NodeUnavailable or AssertionError."""
        with self.log.open("ab") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tools.control_plane_cli", "start", "--node"],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=os.environ.copy(),
            )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith(EXPORT):
                self.kubeconfig = Path(line.removeprefix(EXPORT).strip())
                return self.kubeconfig
        code = self.process.wait(timeout=60) if self.process.poll() is None else None
        code = self.process.returncode if code is None else code
        text = tail_file(self.log, 40)
        if code == 2 and UNAVAILABLE in text:
            reason = text.split(UNAVAILABLE, 1)[1].splitlines()[0]
            raise NodeUnavailable(reason)
        raise AssertionError(f"start --node printed no {EXPORT}... (exit {code}):\n{text}")

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 180.0) -> int | None:
        """SIGTERM, as a user's Ctrl-C or a service manager would; the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode
