"""The operator's Helm chart, rendered with the cached real helm binary.

Used by tests/unit/test_chart.py, tests/unit/test_observability_assets.py
and tests/integration/test_helm_install.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from tools.control_plane import Binaries

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "charts" / "specpair-operator"
CRD = ROOT / "crds" / "specpair.dev_speculativepairs.yaml"
RELEASE = "specpair"
NAMESPACE = "specpair-system"


class HelmError(AssertionError):
    """helm exited non-zero; the message holds the command and its output."""


def run_helm(binaries: Binaries, *args: str, timeout_s: float = 120.0) -> str:
    argv = [str(binaries.helm), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout_s)
    if done.returncode != 0:
        raise HelmError(
            f"`helm {' '.join(args)}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return done.stdout


def set_args(values: dict[str, str]) -> list[str]:
    """`--set k=v` for each value (use `{a,b}` for lists, as helm does)."""
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render(
    binaries: Binaries, values: dict[str, str] | None = None, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """`helm template` of the chart: the rendered objects (CRDs not included)."""
    text = run_helm(
        binaries,
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        namespace,
        *set_args(values or {}),
    )
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def values() -> dict[str, Any]:
    data = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(data, dict)
    return data
