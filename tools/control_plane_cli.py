"""Build, start or inspect the real Kubernetes control plane used by the tests.

    python -m tools.control_plane_cli build   # once; later runs return at once
    python -m tools.control_plane_cli start [--rbac]  # foreground until Ctrl-C / SIGTERM
    python -m tools.control_plane_cli start --node    # plus a real node (root, Docker)
    python -m tools.control_plane_cli status

`start` prints `export KUBECONFIG=...` once it is ready. With `--node` that
is once the Node is Ready (kubelet, kube-scheduler, kube-proxy, CNI) and the
images (`make images`) are in its Docker daemon; RBAC is on. SIGTERM stops
everything it started. The logic lives in tools/control_plane.py and
tools/node.py; this is their command line.
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
from tools.node import NODE_NAME, NodeCluster, NodeError, NodeUnavailable

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


def _write_state(
    cache: Path, server: str, kubeconfig: Path, mode: str, docker_host: str | None = None
) -> Path:
    """What `status` shows, and where the node's Docker is (``docker_host``, with --node)."""
    state = _state_path(cache)
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "server": server,
                "kubeconfig": str(kubeconfig),
                "authorization_mode": mode,
                "node": docker_host is not None,
                "docker_host": docker_host,
            }
        )
    )
    return state


def cmd_start_node(cache: Path, runtime_image: str | None, operator_image: str | None) -> int:
    signal.signal(signal.SIGTERM, _raise_stop)
    cluster = NodeCluster(cache, runtime_image=runtime_image, operator_image=operator_image)
    state = _state_path(cache)
    try:
        cluster.start()
        _write_state(
            cache, cluster.plane.server_url, cluster.kubeconfig_path, "RBAC", cluster.docker.host
        )
        print(f"export KUBECONFIG={cluster.kubeconfig_path}", flush=True)
        print(
            f"# node {NODE_NAME} Ready; {cluster.plane.server_url}, RBAC; images "
            f"{cluster.runtime_image}, {cluster.operator_image} in the node's Docker "
            f"({cluster.docker.host}); Ctrl-C stops it",
            file=sys.stderr,
        )
        while cluster.running():
            time.sleep(1)
        print("a node process exited:\n" + cluster.log_tails(), file=sys.stderr)
        return 1
    except (_Stop, KeyboardInterrupt):
        return 0
    except NodeUnavailable as err:
        print(f"this machine cannot run the node: {err}", file=sys.stderr)
        return 2
    except (NodeError, ControlPlaneError) as err:
        print(str(err), file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        state.unlink(missing_ok=True)


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
        _write_state(cache, plane.server_url, plane.kubeconfig_path, plane.authorization_mode)
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
            node = f" with a node on {info['docker_host']}" if info.get("node") else ""
            print(
                f"running{node} (pid {info['pid']}): {info['server']}, {info['authorization_mode']}"
            )
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
    start.add_argument(
        "--node",
        action="store_true",
        help="also a real node: kubelet on Docker, kube-scheduler, kube-proxy, CNI (RBAC on)",
    )
    start.add_argument("--runtime-image", default=None, help="with --node: the CPU runtime image")
    start.add_argument("--operator-image", default=None, help="with --node: the operator image")
    sub.add_parser("status", help="show what is built and running")
    args = parser.parse_args(argv)
    cache = (args.cache or default_cache_dir()).expanduser().resolve()
    if args.command == "build":
        return cmd_build(cache)
    if args.command == "start" and args.node:
        return cmd_start_node(cache, args.runtime_image, args.operator_image)
    if args.command == "start":
        return cmd_start(cache, args.rbac)
    return cmd_status(cache)


if __name__ == "__main__":
    sys.exit(main())
