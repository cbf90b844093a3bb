#!/usr/bin/env python3
"""runc, with the container's OOM score adjustment raised to what this machine allows.

The kubelet asks for negative OOM score adjustments (-998 for a pod's
sandbox, -997 for a Guaranteed pod's containers). Lowering the adjustment
needs CAP_SYS_RESOURCE, and some machines (the sandboxed VMs the project is
tested on) withhold that capability even from root. runc then fails every
such container ("can't get final child's PID from pipe"). Where that is so,
the project's dockerd runs this wrapper as its default runtime
(tools/docker_engine.py): for ``create`` and ``run`` it raises
``process.oomScoreAdj`` in the bundle's config.json to this process's own
adjustment (the lowest it may set) and hands over to runc unchanged
otherwise. The only effect: under memory pressure those containers are not
favoured over others by the kernel's OOM killer.

Standard library only: dockerd runs it with the system's python3.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

RUNC = os.environ.get("SPECPAIR_RUNC", "runc")
COMMANDS = ("create", "run")


def bundle_of(args: list[str]) -> Path | None:
    """The ``--bundle``/``-b`` directory of a create/run command line, or None."""
    if not any(a in COMMANDS for a in args):
        return None
    for index, arg in enumerate(args):
        if arg in ("--bundle", "-b") and index + 1 < len(args):
            return Path(args[index + 1])
        if arg.startswith("--bundle="):
            return Path(arg.split("=", 1)[1])
    return Path.cwd()  # runc's default bundle is the working directory


def clamp(config: dict[str, Any], floor: int) -> bool:
    """Raise the process's oomScoreAdj to ``floor``; True when it changed."""
    process = config.get("process")
    if not isinstance(process, dict):
        return False
    wanted = process.get("oomScoreAdj")
    if isinstance(wanted, int) and wanted < floor:
        process["oomScoreAdj"] = floor
        return True
    return False


def own_floor() -> int:
    return int(Path("/proc/self/oom_score_adj").read_text().strip())


def main(args: list[str]) -> None:
    bundle = bundle_of(args)
    config_path = bundle / "config.json" if bundle is not None else None
    if config_path is not None and config_path.is_file():
        config = json.loads(config_path.read_text())
        if clamp(config, own_floor()):
            config_path.write_text(json.dumps(config))
    os.execvp(RUNC, [RUNC, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
