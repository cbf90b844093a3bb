"""The container's termination message: why ``serve`` could not start.

Kubernetes reads a container's termination message from the file at its
``terminationMessagePath`` (``/dev/termination-log`` by default) when the
container exits, and shows it in the pod's status. The operator reads that
message to roll a crash-looping revision back at once, naming the cause,
instead of waiting for the progress deadline. The kubelet keeps at most
4096 bytes of it.

``SPECPAIR_TERMINATION_LOG`` overrides the path (tests; a pod that sets a
different ``terminationMessagePath``). Writing is best effort: outside a pod
the file usually cannot be written, and that must never mask the real error.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PATH = "/dev/termination-log"
PATH_ENV = "SPECPAIR_TERMINATION_LOG"
MAX_BYTES = 4096  # what the kubelet keeps of a termination message


def termination_log_path() -> Path:
    return Path(os.environ.get(PATH_ENV) or DEFAULT_PATH)


def clip(message: str, limit: int = MAX_BYTES) -> bytes:
    """The message as UTF-8, cut to ``limit`` bytes on a character boundary."""
    data = message.strip().encode()
    if len(data) <= limit:
        return data
    return data[: limit - 3].decode(errors="ignore").encode() + b"..."


def write_termination_message(message: str, path: Path | None = None) -> bool:
    """Write ``message`` as the termination message; False (never an error) if it cannot."""
    target = path or termination_log_path()
    try:
        # No O_CREAT: in a pod the kubelet provides the file; elsewhere, a missing
        # /dev/termination-log is left alone. Tests name a path they created.
        with open(target, "r+b") as out:
            out.truncate(0)
            out.write(clip(message))
    except OSError:
        return False
    return True
