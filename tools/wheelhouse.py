"""Wheelhouses for the image builds: every dependency as a wheel, fetched on the host.

An image build runs with ``--network=none`` and installs with ``pip install
--no-index --find-links``, so it needs no registry. The host's pip fetches
the pinned dependencies of one pyproject extra (``pip download``, binary wheels
for CPython 3.11 on glibc 2.36 x86_64, as Debian bookworm is) into
``$SPECPAIR_CACHE/wheelhouse/<extra>-<key>``, where the key hashes the
requirement list: a second build with the same pins downloads nothing. torch
comes from the CPU wheel on this machine's disk (``/opt/wheels``), never from
an index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tools.build_support import BuildError, Progress, run

ROOT = Path(__file__).resolve().parent.parent
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-cp311-cp311-*.whl"
TORCH_WHEEL_DIRS = (Path("/opt/wheels"),)
# What pip needs to build the project itself from its source inside the image.
BUILD_REQUIREMENTS = ("setuptools>=69", "wheel")
# The image's interpreter: Debian bookworm's CPython 3.11, glibc 2.36. pip
# takes each compatible platform tag as its own --platform.
GLIBC_MINOR = 36
PLATFORM_ARGS = (
    "--only-binary=:all:",
    "--implementation=cp",
    "--python-version=3.11",
    "--abi=cp311",
    "--abi=abi3",
    "--abi=none",
    *(f"--platform=manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)),
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux2010_x86_64",
    "--platform=manylinux1_x86_64",
    "--platform=any",
)


@dataclass(frozen=True)
class Wheelhouse:
    """A directory of wheels and the key that names it."""

    path: Path
    key: str

    def wheels(self) -> list[Path]:
        return sorted(self.path.glob("*.whl"))


def torch_wheel() -> Path:
    """The CPU torch wheel on this machine (``SPECPAIR_TORCH_WHEEL`` overrides)."""
    override = os.environ.get("SPECPAIR_TORCH_WHEEL")
    if override:
        path = Path(override)
        if not path.is_file():
            raise BuildError(f"SPECPAIR_TORCH_WHEEL={override}: no such file")
        return path
    for folder in TORCH_WHEEL_DIRS:
        found = sorted(folder.glob(TORCH_WHEEL_GLOB))
        if found:
            return found[-1]
    raise BuildError(
        f"no {TORCH_WHEEL_GLOB} under {', '.join(map(str, TORCH_WHEEL_DIRS))}; "
        "set SPECPAIR_TORCH_WHEEL to the CPU torch 2.13.0 wheel for CPython 3.11"
    )


def requirements(extra: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The pinned requirements of the project's base and ``extra`` dependencies."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    if extra not in extras:
        raise BuildError(f"pyproject.toml has no extra {extra!r} (it has {sorted(extras)})")
    return [*project["dependencies"], *extras[extra], *BUILD_REQUIREMENTS]


def _is_torch(requirement: str) -> bool:
    return requirement.replace(" ", "").lower().startswith("torch==")


def plan(extra: str, cache_dir: Path) -> tuple[list[str], Wheelhouse]:
    """The arguments for `pip download` and where their wheels go (pure but for torch)."""
    wanted = requirements(extra)
    if any(_is_torch(r) for r in wanted):
        wanted = [str(torch_wheel()) if _is_torch(r) else r for r in wanted]
    key_source = [Path(r).name if r.endswith(".whl") else r for r in wanted]
    key = hashlib.sha256(
        json.dumps({"requirements": sorted(key_source), "platform": PLATFORM_ARGS}).encode()
    ).hexdigest()[:16]
    return wanted, Wheelhouse(cache_dir / "wheelhouse" / f"{extra}-{key}", key)


def ensure_wheelhouse(extra: str, cache_dir: Path, progress: Progress) -> Wheelhouse:
    """The wheelhouse of ``extra``: downloaded once, then reused as it is."""
    wanted, house = plan(extra, cache_dir)
    if (house.path / "COMPLETE").is_file():
        return house
    partial = house.path.with_name(house.path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    local = [r for r in wanted if r.endswith(".whl")]  # the torch wheel
    for wheel in local:
        shutil.copyfile(wheel, partial / Path(wheel).name)
    with progress.step(f"pip download the '{extra}' dependencies into {house.path.name}"):
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--dest",
                str(partial),
                *PLATFORM_ARGS,
                # The local torch wheel satisfies torch==; pip sees it in --find-links.
                "--find-links",
                str(partial),
                *[r for r in wanted if not r.endswith(".whl")],
                *[f"torch=={_version_of(Path(w))}" for w in local],
            ],
            progress=progress,
            log=cache_dir / "wheelhouse" / f"{extra}.log",
        )
    (partial / "COMPLETE").write_text("\n".join(sorted(p.name for p in partial.glob("*.whl"))))
    shutil.rmtree(house.path, ignore_errors=True)
    partial.replace(house.path)
    return house


def _version_of(wheel: Path) -> str:
    """A wheel's version, as its file name gives it (torch-2.13.0+cpu-... → 2.13.0+cpu)."""
    return wheel.name.split("-")[1]
