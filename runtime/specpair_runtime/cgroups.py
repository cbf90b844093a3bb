"""Where this process's cgroup limits live: its own cgroup and every cgroup above it.

A limit set anywhere on that path applies to the process. Inside a container
with its own cgroup namespace (the Kubernetes default on cgroup v2) the path
is ``/`` and the mount root is the container's cgroup. Elsewhere (``serve``
under a systemd slice, a nested cgroup, a host without cgroup namespaces)
the mount root is the host's and says "no limit", so the CPU quota
(``cpu_threads.py``) and the memory limit (``server/memory.py``) are both read
along the path that ``/proc/self/cgroup`` names. ``root`` lets tests lay out
their own files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def read_text(path: Path) -> str | None:
    """The file's stripped text, or None when it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def own_paths(root: Path) -> dict[str, str]:
    """The process's cgroup path per hierarchy: "" for v2, else each v1 controller."""
    text = read_text(root / "proc/self/cgroup") or ""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def ancestors(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and every directory above it up to ``mount``, nearest first."""
    parts = [part for part in path.split("/") if part]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def is_unified(root: Path) -> bool:
    """True on cgroup v2 (one hierarchy for every controller)."""
    return (root / "sys/fs/cgroup/cgroup.controllers").exists()


def limit_dirs(root: Path, controller: str, v1_mounts: Sequence[str]) -> list[Path]:
    """The process's cgroup directory and every one above it, nearest first.

    On v2 the unified hierarchy's; on v1 ``controller``'s, under the first of
    ``v1_mounts`` (names below ``/sys/fs/cgroup``) that exists.
    """
    mount = root / "sys/fs/cgroup"
    own = own_paths(root)
    if is_unified(root):
        return ancestors(mount, own.get("", "/"))
    for name in v1_mounts:
        if (mount / name).is_dir():
            return ancestors(mount / name, own.get(controller, "/"))
    return []
