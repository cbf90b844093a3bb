"""``python -m specpair_operator``: run the operator, write the CRD, or plan VRAM offline.

    run   [--namespace NS ...] [--metrics-port N] [--metrics-address A]
          [--leader-election [--lease-namespace NS] [--lease-name N] [--lease-seconds S]]
          [--resync-seconds S] [--scrape-seconds S] [--workers N]
          [--log-level debug|info|warning|error] [--liveness URL]
    crds  --output FILE
    plan  -f pair.yaml [--gpu-memory 80Gi] [--json]

Bad input prints one line naming the field and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specpair_operator import crd
from specpair_operator.api import (
    MAX_MEMORY_BYTES,
    SpecError,
    SpeculativePairSpec,
    memory_bytes,
    parse_spec,
)
from specpair_operator.headroom import DeviceMemory, device_memory, plan_for_spec
from specpair_runtime.planner import gib

USAGE_ERROR = 2
LOG_LEVELS = ("debug", "info", "warning", "error")


class UsageError(Exception):
    """Bad input; the message names the field or flag."""


SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _own_namespace() -> str:
    """The pod's namespace (env POD_NAMESPACE, or the mounted service account), else default."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


@dataclass(frozen=True)
class EnvFlag:
    """A ``run`` flag that defaults to an environment variable.

    ``run`` writes the parsed value back to that variable: handlers.py reads its
    settings from the environment, so that ``kopf run -m specpair_operator.handlers``
    behaves the same.
    """

    flag: str
    env: str
    default: str
    help: str
    type: Callable[[str], object] = str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        # argparse converts a string default with `type`, and reports a bad one naming the flag.
        default = os.environ.get(self.env) or self.default
        parser.add_argument(self.flag, type=self.type, default=default, help=self.help)

    def export(self, args: argparse.Namespace) -> None:
        os.environ[self.env] = str(getattr(args, self.dest))


RUN_FLAGS = (
    EnvFlag(
        "--metrics-port",
        "SPECPAIR_METRICS_PORT",
        "8080",
        "Port of /metrics (0 = off; env SPECPAIR_METRICS_PORT).",
        int,
    ),
    EnvFlag(
        "--metrics-address",
        "SPECPAIR_METRICS_ADDRESS",
        "127.0.0.1",
        "Address of /metrics; use 0.0.0.0 in a pod (env SPECPAIR_METRICS_ADDRESS).",
    ),
    EnvFlag(
        "--lease-namespace",
        "SPECPAIR_LEASE_NAMESPACE",
        "",  # resolved by `_own_namespace` when the operator starts
        "Namespace of the Lease (env SPECPAIR_LEASE_NAMESPACE; default: the pod's own "
        "namespace, else default).",
    ),
    EnvFlag(
        "--lease-name",
        "SPECPAIR_LEASE_NAME",
        "specpair-operator",
        "Name of the Lease (env SPECPAIR_LEASE_NAME).",
    ),
    EnvFlag(
        "--lease-seconds",
        "SPECPAIR_LEASE_SECONDS",
        "8",
        "Lease duration: a killed leader is replaced within 1.5x this (default 8).",
        int,
    ),
    EnvFlag(
        "--workers",
        "SPECPAIR_WORKERS",
        "4",
        "Reconcile worker threads (env SPECPAIR_WORKERS; default 4).",
        int,
    ),
    EnvFlag(
        "--resync-seconds",
        "SPECPAIR_RESYNC_SECONDS",
        "15",
        "Interval of the level-based resync over every pair (from the watched copy; "
        "it sends no request for a pair in line with its spec).",
        float,
    ),
    EnvFlag(
        "--scrape-seconds",
        "SPECPAIR_SCRAPE_SECONDS",
        "30",
        "Interval of the acceptance scrape of the pods' /metrics.",
        float,
    ),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specpair-operator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run the operator")
    env_ns = os.environ.get("SPECPAIR_WATCH_NAMESPACES", "")
    run.add_argument(
        "--namespace",
        action="append",
        default=[n for n in env_ns.split(",") if n],
        help="Watch only this namespace (repeatable; env SPECPAIR_WATCH_NAMESPACES, comma "
        "separated). Default: all namespaces.",
    )
    run.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("SPECPAIR_LEADER_ELECTION", "") in ("1", "true"),
        help="Elect one active replica through a coordination.k8s.io Lease (for replicas > 1; "
        "env SPECPAIR_LEADER_ELECTION=1). Default: off, this replica acts alone.",
    )
    for flag in RUN_FLAGS:
        flag.add_to(run)
    run.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=os.environ.get("SPECPAIR_LOG_LEVEL", "info").lower(),
        help="Log level (env SPECPAIR_LOG_LEVEL; default info).",
    )
    run.add_argument(
        "--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz"
    )

    crds = sub.add_parser("crds", help="Write the CRD YAML generated from the API models")
    crds.add_argument("--output", required=True, type=Path, help="File to write.")

    plan = sub.add_parser("plan", help="Print the VRAM plan of a SpeculativePair offline")
    plan.add_argument("-f", "--file", required=True, type=Path, help="SpeculativePair YAML.")
    plan.add_argument("--gpu-memory", default=None, help="Memory of one GPU, e.g. 80Gi.")
    plan.add_argument("--json", action="store_true", help="Print JSON.")
    return parser


