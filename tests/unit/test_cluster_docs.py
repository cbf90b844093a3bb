"""The cluster docs agree with each other and with the code (issue 11, item 12).

tests/integration/test_cluster_docs.py runs the kubectl and Helm commands on
the v1.20 apiserver; this file checks the text: one CRD upgrade order
everywhere, every documented `plan` command runs, and the API reference
states the bounds the schema has.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "operations.md",
    ROOT / "charts" / "specpair-operator" / "README.md",
    ROOT / "charts" / "specpair-operator" / "templates" / "NOTES.txt",
]
PLAN_COMMAND = re.compile(r"python -m specpair_operator (plan [^`\n]*)")
RENDER_COMMAND = re.compile(r"python -m specpair_operator (render [^`\n|]*)")


def test_every_doc_upgrades_the_crd_before_the_chart() -> None:
    for doc in CLUSTER_DOCS:
        text = " ".join(doc.read_text().split())
        assert re.search(r"\bbefore\*{0,2} (the next )?`helm upgrade`", text, re.I), doc
        assert not re.search(r"\bafter `helm upgrade`", text, re.I), doc


def documented_plan_commands(pattern: re.Pattern[str] = PLAN_COMMAND) -> list[tuple[Path, str]]:
    found = []
    for doc in [*CLUSTER_DOCS, *sorted((ROOT / "crds" / "samples").glob("*.yaml"))]:
        for match in pattern.finditer(doc.read_text()):
            found.append((doc, match.group(1).strip()))
    return found


@pytest.mark.parametrize(
    ("doc", "command"), documented_plan_commands(RENDER_COMMAND), ids=lambda v: str(v)[-40:]
)
def test_documented_render_commands_run(doc: Path, command: str) -> None:
    args = shlex.split(command)
    done = subprocess.run(
        [sys.executable, "-m", "specpair_operator", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, f"{doc}: `{command}`: {done.stderr}"
    kinds = [d["kind"] for d in yaml.safe_load_all(done.stdout) if d]
    assert kinds[:2] == ["ConfigMap", "Service"], kinds
    assert kinds[2] in ("Deployment", "LeaderWorkerSet"), kinds


@pytest.mark.parametrize(("doc", "command"), documented_plan_commands(), ids=lambda v: str(v)[-40:])
def test_documented_plan_commands_run(doc: Path, command: str) -> None:
    args = shlex.split(command)
    file = Path(args[args.index("-f") + 1])
    if not (ROOT / file).exists():
        pytest.skip(f"{doc.name} plans the reader's own {file}")
    done = subprocess.run(
        [sys.executable, "-m", "specpair_operator", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, f"{doc}: `{command}`: {done.stderr}"
    assert "mode:" in done.stdout or '"mode"' in done.stdout


def test_there_are_documented_plan_commands() -> None:
    assert len(documented_plan_commands()) >= 4


def test_api_reference_states_the_exclusive_bounds() -> None:
    api_md = (ROOT / "docs" / "api.md").read_text()
    row = next(line for line in api_md.splitlines() if line.startswith("| `headroomFraction`"))
    assert ">= 0.0; < 1.0" in row
