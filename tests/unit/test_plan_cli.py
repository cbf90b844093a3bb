"""`python -m specpair_operator plan` and `crds`, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_SAMPLE = ROOT / "crds" / "samples" / "gpu-pair.yaml"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specpair_operator", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_plan_json_for_24gib() -> None:
    run = cli("plan", "-f", str(GPU_SAMPLE), "--gpu-memory", "24Gi", "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert set(plan) == {
        "mode",
        "requiredBytes",
        "deviceBytes",
        "headroomBytes",
        "reason",
        "minDeviceBytes",
    }
    # Same numbers as tests/unit/test_planner.py (sample: batch 8 × 4096, bf16).
    assert plan["mode"] == "TargetOnly"
    assert plan["requiredBytes"] == 21_429_231_616
    assert plan["deviceBytes"] == 24 * 1024**3
    assert plan["headroomBytes"] == 4_340_572_160
    assert plan["reason"].startswith("draft needs 1.91 GiB more")


def test_plan_text_for_80gib() -> None:
    run = cli("plan", "-f", str(GPU_SAMPLE), "--gpu-memory", "81920Mi")
    assert run.returncode == 0, run.stderr
    assert "mode:     Colocated" in run.stdout


def test_plan_uses_spec_gpu_memory(tmp_path: Path) -> None:
    text = GPU_SAMPLE.read_text().replace("    gpus: 1\n", "    gpus: 1\n    gpuMemory: 16Gi\n")
    pair = tmp_path / "pair.yaml"
    pair.write_text(text)
    run = cli("plan", "-f", str(pair), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["mode"] == "DoesNotFit"


def test_the_documented_sample_command_plans_without_a_device() -> None:
    # As documented in the sample and in docs/operations.md: no --gpu-memory, no gpuMemory.
    run = cli("plan", "-f", str(GPU_SAMPLE), "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["mode"] == "Unknown" and plan["deviceBytes"] is None
    assert "spec.resources.gpuMemory" in plan["reason"] and "--gpu-memory" in plan["reason"]
    smallest = plan["minDeviceBytes"]
    assert smallest["targetOnly"] < smallest["colocated"]


def test_smallest_devices_are_exact_boundaries_of_the_planner() -> None:
    smallest = json.loads(cli("plan", "-f", str(GPU_SAMPLE), "--json").stdout)["minDeviceBytes"]
    for size, mode in (
        (smallest["colocated"], "Colocated"),
        (smallest["colocated"] - 1, "TargetOnly"),
        (smallest["targetOnly"], "TargetOnly"),
        (smallest["targetOnly"] - 1, "DoesNotFit"),
    ):
        run = cli("plan", "-f", str(GPU_SAMPLE), "--gpu-memory", str(size), "--json")
        assert json.loads(run.stdout)["mode"] == mode, (size, run.stderr)


@pytest.mark.parametrize("value", ["lots", "0", "500m", "99999999999999999999999Ei", "2Ei"])
def test_bad_quantity_names_the_flag(value: str) -> None:
    run = cli("plan", "-f", str(GPU_SAMPLE), "--gpu-memory", value)
    assert run.returncode == 2
    line = run.stderr.strip()
    assert line.startswith("error: --gpu-memory: ") and len(line.splitlines()) == 1, line


def test_bad_spec_names_the_field(tmp_path: Path) -> None:
    pair = tmp_path / "pair.yaml"
    pair.write_text(
        GPU_SAMPLE.read_text().replace("kvHeads: 8, headDim: 128", "kvHeads: 0, headDim: 128")
    )
    run = cli("plan", "-f", str(pair), "--gpu-memory", "80Gi")
    assert run.returncode == 2
    line = run.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "spec.target.size.kvHeads" in line


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    run = cli("plan", "-f", str(tmp_path / "nope.yaml"), "--gpu-memory", "80Gi")
    assert run.returncode == 2
    assert "cannot read" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_crds_command_writes_the_committed_file(tmp_path: Path) -> None:
    out = tmp_path / "crd.yaml"
    run = cli("crds", "--output", str(out))
    assert run.returncode == 0, run.stderr
    committed = ROOT / "crds" / "specpair.dev_speculativepairs.yaml"
    assert out.read_text() == committed.read_text()
