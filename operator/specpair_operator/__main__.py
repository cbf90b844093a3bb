"""``python -m specpair_operator``: run the operator, write the CRD, or plan VRAM offline.

    run   [--namespace NS ...] [--metrics-port N] [--metrics-address A]
          [--leader-election [--lease-namespace NS] [--lease-name N] [--lease-seconds S]]
          [--resync-seconds S] [--scrape-seconds S] [--workers N]
          [--log-level debug|info|warning|error] [--liveness URL]
    crds   --output FILE
    plan   -f pair.yaml [--gpu-memory 80Gi] [--gpus-per-node N] [--json]
    render -f pair.yaml [--gpu-memory 80Gi] [--gpus-per-node N] [--namespace NS]

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from specpair_operator import crd
from specpair_operator.api import (
    MAX_GPUS_PER_NODE,
    MAX_MEMORY_BYTES,
    SpecError,
    SpeculativePairSpec,
    memory_bytes,
    name_problem,
    parse_spec,
)
from specpair_operator.builders import PairRef
from specpair_operator.engines.vllm_args import layout
from specpair_operator.headroom import DeviceMemory, device_memory, plan_for_spec
from specpair_operator.render import render
from specpair_runtime.planner import Plan, gib

USAGE_ERROR = 2
LOG_LEVELS = ("debug", "info", "warning", "error")


class UsageError(Exception):
    """Bad input; the message names the field or flag."""


class DoesNotFit(Exception):
    """The pair does not fit its devices: the plan says why, with the numbers."""


DOES_NOT_FIT = 1
# ownerReferences need the pair's uid, which only the apiserver gives (the operator uses it).
PREVIEW_UID = "00000000-0000-0000-0000-000000000000"


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
    plan.add_argument(
        "--gpus-per-node", type=_gpus_per_node, default=None, help="Engine vllm: GPUs of a node."
    )
    plan.add_argument("--json", action="store_true", help="Print JSON.")

    render = sub.add_parser(
        "render", help="Print the child objects the operator would apply, as YAML"
    )
    render.add_argument("-f", "--file", required=True, type=Path, help="SpeculativePair YAML.")
    render.add_argument("--gpu-memory", default=None, help="Memory of one GPU, e.g. 80Gi.")
    render.add_argument(
        "--gpus-per-node", type=_gpus_per_node, default=None, help="Engine vllm: GPUs of a node."
    )
    render.add_argument(
        "--namespace", default=None, help="Namespace (default: the object's, else default)."
    )
    return parser


def _gpus_per_node(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_GPUS_PER_NODE:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_GPUS_PER_NODE}, got {value}")
    return value


def _load_document(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise UsageError(f"-f {path}: cannot read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"-f {path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"-f {path}: expected a SpeculativePair object")
    return data


def _load_spec_document(path: Path) -> object:
    data = _load_document(path)
    # A whole SpeculativePair object or a bare spec.
    return data.get("spec", data)


def smallest_device(
    spec: SpeculativePairSpec, modes: tuple[str, ...], *, cuda: bool, per_node: int | None = None
) -> int:
    """The fewest device bytes for which the planner picks one of ``modes`` (bisection).

    The planner itself decides, so headroom rounding and overheads are counted
    exactly as the operator counts them.
    """
    low, high = 1, MAX_MEMORY_BYTES  # the plan is monotonic in the device size
    while low < high:
        middle = (low + high) // 2
        device = DeviceMemory(middle, "bisection", cuda=cuda)
        if plan_for_spec(spec, device, per_node=per_node).mode in modes:
            high = middle
        else:
            low = middle + 1
    return low


def _device(spec: SpeculativePairSpec, gpu_memory: str | None) -> DeviceMemory | None:
    if gpu_memory is None:
        return device_memory(spec)
    try:
        return DeviceMemory(memory_bytes(gpu_memory), "--gpu-memory", cuda=True)
    except ValueError as error:
        raise UsageError(f"--gpu-memory: {error}") from None


def _parse(path: Path) -> SpeculativePairSpec:
    try:
        return parse_spec(_load_spec_document(path))
    except SpecError as error:
        raise UsageError(str(error)) from None


def plan_command(
    path: Path, gpu_memory: str | None, gpus_per_node: int | None = None
) -> dict[str, Any]:
    """The plan as the JSON-ready dict that ``plan --json`` prints.

    Without a device size (no ``--gpu-memory``, none in the spec) the mode is
    ``Unknown``: the operator then deploys with speculation on and says so in
    ``HeadroomSufficient``. The smallest devices for each mode are always given.
    With ``engine: vllm`` the byte counts are per GPU, and the layout follows.
    """
    spec = _parse(path)
    device = _device(spec, gpu_memory)
    per_node = spec.resources.gpus_per_node or gpus_per_node
    cuda = device.cuda if device is not None else spec.resources.gpus > 0
    smallest = {
        "colocated": smallest_device(spec, ("Colocated",), cuda=cuda, per_node=per_node),
        "targetOnly": smallest_device(
            spec, ("Colocated", "TargetOnly"), cuda=cuda, per_node=per_node
        ),
    }
    extra = {} if spec.engine != "vllm" else {"engine": "vllm", **vllm_layout(spec, None, per_node)}
    if device is None:
        field = "spec.resources.memory" if spec.resources.gpus == 0 else "spec.resources.gpuMemory"
        return {
            "mode": "Unknown",
            "requiredBytes": None,
            "deviceBytes": None,
            "headroomBytes": None,
            "reason": f"device memory unknown: set {field} or pass --gpu-memory (e.g. 80Gi)",
            "minDeviceBytes": smallest,
            **extra,
        }
    result = plan_for_spec(spec, device, per_node=per_node)
    if spec.engine == "vllm":
        extra = {"engine": "vllm", **vllm_layout(spec, result, per_node)}
    return {
        "mode": result.mode,
        "requiredBytes": result.required_bytes,
        "deviceBytes": result.device_bytes,
        "headroomBytes": result.headroom_bytes,
        "reason": result.reason,
        "minDeviceBytes": smallest,
        **extra,
    }


def vllm_layout(
    spec: SpeculativePairSpec, plan: Plan | None, per_node: int | None
) -> dict[str, Any]:
    """The layout part of a vLLM plan: GPUs, nodes, the workload, the per-GPU shares."""
    shape = layout(spec, plan, per_node)
    found: dict[str, Any] = {
        "tensorParallelSize": shape.tensor_parallel_size,
        "pipelineParallelSize": 1,  # never more: vLLM does not speculate with it
        "nodes": shape.nodes,
        "gpusPerPod": shape.gpus_per_pod,
        "workload": "LeaderWorkerSet" if shape.multi_node else "Deployment",
        "gpuMemoryUtilization": shape.gpu_memory_utilization,
    }
    if plan is not None and plan.parallel is not None:
        found["perGpu"] = {
            "targetWeightsBytes": plan.target.weights_bytes,
            "draftWeightsBytes": plan.draft.weights_bytes,
            "kvCacheBytes": plan.target.kv_cache_bytes + plan.draft.kv_cache_bytes,
            "reserveBytes": plan.overhead_bytes,
        }
        found["smallestTensorParallelSize"] = plan.parallel.smallest_tensor_parallel_size
    return found


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
    if plan.get("engine") == "vllm":
        _print_vllm_layout(plan)


def _print_vllm_layout(plan: dict[str, Any]) -> None:
    print("engine:   vllm (byte counts per GPU)")
    print(
        f"layout:   tensor parallel {plan['tensorParallelSize']} over {plan['nodes']} "
        f"node(s) of {plan['gpusPerPod']} GPU(s), pipeline parallel 1, as a {plan['workload']}"
    )
    if plan.get("gpuMemoryUtilization") is not None:
        print(f"vLLM --gpu-memory-utilization: {plan['gpuMemoryUtilization']}")
    shares = plan.get("perGpu")
    if shares:
        print(
            f"per GPU:  target weights {_bytes(shares['targetWeightsBytes'])}, draft weights "
            f"{_bytes(shares['draftWeightsBytes'])}, KV cache {_bytes(shares['kvCacheBytes'])}, "
            f"reserve {_bytes(shares['reserveBytes'])}"
        )
    fewest = plan.get("smallestTensorParallelSize")
    if "smallestTensorParallelSize" in plan:
        print(f"fewest GPUs with the draft: {fewest if fewest is not None else 'none up to 64'}")


def render_command(
    path: Path, gpu_memory: str | None, gpus_per_node: int | None, namespace: str | None
) -> tuple[str, str | None]:
    """(the children as YAML documents, a note for stderr); UsageError where nothing fits."""
    document = _load_document(path)
    spec = _parse(path)
    meta = document.get("metadata") if "spec" in document else None
    meta = meta if isinstance(meta, dict) else {}
    name = str(meta.get("name") or "")
    if not name:
        raise UsageError(
            f"-f {path}: metadata.name is missing: render needs the whole SpeculativePair "
            "(its name names the children)"
        )
    problem = name_problem(name)
    if problem is not None:
        raise UsageError(f"metadata.name: {problem}")
    device = _device(spec, gpu_memory)
    if device is not None and gpus_per_node is not None:
        device = replace(device, gpus_per_node=gpus_per_node)
    pair = PairRef(
        name,
        namespace or str(meta.get("namespace") or "default"),
        str(meta.get("uid") or PREVIEW_UID),
    )
    per_node = spec.resources.gpus_per_node or gpus_per_node
    result = render(pair, spec, device, per_node=per_node)
    if result.refused:
        assert result.plan is not None
        raise DoesNotFit(
            f"the pair does not fit, so the operator creates nothing: {result.plan.reason}"
        )
    note = None
    if device is None:
        note = "device memory unknown: rendered with speculation on, unplanned (pass --gpu-memory)"
    elif result.plan is not None and result.plan.mode == "TargetOnly":
        note = f"TargetOnly: {result.plan.reason}"
    text = yaml.safe_dump_all(list(result.children), sort_keys=False)
    return text, note


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
            _print_plan(plan_command(args.file, args.gpu_memory, args.gpus_per_node), args.json)
        elif args.command == "render":
            text, note = render_command(
                args.file, args.gpu_memory, args.gpus_per_node, args.namespace
            )
            if note is not None:
                print(f"note: {note}", file=sys.stderr)
            sys.stdout.write(text)
        else:
            _run_operator(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except DoesNotFit as error:
        print(f"error: {error}", file=sys.stderr)
        return DOES_NOT_FIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
