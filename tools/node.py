"""A real Kubernetes node beside the loopback control plane: kubelet, scheduler, proxy.

`NodeCluster` starts, in order:

1. the project's Docker daemon (tools/docker_engine.py) and the pod network's
   bridge (tools/node_network.py);
2. the control plane (tools/control_plane.py) with its apiserver on the
   node address, RBAC on;
3. ``kube-scheduler``; the ``kubelet`` v1.20 with dockershim on that daemon
   and CNI (Debian's bridge and host-local plugins); ``kube-proxy`` in
   iptables mode, so Service ClusterIPs answer from the host;

and is ready when the Node reports Ready, kube-proxy has synced, and the
images are in the daemon. `stop()` undoes all of it: it stops the
processes, removes the containers and volumes of every pod the kubelet ran,
unmounts and deletes the kubelet's directories, and removes the bridge and
the iptables chains.

One node runs on a machine at a time (kube-proxy owns the KUBE-* chains, the
kubelet its cgroups); a second waits for the first's lock, or says who holds
it. Its state lives under ``$SPECPAIR_CACHE/node`` (the kubelet's root, the
logs) and ``/run/specpair-node`` (sockets, CNI state, the lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from tools import node_network
from tools.build_support import BuildError, Progress, install_debs
from tools.control_plane import ControlPlane, ControlPlaneError, free_port
from tools.control_plane_build import K8S_VERSION, Binaries, default_cache_dir
from tools.docker_engine import Docker, DockerError, ensure_docker
from tools.node_network import NetworkError, PodNetwork
from tools.processes import ProcessExited, ProcessGroup

NODE_NAME = "specpair-node"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"  # the control plane's --service-cluster-ip-range
RUN_DIR = Path("/run/specpair-node")
CNI_BIN_DIR = Path("/usr/lib/cni")
PAUSE_IMAGE = f"specpair/pause:{K8S_VERSION}"
# iptables for kube-proxy and the CNI plugins, conntrack for kube-proxy's UDP
# cleanup, socat for `kubectl port-forward` (dockershim runs it in the pod's netns).
NODE_PACKAGES = ("containernetworking-plugins", "iptables", "conntrack", "socat")
LOG_PREFIX = "[node]"
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS_CGROUP = "kubepods"  # the kubelet's --cgroup-root / QoS tree (cgroupfs driver)
READY_TIMEOUT_S = 180.0
LOCK_WAIT_S = 1800.0


class NodeUnavailable(RuntimeError):
    """This machine cannot run the node (not root, no Docker, ...); the message says why."""


class NodeError(RuntimeError):
    """The node did not come up; the message holds the log tails."""


@dataclass(frozen=True)
class NodePaths:
    """Where one node keeps its state."""

    root: Path  # $SPECPAIR_CACHE/node: on disk (the kubelet's root, logs)
    run: Path = RUN_DIR  # sockets, CNI state, the lock: short paths on /run

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def dockershim_root(self) -> Path:
        return self.root / "dockershim"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def cni_conf(self) -> Path:
        return self.run / "cni" / "net.d"

    @property
    def cni_cache(self) -> Path:
        return self.run / "cni" / "cache"

    @property
    def ipam(self) -> Path:
        return self.run / "cni" / "ipam"

    @property
    def dockershim_socket(self) -> Path:
        return self.run / "dockershim.sock"

    @property
    def lock(self) -> Path:
        return self.run / "node.lock"

    def pod_uids(self) -> list[str]:
        """Every pod the kubelet has a directory for: the pods it ran."""
        pods = self.kubelet_root / "pods"
        return sorted(p.name for p in pods.iterdir()) if pods.is_dir() else []


def unavailable_reason() -> str | None:
    """Why this machine cannot run a node, or None. Checked before anything starts."""
    if os.uname().sysname != "Linux":
        return f"the kubelet needs Linux, this is {os.uname().sysname}"
    if os.geteuid() != 0:
        return f"the kubelet, dockerd and the pod network need root (running as uid {os.geteuid()})"
    for tool in ("ip", "mount", "umount", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    controllers = _cgroup_controllers()
    missing = {"cpu", "cpuacct", "cpuset", "memory"} - controllers
    if missing:
        return f"the kubelet needs the cgroup controllers {sorted(missing)}, not mounted here"
    return None


def _cgroup_controllers() -> set[str]:
    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if unified.is_file():  # cgroup v2: cpuacct's accounting is part of cpu
        found = set(unified.read_text().split())
        return found | ({"cpuacct"} if "cpu" in found else set())
    root = Path("/sys/fs/cgroup")
    found = set()
    for entry in root.iterdir() if root.is_dir() else []:
        found.update(entry.name.split(","))
    return found


class MachineLock:
    """One node per machine: an exclusive flock on ``/run/specpair-node/node.lock``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def acquire(self, timeout_s: float, progress: Progress) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+")
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.close()
                    raise NodeError(
                        f"another node holds {self.path} ({self.holder()}) "
                        f"after {timeout_s:.0f}s; one node runs on a machine at a time"
                    ) from None
                if not said:
                    progress.say(f"waiting for the node running on this machine ({self.holder()})")
                    said = True
                time.sleep(1.0)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        self._file = handle

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "pid unknown"
        except OSError:
            return "pid unknown"

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.seek(0)
                self._file.truncate()
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def ensure_pause_image(docker: Docker, pause: Path) -> str:
    """The pod sandbox image: the static `pause` alone, imported (no registry to pull from)."""
    if docker.image_id(PAUSE_IMAGE) is not None:
        return PAUSE_IMAGE
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tar.gettarinfo(str(pause), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o755
        with pause.open("rb") as binary:
            tar.addfile(info, binary)
    done = subprocess.run(
        docker.argv("import", "--change", 'ENTRYPOINT ["/pause"]', "-", PAUSE_IMAGE),
        input=data.getvalue(),
        capture_output=True,
        env=docker.env(),
        check=False,
    )
    if done.returncode != 0:
        raise NodeError(f"docker import of the pause image failed: {done.stderr.decode()[-1000:]}")
    return PAUSE_IMAGE


def kubelet_args(
    binaries: Binaries,
    kubeconfig: Path,
    docker: Docker,
    cgroup_driver: str,
    network: PodNetwork,
    paths: NodePaths,
    ports: tuple[int, int],
) -> list[str]:
    """The kubelet's command line (pure)."""
    port, healthz_port = ports
    return [
        str(binaries.kubelet),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={network.node_address}",
        # The node address; the guard lets only the host itself reach it.
        f"--address={network.node_address}",
        f"--port={port}",
        "--read-only-port=0",
        "--healthz-bind-address=127.0.0.1",
        f"--healthz-port={healthz_port}",
        "--container-runtime=docker",
        f"--docker-endpoint={docker.host}",
        f"--container-runtime-endpoint=unix://{paths.dockershim_socket}",
        f"--experimental-dockershim-root-directory={paths.dockershim_root}",
        f"--pod-infra-container-image={PAUSE_IMAGE}",
        "--network-plugin=cni",
        f"--cni-conf-dir={paths.cni_conf}",
        f"--cni-bin-dir={CNI_BIN_DIR}",
        f"--cni-cache-dir={paths.cni_cache}",
        f"--root-dir={paths.kubelet_root}",
        f"--cert-dir={paths.kubelet_root / 'pki'}",
        f"--volume-plugin-dir={paths.root / 'volume-plugins'}",
        f"--cgroup-driver={cgroup_driver}",
        "--fail-swap-on=false",
        # A shared test machine: evict only when it is really out of room, and
        # never collect the images, which no registry could give back.
        "--eviction-hard=memory.available<100Mi,nodefs.available<1%,imagefs.available<1%",
        "--image-gc-high-threshold=100",
        "--image-gc-low-threshold=99",
        # ConfigMap volumes follow their ConfigMap within seconds, not a minute:
        # the runtime's live knobs arrive that way.
        "--sync-frequency=10s",
        "--v=1",
    ]


def proxy_args(
    binaries: Binaries, kubeconfig: Path, network: PodNetwork, ports: tuple[int, int]
) -> list[str]:
    """kube-proxy's command line (pure)."""
    metrics, healthz = ports
    return [
        str(binaries.kube_proxy),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={NODE_NAME}",
        "--proxy-mode=iptables",
        f"--cluster-cidr={network.subnet}",
        f"--metrics-bind-address=127.0.0.1:{metrics}",
        f"--healthz-bind-address=127.0.0.1:{healthz}",
        # NodePorts open on the node address only, never on another interface.
        f"--nodeport-addresses={network.node_address}/32",
        # Leave the machine's conntrack settings as they are.
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--v=1",
    ]


def scheduler_args(binaries: Binaries, kubeconfig: Path, port: int) -> list[str]:
    return [
        str(binaries.kube_scheduler),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--port=0",
    ]


class Node:
    """kube-scheduler, kubelet and kube-proxy for a started control plane."""

    def __init__(
        self,
        plane: ControlPlane,
        docker: Docker,
        network: PodNetwork,
        paths: NodePaths,
        progress: Progress,
    ) -> None:
        self.plane, self.docker, self.network, self.paths = plane, docker, network, paths
        self.progress = progress
        shutil.rmtree(paths.logs, ignore_errors=True)  # this run's logs only
        paths.logs.mkdir(parents=True)
        self.processes = ProcessGroup(paths.logs)
        self._proxy_healthz = 0

    def start(self) -> Node:
        binaries, kubeconfig = self.plane.binaries, self.plane.kubeconfig_path
        for folder in (self.paths.kubelet_root, self.paths.cni_cache, self.paths.ipam):
            folder.mkdir(parents=True, exist_ok=True)
        node_network.write_cni_config(self.network, self.paths.cni_conf, self.paths.ipam)
        ensure_pause_image(self.docker, binaries.pause)
        driver = str(self.docker.info().get("CgroupDriver") or "cgroupfs")
        self.processes.spawn("kube-scheduler", scheduler_args(binaries, kubeconfig, free_port()))
        kubelet_ports = (free_port(self.network.node_address), free_port())
        self.processes.spawn(
            "kubelet",
            kubelet_args(
                binaries, kubeconfig, self.docker, driver, self.network, self.paths, kubelet_ports
            ),
        )
        proxy_ports = (free_port(), free_port())
        self._proxy_healthz = proxy_ports[1]
        self.processes.spawn(
            "kube-proxy", proxy_args(binaries, kubeconfig, self.network, proxy_ports)
        )
        try:
            self.processes.wait("the Node to be Ready", self._node_ready, READY_TIMEOUT_S)
            self.processes.wait("kube-proxy to sync", self._proxy_synced, READY_TIMEOUT_S)
        except (ProcessExited, TimeoutError) as err:
            raise NodeError(str(err)) from None
        return self

    def _node_ready(self) -> bool:
        try:
            node = self.plane.api("GET", f"/api/v1/nodes/{NODE_NAME}")
        except OSError:
            return False
        status = node.get("status")
        conditions = status.get("conditions") if isinstance(status, dict) else None
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions or [])

    def _proxy_synced(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self._proxy_healthz}/healthz"
            with urllib.request.urlopen(url, timeout=5) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the three, then remove every pod's containers and the kubelet's files."""
        self.processes.stop(("kube-scheduler", "kubelet"))
        remove_pods(self.docker, self.paths)
        kube_proxy = self.plane.binaries.kube_proxy
        if os.access(kube_proxy, os.X_OK):
            subprocess.run(
                [str(kube_proxy), "--cleanup", "--proxy-mode=iptables"],
                capture_output=True,
                check=False,
                timeout=60,
            )

    def log_tails(self, lines: int = 25) -> str:
        return self.processes.log_tails(lines)


def remove_pods(docker: Docker, paths: NodePaths) -> None:
    """Remove the containers (and their volumes) of every pod the kubelet ran, and its files."""
    ids: list[str] = []
    for uid in paths.pod_uids():
        listed = docker.run(
            "ps", "-aq", "--filter", f"label=io.kubernetes.pod.uid={uid}", check=False
        )
        ids += listed.stdout.split()
    if ids:
        docker.run("rm", "--force", "--volumes", *ids, check=False)
    for folder in (paths.kubelet_root, paths.dockershim_root, paths.root / "volume-plugins"):
        unmount_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(paths.run / "cni", ignore_errors=True)
    paths.dockershim_socket.unlink(missing_ok=True)
    remove_pod_cgroups()


def remove_pod_cgroups(root: Path = CGROUP_ROOT) -> None:
    """Remove the kubelet's ``kubepods`` cgroups (empty once its containers are gone)."""
    for top in sorted(root.glob(f"*/{KUBEPODS_CGROUP}")) + sorted(root.glob(KUBEPODS_CGROUP)):
        folders = [top, *(p for p in top.rglob("*") if p.is_dir())]
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()


