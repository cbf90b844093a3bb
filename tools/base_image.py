"""The images' base, made from Debian's packages: debootstrap, then `docker import`.

No container registry can be reached here, so ``FROM python:3.11-slim`` cannot
be pulled. Debian bookworm's own packages give the same thing: Python 3.11 and
its venv module on a minimal Debian. `ensure_base_image()` builds the root
filesystem once, keeps it as a tarball under ``$SPECPAIR_CACHE/images/base``
(named by the hash of its recipe) and imports it into the daemon when the
daemon lacks it, so a cached run costs one `docker image inspect`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools.apt_sources import debian_mirror, machine_apt_sources
from tools.build_support import BuildError, Progress, install_debs, privileged, run
from tools.docker_engine import Docker

SUITE = "bookworm"
VARIANT = "minbase"
# Python 3.11 with venv and pip's bundled wheels; CA certificates for hf:// in a cluster.
PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Left out of the root filesystem: package caches and lists, docs, man pages.
PRUNED = (
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
)
IMAGE_REPOSITORY = "specpair/base"
# Bump when the recipe below changes in a way the key does not see.
RECIPE_VERSION = 1
HOST_PACKAGES = ("debootstrap", "debian-archive-keyring")


@dataclass(frozen=True)
class BaseRecipe:
    """Everything the root filesystem is made from; its hash names the image."""

    mirror: str
    suite: str = SUITE
    variant: str = VARIANT
    packages: tuple[str, ...] = PACKAGES

    def key(self) -> str:
        recipe = {
            "mirror": self.mirror,
            "suite": self.suite,
            "variant": self.variant,
            "packages": sorted(self.packages),
            "version": RECIPE_VERSION,
        }
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]

    def image(self) -> str:
        return f"{IMAGE_REPOSITORY}:{self.suite}-{self.key()}"


def debian_archive() -> str:
    """The Debian mirror this machine's apt uses (``SPECPAIR_DEBIAN_MIRROR`` overrides)."""
    override = os.environ.get("SPECPAIR_DEBIAN_MIRROR")
    if override:
        return override.rstrip("/")
    try:
        return debian_mirror(machine_apt_sources(), SUITE).uri
    except LookupError as err:
        raise BuildError(
            f"{err}; the images' base is made from Debian {SUITE} with debootstrap. "
            "Set SPECPAIR_DEBIAN_MIRROR to a Debian mirror URI to override."
        ) from err


def ensure_base_image(docker: Docker, cache_dir: Path, progress: Progress) -> str:
    """The base image's name in ``docker``; built and imported only when missing."""
    recipe = BaseRecipe(debian_archive())
    name = recipe.image()
    if docker.image_id(name) is not None:
        return name
    tarball = cache_dir / "images" / "base" / f"{recipe.suite}-{recipe.key()}.tar"
    if not tarball.is_file():
        _debootstrap(recipe, tarball, progress, cache_dir / "images" / "logs")
    with progress.step(f"docker import {tarball.name} as {name}"):
        with tarball.open("rb") as data:
            done = subprocess.run(
                docker.argv(
                    "import",
                    "--change",
                    "ENV LANG=C.UTF-8",
                    "--change",
                    'CMD ["/bin/bash"]',
                    "-",
                    name,
                ),
                stdin=data,
                capture_output=True,
                text=True,
                env=docker.env(),
                check=False,
            )
        if done.returncode != 0:
            raise BuildError(f"docker import {tarball} failed: {done.stderr.strip()[-2000:]}")
    return name


def _debootstrap(recipe: BaseRecipe, tarball: Path, progress: Progress, logs: Path) -> None:
    """debootstrap the recipe into a temp dir and pack it as ``tarball`` (atomically)."""
    install_debs(HOST_PACKAGES, progress, logs / "apt.log")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specpair-rootfs-", dir=tarball.parent) as scratch:
        rootfs = Path(scratch) / "rootfs"
        with progress.step(
            f"debootstrap --variant={recipe.variant} {recipe.suite} "
            f"({', '.join(recipe.packages)}) from {recipe.mirror} (2-6 min)"
        ):
            run(
                privileged(
                    [
                        "debootstrap",
                        f"--variant={recipe.variant}",
                        f"--include={','.join(recipe.packages)}",
                        "--components=main",
                        recipe.suite,
                        str(rootfs),
                        recipe.mirror,
                    ]
                ),
                progress=progress,
                log=logs / "debootstrap.log",
            )
        for relative in PRUNED:
            target = rootfs / relative
            if target.is_dir():
                shutil.rmtree(target)
                target.mkdir()
        partial = tarball.with_suffix(".tar.partial")
        with progress.step(f"packing the root filesystem into {tarball}"):
            run(
                privileged(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."]),
                progress=progress,
                log=logs / "debootstrap.log",
            )
        partial.replace(tarball)
        # debootstrap leaves root-owned files (and device nodes) behind.
        run(privileged(["rm", "-rf", "--", str(rootfs)]), progress=progress)
