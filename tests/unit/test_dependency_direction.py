"""The layering rules of docs/architecture.md, checked on the source's imports."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "runtime" / "specpair_runtime"
OPERATOR = ROOT / "operator" / "specpair_operator"

# The runtime's torch-free modules that the operator may import.
CONTRACT_MODULES = {
    "specpair_runtime.config",
    "specpair_runtime.golden",
    "specpair_runtime.planner",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def sources(package: Path) -> list[Path]:
    return sorted(package.rglob("*.py"))


def test_no_init_in_operator_source_root() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists(), "it would shadow stdlib `operator`"


@pytest.mark.parametrize("path", sources(RUNTIME), ids=lambda p: str(p.relative_to(ROOT)))
def test_runtime_never_imports_kubernetes(path: Path) -> None:
    bad = {m for m in imported_modules(path) if top(m) in {"kopf", "kubernetes"}}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def contract_paths() -> list[Path]:
    return [RUNTIME / (name.split(".")[1] + ".py") for name in sorted(CONTRACT_MODULES)]


@pytest.mark.parametrize("path", contract_paths(), ids=lambda p: p.name)
def test_contract_modules_are_torch_free(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.name} not present")
    imports = imported_modules(path)
    heavy = {m for m in imports if top(m) in {"torch", "transformers", "tokenizers"}}
    assert not heavy, f"{path.name} imports {sorted(heavy)}"
    internal = {m for m in imports if top(m) == "specpair_runtime"}
    outside = {m for m in internal if not any(m.startswith(c) for c in CONTRACT_MODULES)}
    assert not outside, f"contract module {path.name} imports non-contract {sorted(outside)}"


@pytest.mark.parametrize("path", sources(OPERATOR), ids=lambda p: str(p.relative_to(ROOT)))
def test_operator_imports_only_contract_modules(path: Path) -> None:
    imports = imported_modules(path)
    heavy = {m for m in imports if top(m) in {"torch", "transformers", "tokenizers"}}
    assert not heavy, f"{path.name} imports {sorted(heavy)}"
    runtime = {m for m in imports if top(m) == "specpair_runtime"}
    outside = {m for m in runtime if not any(m.startswith(c) for c in CONTRACT_MODULES)}
    assert not outside, f"{path.name} imports non-contract runtime modules {sorted(outside)}"


ENGINE = RUNTIME / "engine"
CPU_BACKEND = "specpair_runtime.engine.cpu"
# The one place that may reach the CPU backend, inside a function that runs only
# for a model on the CPU (``loading.prepare_model``).
CPU_BACKEND_GATES = {("engine/loading.py", "prepare_model")}


def module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.module is None or node.level != 0:
        return set()
    return {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}


def load_time_imports(path: Path, *, type_checking: bool = False) -> set[str]:
    """What importing ``path`` imports: its module-level imports, not those inside
    functions (nor those under ``if TYPE_CHECKING:``, unless ``type_checking``)."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= _import_names(node)
        elif isinstance(node, ast.If) and (type_checking or not _is_type_checking(node)):
            pending += [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            pending += [*node.body, *node.orelse, *node.finalbody]
            pending += [stmt for handler in node.handlers for stmt in handler.body]
        elif isinstance(node, ast.ClassDef):
            pending += node.body
    return found


def function_imports(path: Path) -> set[tuple[str, str]]:
    """(function name, imported module) of every import inside a function of ``path``."""
    found: set[tuple[str, str]] = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    found |= {(function.name, name) for name in _import_names(node)}
    return found


def runtime_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sources(RUNTIME)}


def internal(names: set[str], modules: dict[str, Path]) -> set[str]:
    """The runtime modules among imported names (``from pkg import module`` counts)."""
    return {name for name in names if name in modules}


@pytest.mark.parametrize("path", sources(ENGINE), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_engine_never_imports_the_server(path: Path) -> None:
    server = {m for m in imported_modules(path) if m.startswith("specpair_runtime.server")}
    assert not server, f"{path.name} imports {sorted(server)}"


def test_the_runtime_has_no_import_cycles() -> None:
    """Module-level imports, type-checking ones too, form no cycle: each module can be
    read after the ones it uses (graphs and runner once imported each other)."""
    modules = runtime_modules()
    graph = {
        name: internal(load_time_imports(path, type_checking=True), modules) - {name}
        for name, path in modules.items()
    }
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_only_the_cpu_gate_reaches_the_cpu_backend() -> None:
    """Outside ``engine/cpu/`` no module imports the backend when it loads, and only
    ``loading.prepare_model`` imports it at all (for a model on the CPU)."""
    for name, path in runtime_modules().items():
        if name.startswith(CPU_BACKEND):
            continue
        at_load = {m for m in load_time_imports(path) if m.startswith(CPU_BACKEND)}
        assert not at_load, f"{name} imports {sorted(at_load)} when it loads"
        where = str(path.relative_to(RUNTIME))
        lazy = {(where, f) for f, m in function_imports(path) if m.startswith(CPU_BACKEND)}
        assert lazy <= CPU_BACKEND_GATES, f"{name} imports the CPU backend in {sorted(lazy)}"


CUDA_PATH_PROBE = """
import importlib, sys
import torch
from specpair_runtime.engine.loading import prepare_model
from specpair_runtime.hardware import cpu_info
from tools.tiny_models import build_pair

for name in sys.argv[1:]:
    importlib.import_module(name)
pair = build_pair("llama", seed=0)
prepare_model(pair.target, torch.device("cuda"))  # a CUDA model's one-time rewrites
cpu_info()  # what the server logs at start-up on every device
loaded = sorted(m for m in sys.modules if m.startswith("specpair_runtime.engine.cpu"))
print("cpu backend modules:", loaded)
sys.exit(1 if loaded else 0)
"""


def test_the_cuda_path_does_not_load_the_cpu_backend() -> None:
    """Every runtime module outside the backend, and a CUDA model's preparation, in a
    fresh interpreter: none of them loads ``engine/cpu/``."""
    cuda_path = [
        name
        for name in runtime_modules()
        if not name.startswith(CPU_BACKEND) and name != "specpair_runtime.__main__"
    ]
    run = subprocess.run(
        [sys.executable, "-c", CUDA_PATH_PROBE, *cuda_path],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(RUNTIME.parent)])},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
