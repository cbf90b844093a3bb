"""Deployment benchmark on the real node: install, first answer, upgrade, and the image builds.

    python bench/bench_deploy.py --rounds 3                  # deploy rounds on one node
    python bench/bench_deploy.py --rounds 3 --images         # and the image builds
    python bench/bench_deploy.py --rounds 3 --images --no-deploy --json out.json

Each deploy round, on a node started for it (tools/node.py; its start, with
the images already built, is timed too):

1. `helm install --wait` of the chart with the local operator image, then the
   CPU sample pair (the image's demo models): the time until its Service
   first answers a completion (**install → first answer**);
2. a version bump of the pair while a client sends completions one after
   another through the Service: the time until the new revision is Ready
   and alone in service, the old pod stopping (**upgrade**; the v1.20
   kubelet takes another 10-60 s to remove a stopped pod's object), and the
   client's failed requests during it (goal 0);
3. the pair deleted and `helm uninstall`; the node then stops.

With ``--images``: ``make images`` from a cold build (the images, their
build cache and the cached base and wheelhouses removed; Docker itself
installed) and from a warm one (nothing changed), each ``--rounds`` times.

Each figure prints as the median of the rounds with its min and max, beside
the CPU, the load average and the number of cores: the times are wall times
of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.deploy import (
    SteadyClient,
    Tool,
    complete,
    condition,
    get_or_none,
    helm_install,
    helm_uninstall,
    pair_path,
    service_url,
    wait_until,
)
from tools.images import build_images
from tools.node import NodeCluster

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "crds" / "samples" / "cpu-pair.yaml"
NAMESPACE = "bench"
PROMPTS = ["Hello, how can I help you today?", "one two three four five"]


@dataclass
class DeployRound:
    node_start_s: float
    install_to_first_answer_s: float
    upgrade_s: float
    requests_during_upgrade: int
    failed_during_upgrade: int
    failures: list[str] = field(default_factory=list)


def sample_pair(runtime_image: str) -> dict[str, Any]:
    """The CPU sample as shipped, with room for the upgrade's surge pod on 2 cores."""
    body: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    body["spec"]["runtimeImage"] = runtime_image
    body["spec"]["resources"]["cpu"] = "500m"
    return body


def deploy_round(cluster: NodeCluster, kubectl: Tool, helm: Tool, node_start: float) -> DeployRound:
    plane = cluster.plane
    pair = sample_pair(cluster.runtime_image)
    name = pair["metadata"]["name"]
    began = time.monotonic()
    helm_install(helm, cluster.operator_image)
    kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(pair))

    def answered() -> bool:
        try:
            return bool(complete(service_url(plane, NAMESPACE, name), PROMPTS[0], 8)["choices"])
        except (OSError, ValueError, KeyError):
            return False

    wait_until(answered, "the first answer", timeout=600, interval=0.2)
    first_answer = time.monotonic() - began
    old = (get_or_none(plane, pair_path(NAMESPACE, name)) or {})["status"]["currentRevision"]
    with SteadyClient(service_url(plane, NAMESPACE, name), PROMPTS, max_tokens=8) as client:
        began = time.monotonic()
        kubectl(
            "patch",
            "speculativepair",
            name,
            "-n",
            NAMESPACE,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"version": "bench-2"}}),
        )
        wait_until(
            lambda: _settled_on_new(cluster, name, old), "the upgrade", timeout=600, interval=0.2
        )
        upgrade = time.monotonic() - began
    # The node goes with the round; the kubelet's slow removal of pods is not timed.
    kubectl("delete", "speculativepair", name, "-n", NAMESPACE, "--wait=false")
    helm_uninstall(helm)
    sent = client.ok + len(client.failures)
    return DeployRound(
        node_start, first_answer, upgrade, sent, len(client.failures), client.failures
    )


def _pods(cluster: NodeCluster, namespace: str) -> list[Any]:
    found = cluster.plane.api("GET", f"/api/v1/namespaces/{namespace}/pods").get("items")
    return list(found) if isinstance(found, list) else []


