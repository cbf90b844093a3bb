"""`make images`: the CPU runtime image and the operator image, built locally.

    python -m tools.images [--runtime-cpu-image NAME] [--operator-image NAME]

No registry is needed. The steps, each cached:

1. a Docker daemon (tools/docker_engine.py): the user's, or the project's own;
2. the base image from Debian's packages (tools/base_image.py);
3. a wheelhouse per image (tools/wheelhouse.py);
4. for each image, a build context staged from the repository (only the
   files its Dockerfile copies, plus the wheelhouse and the pinned
   requirements of its pyproject extra) and ``docker build --network=none``.

An image is named by the hash of everything it is built from (the
Dockerfile, each copied file, the wheelhouse's key and the base image's ID),
kept in the image's label ``dev.specpair.inputs``. When the daemon already
has the image under its name with that label, nothing is built: a second
`make images` with nothing changed returns in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.base_image import ensure_base_image
from tools.build_support import BuildError, Progress, build_lock, run
from tools.docker_engine import Docker, DockerError, ensure_docker
from tools.wheelhouse import Wheelhouse, ensure_wheelhouse, requirements

ROOT = Path(__file__).resolve().parent.parent
INPUTS_LABEL = "dev.specpair.inputs"
# The names `make images` gives (its RUNTIME_CPU_IMAGE and OPERATOR_IMAGE
# variables reach here, and the node, through these environment variables).
RUNTIME_CPU_IMAGE = os.environ.get("SPECPAIR_RUNTIME_CPU_IMAGE") or "specpair/runtime:dev-cpu"
OPERATOR_IMAGE = os.environ.get("SPECPAIR_OPERATOR_IMAGE") or "specpair/operator:dev"
LOG_PREFIX = "[images]"
SKIPPED_PARTS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


class ImagesUnavailable(BuildError):
    """No Docker daemon can run here; the message says why."""


@dataclass(frozen=True)
class ImageRecipe:
    """One image: its Dockerfile, the repository paths it copies, its wheelhouse extra."""

    kind: str
    dockerfile: Path
    sources: tuple[str, ...]
    extra: str


RUNTIME_CPU = ImageRecipe(
    "runtime-cpu",
    Path("runtime/Dockerfile.cpu"),
    (
        "pyproject.toml",
        "README.md",
        "runtime",
        "operator",
        "tools/__init__.py",
        "tools/tiny_models.py",
        "tools/make_demo_models.py",
    ),
    "runtime",
)
OPERATOR = ImageRecipe(
    "operator",
    Path("operator/Dockerfile"),
    ("pyproject.toml", "README.md", "runtime", "operator"),
    "operator",
)


def default_cache_dir() -> Path:
    env = os.environ.get("SPECPAIR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specpair"


def _kept(relative: Path) -> bool:
    """Not a cache, a compiled file, build metadata, nor a Dockerfile (no image holds one)."""
    return (
        not SKIPPED_PARTS.intersection(relative.parts)
        and not relative.name.startswith("Dockerfile")
        and relative.suffix != ".pyc"
        and not any(p.endswith(".egg-info") for p in relative.parts)
    )


def source_files(root: Path, sources: Sequence[str]) -> list[str]:
    """The files under ``sources`` (files or folders), relative and sorted; no caches."""
    found: list[str] = []
    for source in sources:
        path = root / source
        if path.is_file():
            found.append(source)
            continue
        if not path.is_dir():
            raise BuildError(f"{path}: a path the image copies is missing")
        for file in path.rglob("*"):
            relative = file.relative_to(root)
            if file.is_file() and _kept(relative):
                found.append(relative.as_posix())
    return sorted(found)


def inputs_hash(
    root: Path, recipe: ImageRecipe, files: Sequence[str], wheelhouse: Wheelhouse, base_id: str
) -> str:
    """The hash of everything the image is built from."""
    digest = hashlib.sha256()
    for part in (recipe.kind, (root / recipe.dockerfile).read_text(), wheelhouse.key, base_id):
        digest.update(part.encode() + b"\0")
    for relative in files:
        digest.update(relative.encode() + b"\0")
        digest.update(hashlib.sha256((root / relative).read_bytes()).digest())
    return digest.hexdigest()[:24]


# What `_stage` adds to a context beside the repository's files.
STAGED = ("wheelhouse/", "requirements.txt")


def _stage(
    root: Path, recipe: ImageRecipe, files: Sequence[str], wheelhouse: Wheelhouse, context: Path
) -> None:
    """Copy the files, write the pinned requirements, link the wheels: a build context."""
    (context / "requirements.txt").write_text("\n".join(requirements(recipe.extra)) + "\n")
    for relative in files:
        target = context / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / relative, target)
    wheels = context / "wheelhouse"
    wheels.mkdir()
    for wheel in wheelhouse.wheels():
        try:
            os.link(wheel, wheels / wheel.name)
        except OSError:  # another filesystem
            shutil.copyfile(wheel, wheels / wheel.name)


@dataclass(frozen=True)
class Built:
    name: str
    image_id: str
    inputs: str
    cached: bool
    seconds: float


def build_image(
    docker: Docker,
    recipe: ImageRecipe,
    name: str,
    base: str,
    cache_dir: Path,
    progress: Progress,
    root: Path = ROOT,
) -> Built:
    """Build ``recipe`` as ``name`` unless the daemon has it with the same inputs."""
    began = time.monotonic()
    wheelhouse = ensure_wheelhouse(recipe.extra, cache_dir, progress)
    files = source_files(root, recipe.sources)
    base_id = docker.image_id(base)
    if base_id is None:
        raise BuildError(f"the base image {base} is not in the daemon")
    inputs = inputs_hash(root, recipe, files, wheelhouse, base_id)
    if docker.image_label(name, INPUTS_LABEL) == inputs:
        image_id = docker.image_id(name) or ""
        return Built(name, image_id, inputs, True, time.monotonic() - began)
    logs = cache_dir / "images" / "logs"
    with tempfile.TemporaryDirectory(prefix=f"specpair-{recipe.kind}-", dir=cache_dir) as tmp:
        context = Path(tmp)
        _stage(root, recipe, files, wheelhouse, context)
        shutil.copyfile(root / recipe.dockerfile, context / "Dockerfile")
        with progress.step(f"docker build {name} (log: {logs / recipe.kind}.log)"):
            run(
                docker.argv(
                    "build",
                    "--network=none",
                    "--force-rm",
                    "--label",
                    f"{INPUTS_LABEL}={inputs}",
                    "--build-arg",
                    f"PYTHON_IMAGE={base}",
                    "--file",
                    str(context / "Dockerfile"),
                    "--tag",
                    name,
                    str(context),
                ),
                progress=progress,
                # The classic builder: BuildKit would fetch its Dockerfile frontend.
                env={**docker.env(), "DOCKER_BUILDKIT": "0"},
                log=logs / f"{recipe.kind}.log",
            )
    built_id = docker.image_id(name)
    if built_id is None:
        raise BuildError(f"docker build finished but the daemon has no {name}")
    return Built(name, built_id, inputs, False, time.monotonic() - began)


def build_images(
    runtime_cpu_image: str = RUNTIME_CPU_IMAGE,
    operator_image: str = OPERATOR_IMAGE,
    cache_dir: Path | None = None,
) -> tuple[Docker, list[Built]]:
    """Both images in the daemon `ensure_docker` finds or starts."""
    cache = (cache_dir or default_cache_dir()).expanduser().resolve()
    progress = Progress(LOG_PREFIX)
    try:
        docker = ensure_docker(cache, progress)
    except DockerError as err:
        raise ImagesUnavailable(str(err)) from err
    # One build at a time per cache: a second caller then finds the images built.
    with build_lock(cache / "images" / ".build.lock"):
        base = ensure_base_image(docker, cache, progress)
        built = [
            build_image(docker, recipe, name, base, cache, progress)
            for recipe, name in ((OPERATOR, operator_image), (RUNTIME_CPU, runtime_cpu_image))
        ]
    return docker, built


def _report(docker: Docker, built: Iterator[Built] | list[Built]) -> None:
    for image in built:
        how = "cached" if image.cached else "built"
        print(f"{image.name}: {image.image_id[:19]} ({how} in {image.seconds:.1f}s)")
    print(f"export DOCKER_HOST={docker.host}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runtime-cpu-image", default=RUNTIME_CPU_IMAGE)
    parser.add_argument("--operator-image", default=OPERATOR_IMAGE)
    parser.add_argument(
        "--cache", type=Path, default=None, help="default: $SPECPAIR_CACHE or ~/.cache/specpair"
    )
    parser.add_argument(
        "--skip-unavailable",
        action="store_true",
        help="where no Docker daemon can run, say why and exit 0 (make test)",
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        docker, built = build_images(args.runtime_cpu_image, args.operator_image, args.cache)
    except ImagesUnavailable as err:
        if args.skip_unavailable:
            print(f"images skipped: {err}", file=sys.stderr)
            return 0
        print(f"make images failed: {err}", file=sys.stderr)
        return 1
    except BuildError as err:
        print(f"make images failed: {err}", file=sys.stderr)
        return 1
    _report(docker, built)
    print(f"images ready in {time.monotonic() - began:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
