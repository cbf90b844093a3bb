"""A group of named child processes, each logging to its own file, stopped in order.

The control plane (tools/control_plane.py) and the node (tools/node.py) run
their daemons through it: `spawn` starts one with its output in
``<dir>/<name>.log``, `wait` polls a readiness check and fails at once,
with the log tails, when any process of the group has exited, and `stop`
sends SIGTERM (then SIGKILL) in the given order.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from tools.build_support import tail_file


def die_with_parent() -> None:
    """Children get SIGTERM if the process that started them dies, so none is orphaned."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class ProcessExited(RuntimeError):
    """A process of the group exited while another was awaited; holds the log tails."""


class ProcessGroup:
    """Named processes that log to ``<log_dir>/<name>.log``."""

    def __init__(self, log_dir: Path, stop_timeout_s: float = 15.0) -> None:
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_files: list[IO[bytes]] = []

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        log = self.log_path(name).open("ab")
        self._log_files.append(log)
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd or self.log_dir,
            env=env,
            preexec_fn=die_with_parent,
        )
        self.procs[name] = proc
        return proc

    def wait(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``ready`` until true; raise TimeoutError or ProcessExited with the logs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc_name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ProcessExited(
                        f"{proc_name} exited with {proc.returncode} while waiting for {name}:\n"
                        + self.log_tails(first=proc_name)
                    )
            if ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"{name} not ready after {timeout_s:.0f}s:\n" + self.log_tails())

    def log_tails(self, lines: int = 25, first: str | None = None) -> str:
        """The last lines of each process's log, ``first``'s log first."""
        names = sorted(self.procs, key=lambda n: n != first)
        return "\n".join(
            f"--- {self.log_path(n)} (last {lines} lines) ---\n{tail_file(self.log_path(n), lines)}"
            for n in names
        )

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs.values())

    def stop_one(self, name: str, timeout_s: float | None = None) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=timeout_s or self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()

    def stop(self, order: Sequence[str] = ()) -> None:
        """Stop ``order`` first, in that order, then the rest (newest first). Safe to repeat."""
        rest = [n for n in reversed(list(self.procs)) if n not in order]
        for name in [*order, *rest]:
            self.stop_one(name)
        for log in self._log_files:
            with contextlib.suppress(Exception):
                log.close()
        self._log_files.clear()
        self.procs.clear()
