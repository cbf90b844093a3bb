"""`specpair-operator plan` and `render` for engine vllm, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "crds" / "samples"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specpair_operator", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def variant(tmp_path: Path, sample: str, **resources: object) -> Path:
    body = yaml.safe_load((SAMPLES / sample).read_text())
    body["spec"]["resources"].update(resources)
    path = tmp_path / "pair.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_plan_json_gives_the_vllm_layout_for_a_target_that_needs_four_gpus() -> None:
    run = cli("plan", "-f", str(SAMPLES / "vllm-70b-pair.yaml"), "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["mode"] == "Colocated" and plan["engine"] == "vllm"
    assert (plan["tensorParallelSize"], plan["pipelineParallelSize"]) == (4, 1)
    assert (plan["nodes"], plan["workload"]) == (1, "Deployment")
    assert plan["smallestTensorParallelSize"] == 4
    assert plan["gpuMemoryUtilization"] == 0.9
    assert plan["perGpu"]["targetWeightsBytes"] == 35_276_853_248
    assert plan["requiredBytes"] == sum(plan["perGpu"].values())


def test_too_few_gpus_are_refused_by_plan_and_render_with_the_numbers(tmp_path: Path) -> None:
    pair = variant(tmp_path, "vllm-70b-pair.yaml", gpus=2)
    plan = json.loads(cli("plan", "-f", str(pair), "--json").stdout)
    assert plan["mode"] == "DoesNotFit"
    assert "it alone needs 89.72 GiB but only 72.00 GiB usable per GPU" in plan["reason"]
    run = cli("render", "-f", str(pair))
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("error: the pair does not fit, so the operator creates nothing")
    assert "(resources.gpus: 4)" in run.stderr


def test_render_prints_a_leader_worker_set_where_one_node_is_not_enough(tmp_path: Path) -> None:
    run = cli("render", "-f", str(SAMPLES / "vllm-70b-pair.yaml"), "--gpus-per-node", "2")
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "LeaderWorkerSet"]
    assert docs[2]["spec"]["leaderWorkerTemplate"]["size"] == 2
    plan = json.loads(
        cli(
            "plan", "-f", str(SAMPLES / "vllm-70b-pair.yaml"), "--gpus-per-node", "2", "--json"
        ).stdout
    )
    assert (plan["nodes"], plan["gpusPerPod"], plan["workload"]) == (2, 2, "LeaderWorkerSet")


def test_render_of_engine_specpair_is_the_runtime_deployment() -> None:
    run = cli("render", "-f", str(SAMPLES / "gpu-pair.yaml"), "--gpu-memory", "80Gi")
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "Deployment"]
    pod = docs[2]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["runtime"]
    assert "runtime.yaml" in docs[0]["data"]


def test_render_names_what_is_wrong(tmp_path: Path) -> None:
    bare = tmp_path / "spec.yaml"
    bare.write_text(
        yaml.safe_dump(yaml.safe_load((SAMPLES / "vllm-70b-pair.yaml").read_text())["spec"])
    )
    run = cli("render", "-f", str(bare))
    assert run.returncode == 2 and "metadata.name is missing" in run.stderr
    wrong = variant(tmp_path, "vllm-70b-pair.yaml", gpus=3)
    run = cli("render", "-f", str(wrong))
    assert run.returncode == 1 and "8 KV heads cannot be split over 3 GPUs" in run.stderr
    run = cli("plan", "-f", str(SAMPLES / "vllm-70b-pair.yaml"), "--gpus-per-node", "zero")
    assert run.returncode == 2 and "--gpus-per-node" in run.stderr
    specpair = variant(tmp_path, "gpu-pair.yaml", gpus=2)
    run = cli("plan", "-f", str(specpair))
    assert run.returncode == 2 and "set engine: vllm" in run.stderr
