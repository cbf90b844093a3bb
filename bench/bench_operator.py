"""Operator benchmark: N pairs on the real v1.20 control plane (etcd, apiserver, controllers).

Starts a loopback control plane (``make control-plane`` builds it), installs
the CRD, starts ``python -m specpair_operator run`` as a real process (with
leader election, as the chart runs it) and measures:

- **time to children and status**: from the first of N ``POST``s of a pair
  until every pair has its ConfigMap, Service and Deployment and a status for
  its generation (median and spread over ``--runs``), and how long the N
  ``POST``s themselves took (the apiserver's pace on this machine: a floor);
- **operator requests per pair** while the pairs are created, by verb and
  resource (``specpair_operator_api_requests_total`` from the operator's own
  ``/metrics``): deterministic, unlike the times on a shared machine;
- **quiet-minute API rate**: ``apiserver_request_total`` from the apiserver's
  own ``/metrics`` over ``--quiet-seconds`` once everything has settled, less
  a baseline window of the same length measured before the operator started
  (the apiserver and controller-manager make a few requests of their own);
  broken down by verb and resource, with the status writes called out;
- **peak RSS** of the operator process (``VmHWM``);
- **delete time**: from deleting every pair until their children are gone
  (the controller-manager's garbage collector does it, at its client's
  default 20 requests/s);
- **failover time**: a second replica on standby; SIGKILL the leader and
  change one pair; seconds until the change reaches its Deployment.

There is no kubelet, so pods stay Pending; nothing here needs them.

    python bench/bench_operator.py                      # 200 pairs
    python bench/bench_operator.py --pairs 1000 --runs 1
    python bench/bench_operator.py --operator-src /tmp/old   # another tree's operator
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tools.apiserver_metrics import RequestKey, delta, request_counts  # noqa: E402
from tools.control_plane import (  # noqa: E402
    Binaries,
    ControlPlane,
    default_cache_dir,
    free_port,
    is_built,
)

NAMESPACE = "bench"
LEASE = "bench-operator"
SELECTOR = "app.kubernetes.io%2Fmanaged-by%3Dspecpair-operator"
PAIRS = f"/apis/specpair.dev/v1alpha1/namespaces/{NAMESPACE}/speculativepairs"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pair_body(index: int) -> dict[str, Any]:
    sample = yaml.safe_load((REPO / "crds/samples/gpu-pair.yaml").read_text())
    spec = sample["spec"]
    spec["resources"] = {"gpus": 1, "gpuMemory": "80Gi"}
    spec.pop("hfTokenSecret", None)
    spec["serving"].pop("apiKeySecret", None)
    return {
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "metadata": {"name": f"pair-{index:04d}"},
        "spec": spec,
    }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        binaries = Binaries.under(default_cache_dir())
        if not is_built(default_cache_dir()):
            raise SystemExit("the control plane is not built: run `make control-plane` first")
        self.binaries = binaries
        self.plane = ControlPlane(binaries, authorization_mode="AlwaysAllow")
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.operators: list[subprocess.Popen[bytes]] = []
        self.metrics_port = free_port()

    # -- plumbing -----------------------------------------------------------------------

    def api(self, method: str, path: str, body: object | None = None) -> dict[str, Any]:
        return dict(self.plane.api(method, path, body))

    def count(self, path: str) -> int:
        found: list[Any] = self.api("GET", path).get("items") or []
        return len(found)

    def kubectl(self, *args: str) -> None:
        config = str(self.plane.kubeconfig_path)
        argv = [str(self.binaries.kubectl), "--kubeconfig", config, *args]
        subprocess.run(argv, check=True, capture_output=True)

    def requests(self) -> Counter[RequestKey]:
        return request_counts(self.plane.server_url, self.plane.admin_token, self.plane.ca_path)

    def operator_requests(self) -> Counter[str]:
        """``specpair_operator_api_requests_total`` of the main operator, by "VERB resource"."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        found: Counter[str] = Counter()
        for line in text.splitlines():
            if not line.startswith("specpair_operator_api_requests_total{"):
                continue
            labels, _, value = line.rpartition(" ")
            pairs = dict(
                part.split("=", 1) for part in labels[labels.index("{") + 1 : -1].split(",")
            )
            key = f"{pairs['verb'].strip(chr(34))} {pairs['resource'].strip(chr(34))}"
            found[key] += int(float(value))
        return found

    def start_operator(self, tag: str, *, election: bool) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "specpair_operator", "run", "--namespace", NAMESPACE]
        port = self.metrics_port if tag == "main" else 0
        argv += ["--resync-seconds", str(self.args.resync_seconds), "--metrics-port", str(port)]
        if election:
            argv += ["--leader-election", "--lease-namespace", NAMESPACE, "--lease-name", LEASE]
        env = {**os.environ, "KUBECONFIG": str(self.plane.kubeconfig_path)}
        if self.args.operator_src:
            src = Path(self.args.operator_src)
            env["PYTHONPATH"] = f"{src / 'operator'}:{src / 'runtime'}"
        with (self.work / f"operator-{tag}.log").open("ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.operators.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.operators:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    @staticmethod
    def peak_rss_mib(process: subprocess.Popen[bytes]) -> float:
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    @staticmethod
    def cpu_seconds(process: subprocess.Popen[bytes]) -> float:
        """User + system CPU time of the process so far."""
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def wait(self, probe: Callable[[], bool], what: str, timeout: float) -> float:
        started = time.monotonic()
        while not probe():
            if time.monotonic() - started > timeout:
                raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.5)
        return time.monotonic() - started

    # -- phases -------------------------------------------------------------------------

    def create_pairs(self) -> tuple[float, float, Counter[str]]:
        """Seconds from the first POST until every pair has children and a status, the
        seconds the POSTs took, and the operator's requests meanwhile."""
        n = self.args.pairs
        before = self.operator_requests()
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: self.api("POST", PAIRS, pair_body(i)), range(n)))
        posted = time.monotonic() - started
        ns = f"/namespaces/{NAMESPACE}"

        def done() -> bool:
            if self.count(f"/apis/apps/v1{ns}/deployments?labelSelector={SELECTOR}") < n:
                return False
            if self.count(f"/api/v1{ns}/services?labelSelector={SELECTOR}") < n:
                return False
            if self.count(f"/api/v1{ns}/configmaps?labelSelector={SELECTOR}") < n:
                return False
            pairs = self.api("GET", PAIRS).get("items") or []
            return all(
                (p.get("status") or {}).get("observedGeneration") == p["metadata"]["generation"]
                for p in pairs
            )

        self.wait(done, "children and status", timeout=60 + n)
        took = time.monotonic() - started
        log(f"  {n} pairs: POSTs took {posted:.1f} s; children and status after {took:.1f} s")
        return took, posted, self.operator_requests() - before

    def settle(self) -> None:
        """Until the Deployment controller is done and the pairs' status is quiet."""

        def deployments_settled() -> bool:
            deps = self.api("GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")["items"]
            return all(
                d["status"].get("observedGeneration") == d["metadata"]["generation"]
                and d["status"].get("replicas") == d["spec"]["replicas"]
                for d in deps
            )

        self.wait(deployments_settled, "the Deployment controller", timeout=300)
        wanted = 2 * self.args.pairs  # the sample's replicas
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
        self.wait(lambda: self.count(pods) >= wanted, "the ReplicaSet controller", timeout=600)
        # The controller-manager posts its Events late (rate-limited): wait for the last.
        events = f"/api/v1/namespaces/{NAMESPACE}/events"
        last, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 10:
            now = self.count(events)
            if now != last:
                last, stable_since = now, time.monotonic()
            time.sleep(1)
        time.sleep(2 * self.args.resync_seconds)

    def window(self, seconds: float) -> Counter[RequestKey]:
        before = self.requests()
        time.sleep(seconds)
        return delta(self.requests(), before)

    def delete_pairs(self) -> float:
        started = time.monotonic()
        self.api("DELETE", PAIRS)
        ns = f"/namespaces/{NAMESPACE}"

        def gone() -> bool:
            return (
                self.count(PAIRS) == 0
                and self.count(f"/apis/apps/v1{ns}/deployments?labelSelector={SELECTOR}") == 0
                and self.count(f"/api/v1{ns}/services?labelSelector={SELECTOR}") == 0
                and self.count(f"/api/v1{ns}/configmaps?labelSelector={SELECTOR}") == 0
            )

        self.wait(gone, "the pairs and their children to go", timeout=120 + 2 * self.args.pairs)
        took = time.monotonic() - started
        log(f"  delete: pairs and children gone after {took:.1f} s")
        return took

    def failover(self, leader: subprocess.Popen[bytes]) -> float:
        """SIGKILL the leader, change a pair; seconds until the standby applied it."""
        standby = self.start_operator("standby", election=True)
        standby_log = self.work / "operator-standby.log"
        # A standby runs long before a failure: wait until it holds its watched copy.
        self.wait(lambda: "primed in" in standby_log.read_text(), "the standby", 300)
        time.sleep(2)
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/pair-0000"
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        killed = time.monotonic()
        patch = json.dumps({"spec": {"replicas": 1}})
        self.kubectl("patch", "spair", "-n", NAMESPACE, "pair-0000", "--type=merge", "-p", patch)
        self.wait(lambda: self.api("GET", path)["spec"]["replicas"] == 1, "the standby", 120)
        took = time.monotonic() - killed
        log(f"  failover: the standby applied a change {took:.1f} s after SIGKILL")
        self.standby = standby
        return took

    def install_crd(self) -> None:
        """The CRD, as the docs say for an apiserver older than 1.25; until Established."""
        kubectl = [str(self.binaries.kubectl), "--kubeconfig", str(self.plane.kubeconfig_path)]
        subprocess.run(
            [*kubectl, "apply", "--validate=false", "-f", str(REPO / "crds")],
            check=True,
            capture_output=True,
        )
        # kubectl wait fails at once on a CRD whose status is not written yet.
        crd = (
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/speculativepairs.specpair.dev"
        )

        def established() -> bool:
            conditions = self.api("GET", crd).get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        self.wait(established, "the CRD Established", 90)

    def create_runs(self, results: dict[str, Any]) -> list[float]:
        """``--runs`` rounds of creating the pairs (deleted between rounds); the deletes' times."""
        args = self.args
        times, posts, deletes = [], [], []
        requests: Counter[str] = Counter()
        for run in range(args.runs):
            log(f"run {run + 1}/{args.runs}")
            time.sleep(3)
            took, posted, sent = self.create_pairs()
            times.append(took)
            posts.append(posted)
            requests = sent  # the last run's (the first also lists the empty namespace)
            if run + 1 < args.runs:
                deletes.append(self.delete_pairs())
        results["timeToChildrenSeconds"] = times
        results["postSeconds"] = posts
        results["operatorRequestsPerPair"] = {
            k: round(v / args.pairs, 2) for k, v in sorted(requests.items())
        }
        results["operatorRequestsPerPairTotal"] = round(sum(requests.values()) / args.pairs, 2)
        return deletes

    def quiet(
        self, baseline: Counter[RequestKey], operator: subprocess.Popen[bytes]
    ) -> dict[str, Any]:
        """Requests beyond the baseline, and the operator's CPU, over a settled window."""
        args = self.args
        cpu_before = self.cpu_seconds(operator)
        window = self.window(args.quiet_seconds)
        quiet_cpu = self.cpu_seconds(operator) - cpu_before
        extra = Counter(
            {k: v - baseline.get(k, 0) for k, v in window.items() if v > baseline.get(k, 0)}
        )
        minutes = args.quiet_seconds / 60
        return {
            "seconds": args.quiet_seconds,
            "requestsPerSecond": round(sum(extra.values()) / args.quiet_seconds, 3),
            "requestsPerPairPerResync": round(
                sum(extra.values()) / args.pairs / (args.quiet_seconds / args.resync_seconds), 4
            ),
            "statusPatchesPerMinute": extra.get(("PATCH", "speculativepairs", "status"), 0)
            / minutes,
            "operatorCpuSeconds": round(quiet_cpu, 2),
            "perMinute": {
                " ".join(filter(None, k)): round(v / minutes, 1)
                for k, v in sorted(extra.items(), key=lambda kv: -kv[1])
            },
            "baselinePerMinute": {
                " ".join(filter(None, k)): round(v / minutes, 1) for k, v in baseline.items()
            },
        }

    def run(self) -> dict[str, Any]:
        args = self.args
        election = args.leader_election
        results: dict[str, Any] = {"pairs": args.pairs, "resyncSeconds": args.resync_seconds}
        self.plane.start()
        try:
            self.install_crd()
            self.plane.ensure_namespace(NAMESPACE)
            time.sleep(5)
            log(f"baseline window ({args.quiet_seconds:.0f} s, no operator, no pairs)")
            baseline = self.window(args.quiet_seconds)
            operator = self.start_operator("main", election=election)
            deletes = self.create_runs(results)
            log("settling")
            self.settle()
            log(f"quiet window ({args.quiet_seconds:.0f} s)")
            results["quiet"] = self.quiet(baseline, operator)
            results["peakRssMiB"] = round(self.peak_rss_mib(operator), 1)
            results["operatorCpuSeconds"] = round(self.cpu_seconds(operator), 1)
            survivor = operator
            if election and args.failover:
                results["failoverSeconds"] = round(self.failover(operator), 1)
                survivor = self.standby
            if args.delete:
                deletes.append(self.delete_pairs())
            results["deleteSeconds"] = deletes
            results["standbyPeakRssMiB"] = (
                round(self.peak_rss_mib(survivor), 1) if survivor is not operator else None
            )
        finally:
            self.stop_all()
            self.plane.stop()
        return results


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f} s (1 run)"
    spread = f"{min(values):.1f}-{max(values):.1f}"
    return f"median {statistics.median(values):.1f} s (range {spread}, {len(values)} runs)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument(
        "--runs", type=int, default=3, help="create/delete rounds (time to children)"
    )
    parser.add_argument("--quiet-seconds", type=float, default=60.0)
    parser.add_argument("--resync-seconds", type=float, default=15.0)
    parser.add_argument("--no-failover", dest="failover", action="store_false")
    parser.add_argument(
        "--no-delete", dest="delete", action="store_false", help="skip the last delete"
    )
    parser.add_argument("--operator-src", default=None, help="a tree with operator/ and runtime/")
    parser.add_argument(
        "--no-leader-election",
        dest="leader_election",
        action="store_false",
        help="for trees whose operator predates --leader-election (no failover either)",
    )
    parser.add_argument("--work", default="/tmp/specpair-bench-operator", help="logs go here")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    bench = Bench(args)
    try:
        results = bench.run()
    except urllib.error.HTTPError as error:
        raise SystemExit(f"API error: {error.code} {error.read()[:300]!r}") from None
    quiet = results["quiet"]
    print(f"pairs: {results['pairs']}, resync every {results['resyncSeconds']:.0f} s")
    print(f"time to children and status: {summary(results['timeToChildrenSeconds'])}")
    print(f"  of which the pairs' own POSTs: {summary(results['postSeconds'])}")
    print(
        f"operator requests per pair while creating: {results['operatorRequestsPerPairTotal']} "
        f"{results['operatorRequestsPerPair']}"
    )
    if results["deleteSeconds"]:
        print(f"delete time: {summary(results['deleteSeconds'])}")
    print(
        f"operator peak RSS: {results['peakRssMiB']} MiB; CPU {results['operatorCpuSeconds']} s "
        f"in all, {quiet['operatorCpuSeconds']} s in the quiet window"
    )
    print(
        f"quiet window {quiet['seconds']:.0f} s: {quiet['requestsPerSecond']} requests/s beyond "
        f"the baseline, {quiet['requestsPerPairPerResync']} per pair per resync, "
        f"{quiet['statusPatchesPerMinute']:.0f} status PATCHes/min"
    )
    print(f"  per minute: {quiet['perMinute']}")
    print(f"  baseline per minute: {quiet['baselinePerMinute']}")
    if "failoverSeconds" in results:
        print(f"failover after SIGKILL: {results['failoverSeconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