def unmount_under(folder: Path) -> None:
    """Unmount all at or below ``folder`` (the kubelet's tmpfs volumes), deepest first."""
    prefix = str(folder.resolve())
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def pod_network() -> PodNetwork:
    """The pod subnet (``SPECPAIR_NODE_SUBNET`` overrides) and the Service range."""
    subnet = os.environ.get("SPECPAIR_NODE_SUBNET") or node_network.DEFAULT_SUBNET
    return PodNetwork(subnet, SERVICE_CLUSTER_IP_RANGE)


class NodeCluster:
    """The control plane plus one real node on this machine; always `stop()` it.

    ``images`` (runtime, operator) are built, or found current, in the node's
    Docker daemon before `start()` returns (tools/images.py, cached by content).
    """

    def __init__(
        self,
        cache_dir: Path | None = None,
        *,
        runtime_image: str | None = None,
        operator_image: str | None = None,
        authorization_mode: str = "RBAC",
        lock_wait_s: float = LOCK_WAIT_S,
    ) -> None:
        from tools.images import OPERATOR_IMAGE, RUNTIME_CPU_IMAGE

        self.cache = (cache_dir or default_cache_dir()).expanduser().resolve()
        self.runtime_image = runtime_image or RUNTIME_CPU_IMAGE
        self.operator_image = operator_image or OPERATOR_IMAGE
        self.authorization_mode = authorization_mode
        self.lock_wait_s = lock_wait_s
        self.paths = NodePaths(self.cache / "node")
        self.network = pod_network()
        self.progress = Progress(LOG_PREFIX)
        self._lock = MachineLock(self.paths.lock)
        self._forward: str | None = None
        self._docker: Docker | None = None
        self._plane: ControlPlane | None = None
        self._node: Node | None = None

    @property
    def plane(self) -> ControlPlane:
        if self._plane is None:
            raise NodeError("the node cluster is not started")
        return self._plane

    @property
    def docker(self) -> Docker:
        if self._docker is None:
            raise NodeError("the node cluster is not started")
        return self._docker

    @property
    def node(self) -> Node:
        if self._node is None:
            raise NodeError("the node cluster is not started")
        return self._node

    @property
    def kubeconfig_path(self) -> Path:
        return self.plane.kubeconfig_path

    def __enter__(self) -> NodeCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> NodeCluster:
        """Start everything; raise NodeUnavailable where this machine cannot, NodeError else."""
        reason = unavailable_reason()
        if reason is not None:
            raise NodeUnavailable(reason)
        binaries = Binaries.under(self.cache)
        if binaries.missing():
            raise NodeError(
                f"missing {', '.join(binaries.missing())} under {self.cache}: "
                "run `make control-plane`"
            )
        self._lock.acquire(self.lock_wait_s, self.progress)
        try:
            self._start(binaries)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, binaries: Binaries) -> None:
        progress = self.progress
        install_debs(NODE_PACKAGES, progress, self.paths.root / "apt.log")
        try:
            self._docker = ensure_docker(self.cache, progress)
        except DockerError as err:
            raise NodeUnavailable(f"no Docker daemon: {err}") from err
        self._clean_leftovers()
        # Before anything else starts: the first build takes minutes.
        self._ensure_images()
        try:
            self._forward = node_network.setup(self.network)
        except NetworkError as err:
            raise NodeUnavailable(f"the pod network cannot be set up: {err}") from err
        with progress.step(f"control plane, apiserver on {self.network.node_address}"):
            self._plane = ControlPlane(
                binaries,
                authorization_mode=self.authorization_mode,
                node_address=self.network.node_address,
            )
            try:
                self._plane.start()
            except ControlPlaneError as err:
                raise NodeError(str(err)) from None
        port = int(self._plane.server_url.rsplit(":", 1)[1])
        node_network.install_guard(self.network, port)
        with progress.step(f"kubelet, kube-scheduler and kube-proxy (node {NODE_NAME})"):
            self._node = Node(self._plane, self._docker, self.network, self.paths, progress)
            self._node.start()

    def _ensure_images(self) -> None:
        from tools.images import build_images

        try:
            _, built = build_images(self.runtime_image, self.operator_image, self.cache)
        except BuildError as err:
            raise NodeError(f"the images could not be built: {err}") from None
        for image in built:
            self.progress.say(f"image {image.name} in the node's Docker ({image.image_id[:19]})")

    def _clean_leftovers(self) -> None:
        """What a node that was killed left: its pods' containers, files, bridge, chains."""
        if self._docker is not None and self.paths.root.exists():
            remove_pods(self._docker, self.paths)
        node_network.teardown(None)

    def stop(self) -> None:
        """Stop the node, the control plane and the network, in that order. Safe to repeat."""
        try:
            if self._node is not None:
                self._node.stop()
                self._node = None
            elif self._docker is not None:
                remove_pods(self._docker, self.paths)
            if self._plane is not None:
                self._plane.stop()
                self._plane = None
            with contextlib.suppress(NetworkError):
                node_network.teardown(self._forward)
            self._forward = None
        finally:
            self._lock.release()

    def running(self) -> bool:
        return (
            self._plane is not None
            and self._plane.running()
            and self._node is not None
            and self._node.processes.running()
        )

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        if self._plane is not None:
            parts.append(self._plane.log_tails(lines))
        if self._node is not None:
            parts.append(self._node.log_tails(lines))
        return "\n".join(parts)