def _load_spec_document(path: Path) -> object:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise UsageError(f"-f {path}: cannot read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"-f {path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"-f {path}: expected a SpeculativePair object")
    # A whole SpeculativePair object or a bare spec.
    return data.get("spec", data)


def smallest_device(spec: SpeculativePairSpec, modes: tuple[str, ...], *, cuda: bool) -> int:
    """The fewest device bytes for which the planner picks one of ``modes`` (bisection).

    The planner itself decides, so headroom rounding and overheads are counted
    exactly as the operator counts them.
    """
    low, high = 1, MAX_MEMORY_BYTES  # the plan is monotonic in the device size
    while low < high:
        middle = (low + high) // 2
        if plan_for_spec(spec, DeviceMemory(middle, "bisection", cuda=cuda)).mode in modes:
            high = middle
        else:
            low = middle + 1
    return low


def plan_command(path: Path, gpu_memory: str | None) -> dict[str, Any]:
    """The plan as the JSON-ready dict that ``plan --json`` prints.

    Without a device size (no ``--gpu-memory``, none in the spec) the mode is
    ``Unknown``: the operator then deploys with speculation on and says so in
    ``HeadroomSufficient``. The smallest devices for each mode are always given.
    """
    try:
        spec = parse_spec(_load_spec_document(path))
    except SpecError as error:
        raise UsageError(str(error)) from None
    device: DeviceMemory | None
    if gpu_memory is not None:
        try:
            device = DeviceMemory(memory_bytes(gpu_memory), "--gpu-memory", cuda=True)
        except ValueError as error:
            raise UsageError(f"--gpu-memory: {error}") from None
    else:
        device = device_memory(spec)
    cuda = device.cuda if device is not None else spec.resources.gpus > 0
    smallest = {
        "colocated": smallest_device(spec, ("Colocated",), cuda=cuda),
        "targetOnly": smallest_device(spec, ("Colocated", "TargetOnly"), cuda=cuda),
    }
    if device is None:
        field = "spec.resources.memory" if spec.resources.gpus == 0 else "spec.resources.gpuMemory"
        return {
            "mode": "Unknown",
            "requiredBytes": None,
            "deviceBytes": None,
            "headroomBytes": None,
            "reason": f"device memory unknown: set {field} or pass --gpu-memory (e.g. 80Gi)",
            "minDeviceBytes": smallest,
        }
    result = plan_for_spec(spec, device)
    return {
        "mode": result.mode,
        "requiredBytes": result.required_bytes,
        "deviceBytes": result.device_bytes,
        "headroomBytes": result.headroom_bytes,
        "reason": result.reason,
        "minDeviceBytes": smallest,
    }


def _bytes(value: int | None) -> str:
    return "unknown" if value is None else f"{gib(value)} ({value} bytes)"


def _print_plan(plan: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(plan, indent=2))
        return
    print(f"mode:     {plan['mode']}")
    print(f"required: {_bytes(plan['requiredBytes'])}")
    print(f"device:   {_bytes(plan['deviceBytes'])}")
    print(f"headroom: {_bytes(plan['headroomBytes'])}")
    print(f"reason:   {plan['reason']}")
    smallest = plan["minDeviceBytes"]
    print(f"smallest device with the draft (Colocated): {_bytes(smallest['colocated'])}")
    print(f"smallest device for the target alone (TargetOnly): {_bytes(smallest['targetOnly'])}")


def _run_operator(args: argparse.Namespace) -> None:
    if args.log_level not in LOG_LEVELS:  # argparse does not check an env default
        raise UsageError(
            f"SPECPAIR_LOG_LEVEL: {args.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
        )
    args.lease_namespace = args.lease_namespace or _own_namespace()
    # handlers.py reads these at import; set them first.
    for flag in RUN_FLAGS:
        flag.export(args)
    os.environ["SPECPAIR_WATCH_NAMESPACES"] = ",".join(args.namespace)
    os.environ["SPECPAIR_LEADER_ELECTION"] = "1" if args.leader_election else ""
    identity = f"{socket.gethostname()}-{os.getpid()}"
    os.environ["SPECPAIR_IDENTITY"] = identity
    import kopf

    import specpair_operator.handlers  # noqa: F401  (registers the handlers)

    # kopf's own logging setup, then the chosen level on the root logger.
    kopf.configure(debug=args.log_level == "debug", verbose=args.log_level == "debug")
    logging.getLogger().setLevel(args.log_level.upper())
    if args.log_level != "debug":
        # kopf logs every watch event it hands to a handler ("Handler ... succeeded").
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Standalone for kopf: it only watches; the controller's Lease decides who acts.
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        identity=identity,  # type: ignore[arg-type]  # kopf's Identity is a NewType of str
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "crds":
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(crd.render_crd())
            print(f"wrote {args.output}")
        elif args.command == "plan":
            _print_plan(plan_command(args.file, args.gpu_memory), args.json)
        else:
            _run_operator(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
