"""The layering rules of docs/architecture.md, checked on the source's imports."""

from __future__ import annotations

import ast
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
