"""A Docker Engine to build images and run pods on: the user's, or the project's own.

`ensure_docker()` returns a `Docker` that answers `docker info`:

1. ``DOCKER_HOST`` when it is set (it must answer);
2. else the default socket, ``/var/run/docker.sock``, when a daemon answers there;
3. else the project's own ``dockerd``, started if it is not running.

The project's daemon comes from Debian's ``docker.io`` (installed when
missing), keeps its images under ``$SPECPAIR_CACHE/docker`` and stays up after
the command that started it, so the next `make images` or node reuses it. It
runs without a bridge or iptables rules of its own (``--bridge=none
--iptables=false --ip-forward=false``): image builds run with ``--network=none`` (a wheelhouse
replaces the network) and pods get their network from the node's CNI.
Where root lacks CAP_SYS_RESOURCE (so no container may get the negative OOM
score adjustment the kubelet asks for), its default runtime is runc behind
tools/runc_oom_clamp.py. `stop_project_daemon()` stops it; a daemon started
with other arguments than these is restarted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tools.build_support import Progress, install_debs, tail_file

DOCKER_PACKAGES = ("docker.io",)
DEFAULT_SOCKET = Path("/var/run/docker.sock")
# Runtime state (sockets, containerd's shims) belongs on /run, and a short
# path keeps containerd's socket paths under the 108-byte limit.
EXEC_ROOT = Path("/run/specpair-docker")
START_TIMEOUT_S = 90.0
CAP_SYS_RESOURCE = 24
CLAMP_RUNTIME = "specpair-runc"


class DockerError(RuntimeError):
    """No Docker daemon could be reached or started; the message says why."""


@dataclass(frozen=True)
class Docker:
    """A docker CLI bound to one daemon (``host`` is a DOCKER_HOST URL)."""

    cli: str
    host: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def argv(self, *args: str) -> list[str]:
        return [self.cli, *args]

    def run(
        self, *args: str, check: bool = True, timeout: float | None = 600.0
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            env=self.env(),
            check=False,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise DockerError(
                f"`docker {' '.join(args)}` exited {done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        return done

    def info(self) -> dict[str, object]:
        done = self.run("info", "--format", "{{json .}}", timeout=30)
        found = json.loads(done.stdout)
        if not isinstance(found, dict):
            raise DockerError(f"docker info gave {done.stdout[:200]!r}")
        return found

    def answers(self) -> bool:
        try:
            done = self.run("version", "--format", "{{.Server.Version}}", timeout=15)
            return done.returncode == 0
        except (DockerError, OSError, subprocess.TimeoutExpired):
            return False

    def image_id(self, name: str) -> str | None:
        """The image's ID, or None where the daemon has no image of that name."""
        done = self.run("image", "inspect", "--format", "{{.Id}}", name, check=False)
        return done.stdout.strip() if done.returncode == 0 else None

    def image_label(self, name: str, label: str) -> str | None:
        done = self.run(
            "image", "inspect", "--format", "{{json .Config.Labels}}", name, check=False
        )
        if done.returncode != 0:
            return None
        labels = json.loads(done.stdout or "null") or {}
        value = labels.get(label)
        return str(value) if value is not None else None


@dataclass(frozen=True)
class ProjectDaemon:
    """Where the project's own dockerd keeps its data, socket, pid and log."""

    root: Path

    @classmethod
    def under(cls, cache_dir: Path) -> ProjectDaemon:
        return cls(cache_dir / "docker")

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def socket(self) -> Path:
        return EXEC_ROOT / "docker.sock"

    @property
    def pidfile(self) -> Path:
        return EXEC_ROOT / "dockerd.pid"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    @property
    def args_file(self) -> Path:
        """The command line the running daemon was started with."""
        return EXEC_ROOT / "dockerd.args.json"

    @property
    def runc_wrapper(self) -> Path:
        return self.root / "runc-oom-clamp"

    def pid(self) -> int | None:
        """The running daemon's pid, from its pidfile; None when it is not running."""
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid


def _cli(prefer: Path | None = None) -> str | None:
    """The docker CLI: the one beside the daemon we start, else the one on PATH."""
    if prefer is not None and os.access(prefer, os.X_OK):
        return str(prefer)
    return shutil.which("docker")


def _dockerd() -> str | None:
    return shutil.which("dockerd") or (
        "/usr/sbin/dockerd" if os.access("/usr/sbin/dockerd", os.X_OK) else None
    )


