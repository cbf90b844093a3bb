"""A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) on loopback.

`build()` (from control_plane_build, re-exported here) makes and caches the
binaries once. `ControlPlane` starts the three processes on free loopback
ports and always stops them again; see tests/support/k8s_fixtures.py for the
pytest fixtures built on it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tools.build_support import BuildError
from tools.control_plane_build import (
    K8S_VERSION,
    Binaries,
    build,
    default_cache_dir,
    is_built,
)
from tools.processes import ProcessExited, ProcessGroup

__all__ = [
    "K8S_VERSION",
    "Binaries",
    "BuildError",
    "ControlPlane",
    "ControlPlaneError",
    "build",
    "default_cache_dir",
    "is_built",
]

# --- Running the control plane -------------------------------------------------

ADMIN_USER = "specpair-admin"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"
AUTHORIZATION_MODES = ("AlwaysAllow", "RBAC")


class ControlPlaneError(RuntimeError):
    """The control plane did not come up; the message holds the log tails."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out on loopback (free at that moment)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kubeconfig_yaml(server: str, ca_path: Path, token: str, user: str) -> str:
    """A kubeconfig (JSON is valid YAML) for a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "specpair-test",
                "cluster": {"server": server, "certificate-authority": str(ca_path)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "specpair-test", "user": user}}],
        "current-context": user,
    }
    return json.dumps(config, indent=2) + "\n"


class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager on loopback.

    Use as a context manager, or call `start()` and (always) `stop()`.
    `authorization_mode` is "AlwaysAllow" or "RBAC". The admin token is in
    `system:masters`, so it may do everything under RBAC too. The processes
    get SIGTERM when the thread that started them ends (PR_SET_PDEATHSIG), so
    start planes from a thread that outlives their use (the main thread).

    Everything listens on 127.0.0.1, except with ``node_address`` (a real node,
    tools/node.py): there the apiserver listens on, and advertises, that
    address of the node's pod bridge instead, because a pod's loopback is its
    own and pods reach the apiserver through the ``kubernetes`` Service.
    """

    def __init__(
        self,
        binaries: Binaries | None = None,
        *,
        authorization_mode: str = "AlwaysAllow",
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
        keep_dir: bool = False,
        node_address: str | None = None,
    ) -> None:
        if authorization_mode not in AUTHORIZATION_MODES:
            raise ValueError(
                f"authorization_mode must be one of {AUTHORIZATION_MODES}, "
                f"got {authorization_mode!r}"
            )
        self.binaries = binaries or Binaries.under(default_cache_dir())
        self.authorization_mode = authorization_mode
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.keep_dir = keep_dir or os.environ.get("SPECPAIR_KEEP_CONTROL_PLANE_DIR") == "1"
        self.admin_token = secrets.token_hex(24)
        self.node_address = node_address
        self._dir: Path | None = None
        self._group: ProcessGroup | None = None
        self._etcd_data: Path | None = None
        self.server_url = ""

    # -- paths, valid after start() --

    @property
    def dir(self) -> Path:
        if self._dir is None:
            raise ControlPlaneError("the control plane is not started")
        return self._dir

    @property
    def kubeconfig_path(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def ca_path(self) -> Path:
        # The apiserver's self-signed cert file holds the leaf and its CA.
        return self.dir / "certs" / "apiserver.crt"

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    @property
    def processes(self) -> ProcessGroup:
        if self._group is None:
            raise ControlPlaneError("the control plane is not started")
        return self._group

    # -- lifecycle --

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        missing = self.binaries.missing()
        if missing:
            raise ControlPlaneError(
                f"missing {', '.join(missing)} under {default_cache_dir()}: "
                "run `make control-plane`"
            )
        for attempt in range(3):
            self._dir = Path(tempfile.mkdtemp(prefix="specpair-cp-"))
            self._group = ProcessGroup(self._dir, self.stop_timeout_s)
            try:
                self._start_processes()
                return self
            except ControlPlaneError as err:
                self.stop()
                # Free ports are picked before the processes bind them, so
                # another test process may take one in between: try new ones.
                if attempt == 2 or "address already in use" not in str(err):
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_processes(self) -> None:
        d = self.dir
        (d / "certs").mkdir()
        sa_key = d / "sa.key"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True
        )
        tokens = d / "tokens.csv"
        tokens.write_text(f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        tokens.chmod(0o600)

        etcd_port, etcd_peer, api_port, kcm_port = (free_port() for _ in range(4))
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        # etcd's fsyncs dominate on a shared disk; tmpfs makes them free.
        shm = Path("/dev/shm")
        etcd_data = Path(tempfile.mkdtemp(prefix="specpair-etcd-", dir=shm if shm.is_dir() else d))
        self._etcd_data = etcd_data
        etcd_args = [
            str(self.binaries.etcd),
            "--name=specpair-test",
            f"--data-dir={etcd_data}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=specpair-test=http://127.0.0.1:{etcd_peer}",
            "--logger=zap" if _etcd_supports(self.binaries.etcd, "--logger") else "",
            "--log-level=warn" if _etcd_supports(self.binaries.etcd, "--log-level") else "",
        ]
        if _etcd_supports(self.binaries.etcd, "--unsafe-no-fsync"):
            etcd_args.append("--unsafe-no-fsync")
        self._spawn("etcd", [a for a in etcd_args if a])
        self._wait(
            "etcd", lambda: _http_ok(f"{etcd_url}/health", None, None, '"health":"true"'), 30
        )

        address = self.node_address or "127.0.0.1"
        if self.node_address:
            api_port = free_port(self.node_address)
        self.server_url = f"https://{address}:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={address}",
                f"--advertise-address={address}",
                f"--secure-port={api_port}",
                "--insecure-port=0",
                f"--cert-dir={d / 'certs'}",
                f"--token-auth-file={tokens}",
                f"--authorization-mode={self.authorization_mode}",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--api-audiences={API_AUDIENCE}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--enable-priority-and-fairness=false",
                "--allow-privileged=true",
                "--profiling=false",
                *self._endpoint_flags(),
            ],
        )
        self._wait(
            "kube-apiserver",
            lambda: (
                self.ca_path.is_file()
                and _http_ok(f"{self.server_url}/readyz", self.ca_path, self.admin_token, "ok")
            ),
            self.startup_timeout_s,
        )
        self.kubeconfig_path.write_text(
            kubeconfig_yaml(self.server_url, self.ca_path, self.admin_token, ADMIN_USER)
        )
        self.kubeconfig_path.chmod(0o600)

        self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries.kube_controller_manager),
                f"--kubeconfig={self.kubeconfig_path}",
                "--leader-elect=false",
                "--controllers=*",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={self.ca_path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                "--port=0",
                "--profiling=false",
            ],
        )
        # Pods need the default ServiceAccount and (in v1.20) its token Secret.
        self._wait(
            "kube-controller-manager", self._default_service_account_ready, self.startup_timeout_s
        )

    def _endpoint_flags(self) -> list[str]:
        if self.node_address is None:
            # A loopback address is not a valid Endpoints IP; skip that loop.
            return ["--endpoint-reconciler-type=none"]
        # The `kubernetes` Service's endpoint is the node address; the apiserver
        # reaches the kubelet at the Node's InternalIP (its name does not resolve).
        return ["--endpoint-reconciler-type=lease", "--kubelet-preferred-address-types=InternalIP"]

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.processes.spawn(name, argv, cwd=self.dir)

    def _wait(self, name: str, ready: Callable[[], bool], timeout_s: float) -> None:
        try:
            self.processes.wait(name, ready, timeout_s)
        except (ProcessExited, TimeoutError) as err:
            raise ControlPlaneError(str(err)) from None

    def log_tails(self, lines: int = 25, first: str | None = None) -> str:
        """The last lines of each process's log, `first`'s log first."""
        if self._group is None:
            return ""
        return self._group.log_tails(lines, first)

    def _default_service_account_ready(self) -> bool:
        try:
            sa = self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        except urllib.error.HTTPError:
            return False
        return bool(sa.get("secrets"))

    def pids(self) -> dict[str, int]:
        return self._group.pids() if self._group is not None else {}

    def running(self) -> bool:
        return self._group is not None and self._group.running()

    def stop(self) -> None:
        """Stop all three (SIGTERM, then SIGKILL) and remove the temp dirs. Safe to repeat."""
        if self._group is not None:
            self._group.stop(("kube-controller-manager", "kube-apiserver", "etcd"))
        if self._etcd_data is not None:
            shutil.rmtree(self._etcd_data, ignore_errors=True)
            self._etcd_data = None
        if self._dir is not None and not self.keep_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- talking to it --

    def api(
        self, method: str, path: str, body: object | None = None, token: str | None = None
    ) -> dict[str, object]:
        """A JSON request to the apiserver (admin token unless given); raises HTTPError."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.server_url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {token or self.admin_token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        with urllib.request.urlopen(
            request, context=_ssl_context(self.ca_path), timeout=30
        ) as reply:
            result = json.loads(reply.read() or b"{}")
        if not isinstance(result, dict):
            raise ControlPlaneError(f"{method} {path}: expected a JSON object, got {type(result)}")
        return result

    def kubeconfig_for_token(
        self, token: str, path: Path | None = None, user: str = "user"
    ) -> Path:
        """Write a kubeconfig that authenticates with `token`; return its path."""
        target = path or self.dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', user)}.kubeconfig"
        target.write_text(kubeconfig_yaml(self.server_url, self.ca_path, token, user))
        target.chmod(0o600)
        return target

    def service_account_token(
        self, namespace: str, name: str, *, create: bool = True, expiration_s: int = 3600
    ) -> str:
        """A TokenRequest token for ServiceAccount `namespace/name` (created if absent)."""
        if create:
            self.ensure_namespace(namespace)
            try:
                self.api(
                    "POST",
                    f"/api/v1/namespaces/{namespace}/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
                )
            except urllib.error.HTTPError as err:
                if err.code != 409:
                    raise
        reply = self.api(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"audiences": [API_AUDIENCE], "expirationSeconds": expiration_s},
            },
        )
        status = reply.get("status")
        if not isinstance(status, dict) or not isinstance(status.get("token"), str):
            raise ControlPlaneError(
                f"TokenRequest for {namespace}/{name} returned no token: {reply}"
            )
        return str(status["token"])

    def service_account_kubeconfig(self, namespace: str, name: str, *, create: bool = True) -> Path:
        """A kubeconfig acting as ServiceAccount `namespace/name` (to test RBAC)."""
        token = self.service_account_token(namespace, name, create=create)
        return self.kubeconfig_for_token(token, user=f"sa-{namespace}-{name}")

    def ensure_namespace(self, namespace: str) -> None:
        try:
            self.api(
                "POST",
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            )
        except urllib.error.HTTPError as err:
            if err.code != 409:
                raise

    def env(self) -> dict[str, str]:
        """Environment for a child (kubectl, helm, the operator) using the admin kubeconfig."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig_path)}


def _ssl_context(ca_path: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca_path))


def _http_ok(url: str, ca_path: Path | None, token: str | None, expect: str) -> bool:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    context = _ssl_context(ca_path) if ca_path else None
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, context=context, timeout=5) as reply:
            return expect in reply.read().decode(errors="replace")
    except (OSError, ssl.SSLError, urllib.error.URLError):
        return False


_ETCD_HELP: dict[Path, str] = {}


def _etcd_supports(etcd: Path, flag: str) -> bool:
    if etcd not in _ETCD_HELP:
        done = subprocess.run([str(etcd), "--help"], capture_output=True, text=True, check=False)
        _ETCD_HELP[etcd] = done.stdout + done.stderr
    return flag in _ETCD_HELP[etcd]
