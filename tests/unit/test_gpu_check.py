"""``make gpu-check``: the no-CUDA exit here, and the report's parts on real pytest output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tools import gpu_check

SCRIPT = Path(gpu_check.__file__)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
@pytest.mark.parametrize("flags", [[], ["--preflight"]])
def test_without_cuda_it_exits_2_and_says_why(tmp_path: Path, flags: list[str]) -> None:
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--output", str(report), *flags],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("gpu-check: no CUDA: ")
    assert message.endswith(". Nothing was run.")
    assert "CPU-only build" in message or "sees no CUDA device" in message
    assert not report.exists()


SAMPLE_TESTS = """
import pytest

def test_ok(record_property):
    record_property("divergences", "[]")

def test_bad():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="no device")
def test_skipped():
    pass
"""


def run_sample(tmp_path: Path, source: str) -> gpu_check.TestSummary:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sample.py").write_text(source)
    args = [str(tmp_path / "test_sample.py"), "-q", "-p", "no:cacheprovider"]
    args += ["--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini")]
    return gpu_check.run_tests(args, tmp_path)


def test_test_results_come_from_pytests_junit_report(tmp_path: Path) -> None:
    summary = run_sample(tmp_path, SAMPLE_TESTS)
    outcomes = {case.name.rsplit("::", 1)[1]: case.outcome for case in summary.cases}
    assert outcomes == {"test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped"}
    bad = next(case for case in summary.cases if case.outcome == "failed")
    assert "one is not two" in bad.message
    ok = next(case for case in summary.cases if case.outcome == "passed")
    assert ok.properties == {"divergences": "[]"}
    assert summary.exit_code == 1 and not summary.passed
    assert summary.to_dict()["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}


def test_a_skip_is_not_a_pass(tmp_path: Path) -> None:
    skipped_only = SAMPLE_TESTS.split("def test_bad")[0] + "\ndef test_x():\n    pytest.skip('x')\n"
    assert not run_sample(tmp_path, skipped_only).passed
    assert run_sample(tmp_path, "def test_fine():\n    pass\n").passed


def test_the_bench_result_is_the_last_json_line() -> None:
    printed = 'torch threads: 16\ncommand: specpair-runtime bench\n{"modes": [1]}\n'
    assert gpu_check.last_json_line(printed) == {"modes": [1]}
    assert gpu_check.last_json_line("no json here\n{broken\n") is None


def test_bench_flags_after_a_double_dash() -> None:
    args, extra = gpu_check.parse_args(["--skip-bench", "--", "--runs", "5"])
    assert args.skip_bench and extra == ["--runs", "5"]


def test_a_given_gpu_python_installs_and_fetches_nothing() -> None:
    """``make gpu-check GPU_PYTHON=...``: an offline GPU image's own interpreter, as it is."""
    root = SCRIPT.parents[1]
    planned = subprocess.run(
        ["make", "-n", "--no-print-directory", "gpu-check", "GPU_PYTHON=/opt/gpu/bin/python3"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert planned.splitlines() == [
        "PYTHONPATH=runtime:operator:.${PYTHONPATH:+:$PYTHONPATH} "
        "/opt/gpu/bin/python3 -m tools.gpu_check --output gpu-check.json"
    ]
