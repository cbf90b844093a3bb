"""``make gpu-check``: the CUDA checks of the real pair in bf16, in one JSON report.

On a machine with a CUDA GPU and the real pair in the cache (``make models``):

1. runs the ``cuda``-marked tests (greedy identity within the near-tie margin,
   the golden check, graph capture), with a junit XML per test;
2. runs the engine benchmark (``bench/bench_engine.py``: target-only,
   speculation, HF assisted) in bf16, and ``bench/bench_numerics.py`` (how far
   the target's bf16 logits move between kernel shapes: what the golden
   check's near-tie margin must cover), and ``bench/bench_forward.py`` (what a
   forward of n tokens costs against one through the CUDA graphs, replay
   against eager, and how long the graph warm-up takes);
3. writes one JSON report (``gpu-check.json`` unless ``--output``) and prints
   its path. Exit 0 when every test passed (none skipped) and all three benchmarks ran.

Without CUDA it exits 2 with a message that says why, before doing anything
else (``--preflight`` does only that check). Without the real pair in the
cache it runs what needs no real weights (the tests that build tiny models,
and the engine bench and the forward costs on the pair's architecture with
random weights), and the report fails with ``"real_pair": false``. Offline:
nothing here needs a network or files outside the repo and the model cache.

    .venv/bin/python -m tools.gpu_check [--output FILE] [--skip-bench] [-- BENCH FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specpair_runtime.config import ServingOptions
from specpair_runtime.openmp import openmp_environ

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 2
# The benchmark in bf16, the dtype the runtime picks on CUDA, spelled out.
BENCH_FLAGS = ("--dtype", "bfloat16", "--json")
# The forward costs as a server with the default maxBatchSize and maxModelLength runs
# them (the warm-up records every row bucket; the dense step reads whole slots), with
# eager forwards on the same modules alternating with the replays.
_SERVING = ServingOptions()
FORWARD_FLAGS = (
    "--baseline-eager",
    *("--slots", str(_SERVING.max_batch_size)),
    *("--max-length", str(_SERVING.max_model_length)),
)
TEST_TIMEOUT_SECONDS = 3600
BENCH_TIMEOUT_SECONDS = 3600


def offline_env() -> dict[str, str]:
    """The environment of the child processes: no model hub, the runtime's OpenMP defaults."""
    env = openmp_environ(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env


def cuda_problem() -> str | None:
    """Why this machine cannot run the CUDA checks, or None when it can."""
    import torch

    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build; gpu-check needs a CUDA "
            "build of the same version and a CUDA GPU"
        )
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; "
            "gpu-check needs a machine with a CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES)"
        )
    return None


def device_info() -> dict[str, object]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "total_memory_bytes": int(props.total_memory),
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


@dataclass(frozen=True)
class TestCase:
    name: str
    outcome: str  # passed, failed, error or skipped
    seconds: float
    message: str = ""
    properties: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TestSummary:
    exit_code: int
    cases: list[TestCase]

    def count(self, outcome: str) -> int:
        return sum(case.outcome == outcome for case in self.cases)

    @property
    def passed(self) -> bool:
        """Every case passed: a skip is a failure here (the machine should run them all)."""
        return self.exit_code == 0 and bool(self.cases) and self.count("passed") == len(self.cases)

    def to_dict(self) -> dict[str, object]:
        return {
            "passed": self.passed,
            "exit_code": self.exit_code,
            "counts": {o: self.count(o) for o in ("passed", "failed", "error", "skipped")},
            "cases": [asdict(case) for case in self.cases],
        }


def read_junit(path: Path) -> list[TestCase]:
    """The test cases of a pytest junit XML file, with their outcome and recorded properties."""
    cases = []
    for node in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            child = node.find(kind)
            if child is not None:
                outcome = "failed" if kind == "failure" else kind
                message = child.get("message") or (child.text or "").strip()
                break
        properties = {prop.get("name", ""): prop.get("value", "") for prop in node.iter("property")}
        name = f"{node.get('classname', '')}::{node.get('name', '')}"
        cases.append(
            TestCase(name, outcome, float(node.get("time") or 0.0), message[:2000], properties)
        )
    return cases


