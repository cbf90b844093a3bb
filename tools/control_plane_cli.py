"""Build, start or inspect the real Kubernetes control plane used by the tests.

    python -m tools.control_plane_cli build   # once; later runs return at once
    python -m tools.control_plane_cli start [--rbac]  # foreground until Ctrl-C / SIGTERM
    python -m tools.control_plane_cli status

The logic lives in tools/control_plane.py; this is its command line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.control_plane import (
    K8S_VERSION,
    Binaries,
    BuildError,
    ControlPlane,
    ControlPlaneError,
    build,
    default_cache_dir,
    is_built,
)

STATE_FILE = "control-plane.json"


def _state_path(cache: Path) -> Path:
    return cache / "run" / STATE_FILE


def cmd_build(cache: Path) -> int:
    started = time.monotonic()
    try:
        binaries = build(cache)
    except BuildError as err:
        print(f"control plane build failed: {err}", file=sys.stderr)
        return 1
    for name, path in binaries.all().items():
        print(f"{name}: {path}")
    print(f"built in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def cmd_start(cache: Path, rbac: bool) -> int:
    if not is_built(cache):
        print(f"not built under {cache}: run `make control-plane` first", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_stop)
    plane = ControlPlane(
        Binaries.under(cache), authorization_mode="RBAC" if rbac else "AlwaysAllow"
    )
    state = _state_path(cache)
    try:
        plane.start()
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "server": plane.server_url,
                    "kubeconfig": str(plane.kubeconfig_path),
                    "authorization_mode": plane.authorization_mode,
                }
            )
        )
        print(f"export KUBECONFIG={plane.kubeconfig_path}", flush=True)
        print(f"# {plane.server_url}, {plane.authorization_mode}; Ctrl-C stops it", file=sys.stderr)
        while plane.running():
            time.sleep(1)
        print("a control plane process exited:\n" + plane.log_tails(), file=sys.stderr)
        return 1
    except (_Stop, KeyboardInterrupt):
        return 0
    except ControlPlaneError as err:
        print(str(err), file=sys.stderr)
        return 1
    finally:
        plane.stop()
        state.unlink(missing_ok=True)


def cmd_status(cache: Path) -> int:
    binaries = Binaries.under(cache)
    print(f"cache: {cache}")
    print(f"kubernetes {K8S_VERSION}: {'built' if is_built(cache) else 'NOT built'}")
    for name, path in binaries.all().items():
        print(f"  {name}: {path} ({'ok' if os.access(path, os.X_OK) else 'missing'})")
    state = _state_path(cache)
    if state.is_file():
        info = json.loads(state.read_text())
        try:
            os.kill(int(info["pid"]), 0)
            print(f"running (pid {info['pid']}): {info['server']}, {info['authorization_mode']}")
            print(f"export KUBECONFIG={info['kubeconfig']}")
        except ProcessLookupError:
            print("not running (stale state file)")
    else:
        print("not running")
    return 0 if is_built(cache) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help="default: $SPECPAIR_CACHE or ~/.cache/specpair"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build and cache the binaries (idempotent)")
    start = sub.add_parser("start", help="run a control plane in the foreground")
    start.add_argument("--rbac", action="store_true", help="--authorization-mode=RBAC")
    sub.add_parser("status", help="show what is built and running")
    args = parser.parse_args(argv)
    cache = (args.cache or default_cache_dir()).expanduser().resolve()
    if args.command == "build":
        return cmd_build(cache)
    if args.command == "start":
        return cmd_start(cache, args.rbac)
    return cmd_status(cache)


if __name__ == "__main__":
    sys.exit(main())