def users_docker() -> Docker | None:
    """A daemon the user runs: ``DOCKER_HOST`` (which must answer) or the default socket."""
    cli = _cli(Path("/usr/bin/docker"))
    env_host = os.environ.get("DOCKER_HOST")
    if env_host:
        if cli is None or not Docker(cli, env_host).answers():
            raise DockerError(
                f"DOCKER_HOST={env_host} does not answer `docker version`; "
                "unset it to use the project's own dockerd"
            )
        return Docker(cli, env_host)
    if cli is not None and DEFAULT_SOCKET.exists():
        docker = Docker(cli, f"unix://{DEFAULT_SOCKET}")
        if docker.answers():
            return docker
    return None


def ensure_docker(cache_dir: Path, progress: Progress) -> Docker:
    """A Docker that answers: the user's, else the project's (started if need be)."""
    found = users_docker()
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise DockerError(
            "no Docker daemon answers, and starting the project's own dockerd needs root "
            f"(uid {os.geteuid()}); start Docker, or run as root"
        )
    daemon = ProjectDaemon.under(cache_dir)
    daemon.root.mkdir(parents=True, exist_ok=True)
    if _dockerd() is None or _cli(Path("/usr/bin/docker")) is None:
        install_debs(DOCKER_PACKAGES, progress, daemon.root / "apt.log")
    return start_project_daemon(daemon, progress)


def can_lower_oom_scores() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (needed for a negative OOM adjustment)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return True


def daemon_argv(dockerd: str, daemon: ProjectDaemon, clamp_oom: bool) -> list[str]:
    """The project's dockerd command line (pure)."""
    argv = [
        dockerd,
        f"--data-root={daemon.data_root}",
        f"--exec-root={EXEC_ROOT}",
        f"--host={daemon.host}",
        f"--pidfile={daemon.pidfile}",
        "--bridge=none",
        "--iptables=false",
        "--ip-masq=false",
        "--ip-forward=false",
        "--log-level=warn",
    ]
    if clamp_oom:
        argv += [
            f"--add-runtime={CLAMP_RUNTIME}={daemon.runc_wrapper}",
            f"--default-runtime={CLAMP_RUNTIME}",
        ]
    return argv


def _install_wrapper(daemon: ProjectDaemon) -> dict[str, str]:
    """Put the runc wrapper beside the daemon's data; the env that tells it where runc is."""
    source = Path(__file__).with_name("runc_oom_clamp.py")
    partial = daemon.runc_wrapper.with_suffix(".partial")
    partial.write_text(source.read_text())
    partial.chmod(0o755)
    partial.replace(daemon.runc_wrapper)
    runc = shutil.which("runc") or "/usr/sbin/runc"
    return {"SPECPAIR_RUNC": runc}


def start_project_daemon(daemon: ProjectDaemon, progress: Progress) -> Docker:
    """Start the project's dockerd, detached (it outlives this process), and wait for it."""
    dockerd = _dockerd()
    cli = _cli(Path("/usr/bin/docker"))
    if dockerd is None or cli is None:
        raise DockerError("dockerd or the docker CLI is missing after installing docker.io")
    docker = Docker(cli, daemon.host)
    clamp_oom = not can_lower_oom_scores()
    argv = daemon_argv(dockerd, daemon, clamp_oom)
    if daemon.pid() is not None:
        started_with = daemon.args_file.read_text() if daemon.args_file.is_file() else ""
        if started_with == json.dumps(argv) and docker.answers():
            return docker
        progress.say("restarting the project's dockerd with its current arguments")
        stop_project_daemon(daemon.root.parent)
    EXEC_ROOT.mkdir(parents=True, exist_ok=True)
    daemon.data_root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if clamp_oom:
        env.update(_install_wrapper(daemon))
        progress.say("no CAP_SYS_RESOURCE here: containers' OOM score adjustments are clamped")
    with progress.step(f"starting the project's dockerd (data {daemon.data_root})"):
        with daemon.log.open("ab") as log:
            subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # stays up for the next build or node
            )
        daemon.args_file.write_text(json.dumps(argv))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not docker.answers():
            if time.monotonic() > deadline:
                raise DockerError(
                    f"dockerd did not answer on {daemon.host} within {START_TIMEOUT_S:.0f}s; "
                    f"{daemon.log}:\n{tail_file(daemon.log, 30)}"
                )
            time.sleep(0.5)
    progress.say(f"dockerd answers on {daemon.host}; export DOCKER_HOST={daemon.host}")
    return docker


def stop_project_daemon(cache_dir: Path, timeout_s: float = 30.0) -> bool:
    """Stop the project's dockerd (SIGTERM, then SIGKILL); False when it was not running."""
    daemon = ProjectDaemon.under(cache_dir)
    pid = daemon.pid()
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True