def run_tests(pytest_args: list[str], work: Path) -> TestSummary:
    """Run pytest with ``pytest_args`` (output goes to the console) and read its junit XML."""
    junit = work / "junit.xml"
    # xunit1: the junit family that keeps the properties tests record (the margins).
    junit_args = [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    command = [sys.executable, "-m", "pytest", *pytest_args, *junit_args]
    print("$ " + " ".join(command), flush=True)
    completed = subprocess.run(
        command, cwd=ROOT, env=offline_env(), timeout=TEST_TIMEOUT_SECONDS, check=False
    )
    cases = read_junit(junit) if junit.exists() else []
    return TestSummary(completed.returncode, cases)


def json_lines(text: str) -> list[dict[str, object]]:
    """Every stdout line that is a JSON object."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                document = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(document, dict):
                found.append(document)
    return found


def last_json_line(text: str) -> dict[str, object] | None:
    """The last stdout line that is a JSON object (the bench prints a header before it)."""
    found = json_lines(text)
    return found[-1] if found else None


def run_script(script: str, flags: list[str]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    command = [sys.executable, str(ROOT / "bench" / script), *flags]
    print("$ " + " ".join(command), flush=True)
    completed = subprocess.run(
        command,
        cwd=ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_SECONDS,
        check=False,
    )
    sys.stderr.write(completed.stderr[-4000:])
    return completed, command[1:]


def failed(completed: subprocess.CompletedProcess[str]) -> dict[str, object]:
    tail = (completed.stdout + completed.stderr)[-2000:]
    return {"ok": False, "exit_code": completed.returncode, "output_tail": tail}


def run_bench(extra: list[str], *, shaped: bool = False) -> dict[str, object]:
    """``bench/bench_engine.py`` in bf16; its JSON result, or why there is none.

    ``shaped``: on the real pair's architecture with random weights (no real
    pair here): the step costs and the engine's overhead per step are real,
    the acceptance and the speedups are not.
    """
    flags = [*BENCH_FLAGS, *extra, *(["--shaped-pair"] if shaped else [])]
    completed, command = run_script("bench_engine.py", flags)
    result = last_json_line(completed.stdout)
    if completed.returncode != 0 or result is None:
        return {**failed(completed), "shaped_pair": shaped}
    return {"ok": True, "shaped_pair": shaped, "command": command, "result": result}


def run_numerics() -> dict[str, object]:
    """``bench/bench_numerics.py`` on CUDA in bf16: the logit noise the near-tie margin covers."""
    completed, command = run_script("bench_numerics.py", ["--device", "cuda"])
    records = json_lines(completed.stdout)
    if completed.returncode != 0 or not records:
        return failed(completed)
    return {"ok": True, "command": command, "prompts": records}


def run_forward_costs(work: Path, *, shaped: bool) -> dict[str, object]:
    """``bench/bench_forward.py`` on CUDA: what a verify of n tokens costs against one step.

    ``shaped``: on the real pair's architecture with random weights (no real pair here).
    """
    output = work / "forward.json"
    flags = ["--json", str(output), *FORWARD_FLAGS, *(["--shaped-pair"] if shaped else [])]
    completed, command = run_script("bench_forward.py", flags)
    if completed.returncode != 0 or not output.exists():
        return failed(completed)
    return {"ok": True, "command": command, **json.loads(output.read_text())}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description="CUDA tests and the engine benchmark, in one JSON report."
    )
    parser.add_argument("--output", type=Path, default=Path("gpu-check.json"), metavar="FILE")
    parser.add_argument("--preflight", action="store_true", help="only check for CUDA")
    parser.add_argument(
        "--skip-bench", action="store_true", help="run the tests only (no bench, no numerics)"
    )
    parser.add_argument(
        "--pytest-args",
        default="-m cuda tests -q -rs",
        help="what pytest runs (default: every cuda-marked test)",
    )
    if "--" in argv:
        split = argv.index("--")
        return parser.parse_args(argv[:split]), argv[split + 1 :]
    return parser.parse_args(argv), []


def main(argv: list[str]) -> int:
    args, bench_extra = parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(f"gpu-check: no CUDA: {problem}. Nothing was run.", file=sys.stderr)
        return EXIT_NO_CUDA
    if args.preflight:
        return EXIT_OK
    from tools.fetch_models import cached_pair_or_report

    real_pair = cached_pair_or_report("gpu-check") is not None
    if not real_pair:
        # A GPU machine may have no network to fetch the pair: run what needs
        # no real weights, and fail the report, which says what did not run.
        print(
            "gpu-check: without the real pair its tests skip, the numerics do not run, and "
            "the engine bench and the forward costs use its shapes with random weights",
            file=sys.stderr,
        )
    started = time.time()
    skipped: dict[str, object] = {"ok": True, "skipped": True}
    no_pair: dict[str, object] = {"ok": False, "skipped": True, "why": "no real pair"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        tests = run_tests(args.pytest_args.split(), Path(work))
        if args.skip_bench:
            bench, numerics, forward = skipped, skipped, skipped
        else:
            bench = run_bench(bench_extra, shaped=not real_pair)
            numerics = run_numerics() if real_pair else no_pair
            forward = run_forward_costs(Path(work), shaped=not real_pair)
    parts = (bench, numerics, forward)
    report = {
        "passed": real_pair and tests.passed and all(bool(part.get("ok")) for part in parts),
        "real_pair": real_pair,
        "started_unix": started,
        "seconds": round(time.time() - started, 1),
        "device": device_info(),
        "tests": tests.to_dict(),
        "bench": bench,
        "numerics": numerics,
        "forward_costs": forward,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    counts = tests.to_dict()["counts"]

    def status(part: dict[str, object]) -> str:
        if args.skip_bench or part is no_pair:
            return "skipped"
        return "ran" if part.get("ok") else "FAILED"

    print(
        f"gpu-check: tests {counts}; bench {status(bench)}; numerics {status(numerics)}; "
        f"forward costs {status(forward)}"
    )
    print(
        f"gpu-check: {'PASSED' if report['passed'] else 'FAILED'}; report: {args.output.resolve()}"
    )
    return EXIT_OK if report["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
