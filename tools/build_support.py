"""What every one-time build under ``$SPECPAIR_CACHE`` shares.

Progress lines on stderr, running a command with its output in a log and a
heartbeat, root for a command (sudo where not root), and installing Debian
packages that are missing. The control-plane build, the node and the image
builds all use these.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


class BuildError(RuntimeError):
    """A build step failed; the message holds the command and its output."""


class Progress:
    """Prints ``<prefix> [elapsed] <step>`` lines to stderr."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.start = time.monotonic()

    def elapsed(self) -> str:
        seconds = int(time.monotonic() - self.start)
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def say(self, message: str) -> None:
        print(f"{self.prefix} [{self.elapsed()}] {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        self.say(f"{name} ...")
        yield
        self.say(f"{name}: done in {time.monotonic() - began:.0f}s")


def tail_file(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a file (of its last 16 KiB); "" if unreadable."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _last_line(path: Path) -> str:
    lines = tail_file(path, 1).strip().splitlines()
    return lines[-1] if lines else ""


def run(
    argv: Sequence[str | Path],
    *,
    progress: Progress,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    heartbeat_s: float = 30.0,
    hint: Callable[[], str] | None = None,
    stdin: int | None = subprocess.DEVNULL,
) -> None:
    """Run a command; with `log`, send its output there and print a heartbeat.

    On failure, raise with the tail of the output so the cause is visible.
    """
    args = [str(a) for a in argv]
    if log is None:
        done = subprocess.run(
            args, cwd=cwd, env=env, capture_output=True, text=True, check=False, stdin=stdin
        )
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-4000:]
            raise BuildError(f"`{' '.join(args)}` failed with exit {done.returncode}:\n{tail}")
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=stdin
        )
        while True:
            try:
                code = proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                detail = hint() if hint else _last_line(log)[:140]
                progress.say(f"  still running: {detail}")
    if code != 0:
        raise BuildError(
            f"`{' '.join(args)}` failed with exit {code}; log {log}:\n{tail_file(log, 60)}"
        )


def privileged(argv: list[str]) -> list[str]:
    """Prefix with sudo when not root (CI runners often are not)."""
    if os.geteuid() == 0:
        return argv
    if shutil.which("sudo"):
        return ["sudo", "-n", *argv]
    raise BuildError(f"`{' '.join(argv)}` needs root and sudo is not available")


def missing_debs(packages: Sequence[str]) -> list[str]:
    """The Debian packages of ``packages`` that are not installed."""
    missing = []
    for pkg in packages:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, check=False
        )
        if "install ok installed" not in done.stdout:
            missing.append(pkg)
    return missing


# Another apt run (a second build, unattended upgrades) holds dpkg's lock for a
# while; wait for it instead of failing at once.
APT_LOCK_TIMEOUT_S = 600


def install_debs(packages: Sequence[str], progress: Progress, log: Path) -> None:
    """`apt-get install` whichever of ``packages`` is missing (idempotent)."""
    missing = missing_debs(packages)
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", f"DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"]
    with progress.step(f"apt-get install {' '.join(missing)}"):
        run(privileged(["apt-get", *lock, "update"]), progress=progress, env=env, log=log)
        run(
            privileged(["apt-get", *lock, "install", "-y", "--no-install-recommends", *missing]),
            progress=progress,
            env=env,
            log=log,
        )


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` for the block: one builder at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