def _settled_on_new(cluster: NodeCluster, name: str, old: str) -> bool:
    pair = get_or_none(cluster.plane, pair_path(NAMESPACE, name))
    revision = ((pair or {}).get("status") or {}).get("currentRevision")
    pods = [p for p in _pods(cluster, NAMESPACE) if not p["metadata"].get("deletionTimestamp")]
    return (
        revision not in (None, old)
        and condition(pair, "Ready").get("status") == "True"
        and len(pods) == 1
        and pods[0]["metadata"]["labels"].get("specpair.dev/revision") == revision
    )


def run_deploy(rounds: int) -> list[DeployRound]:
    """Each round on a node of its own, started (and timed) for it."""
    build_images()  # before any clock starts: the node would build stale images
    results = []
    for index in range(rounds):
        began = time.monotonic()
        with NodeCluster() as cluster:
            node_start = time.monotonic() - began
            binaries = cluster.plane.binaries
            kubectl = Tool(binaries.kubectl, cluster.kubeconfig_path, timeout_s=300)
            helm = Tool(binaries.helm, cluster.kubeconfig_path, timeout_s=600)
            cluster.plane.ensure_namespace(NAMESPACE)
            result = deploy_round(cluster, kubectl, helm, node_start)
        print(f"deploy round {index + 1}: {asdict(result)}", file=sys.stderr, flush=True)
        results.append(result)
    return results


def cold_images() -> None:
    """Forget every image build: the images, their build cache, the cached base and wheels."""
    from tools.images import OPERATOR_IMAGE, RUNTIME_CPU_IMAGE, default_cache_dir

    cache = default_cache_dir().expanduser().resolve()
    docker, _ = build_images(cache_dir=cache)
    names = docker.run("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    ours = [n for n in names if n in (RUNTIME_CPU_IMAGE, OPERATOR_IMAGE)]
    ours += [n for n in names if n.startswith("specpair/base:")]
    docker.run("rmi", "--force", *ours)
    docker.run("image", "prune", "--force")
    for folder in (cache / "images" / "base", cache / "wheelhouse"):
        shutil.rmtree(folder, ignore_errors=True)


def run_images(rounds: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"cold": [], "cached": []}
    for index in range(rounds):
        cold_images()
        began = time.monotonic()
        build_images()
        timings["cold"].append(time.monotonic() - began)
        began = time.monotonic()
        build_images()
        timings["cached"].append(time.monotonic() - began)
        print(f"images round {index + 1}: {timings}", file=sys.stderr, flush=True)
    return timings


def spread(values: list[float]) -> str:
    if not values:
        return "not run"
    return (
        f"median {statistics.median(values):.1f} s "
        f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)})"
    )


def conditions() -> dict[str, object]:
    from specpair_runtime.hardware import cpu_info

    return {
        "cpu": cpu_info(),
        "cores": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", action="store_true", help="also time make images")
    parser.add_argument("--no-deploy", action="store_true", help="only the image builds")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the node cleanly, as on Ctrl-C
    report: dict[str, Any] = {}
    if not args.no_deploy:
        rounds = run_deploy(args.rounds)
        report["deploy"] = [asdict(r) for r in rounds]
        print("start --node (warm):    ", spread([r.node_start_s for r in rounds]))
        print("install -> first answer:", spread([r.install_to_first_answer_s for r in rounds]))
        print("upgrade:                ", spread([r.upgrade_s for r in rounds]))
        failed = [r.failed_during_upgrade for r in rounds]
        sent = [r.requests_during_upgrade for r in rounds]
        print(f"failed during upgrade:   {failed} of {sent} requests (goal 0)")
    if args.images:
        timings = run_images(args.rounds)
        report["images"] = timings
        print("make images, cold:      ", spread(timings["cold"]))
        print("make images, cached:    ", spread(timings["cached"]))
    report["conditions"] = conditions()
    print(f"conditions: {report['conditions']}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
