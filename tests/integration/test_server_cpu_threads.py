"""``serving.cpuThreads`` and ``--cpu-threads`` on a real ``serve`` process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from specpair_runtime.hardware import cpu_info
from tests.support.server_harness import (
    metric_value,
    subprocess_server,
    wait_until_ready,
    write_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_flag_overrides_the_file_and_the_count_is_in_force(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    config = write_config(tmp_path / "config.yaml", *pair, serving={"cpuThreads": 2})
    with subprocess_server(config, tmp_path / "server.log", "--cpu-threads", "1") as server:
        assert wait_until_ready(server.base_url)["ready"], server.log()
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            answer = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            metrics = client.get("/metrics").text
        assert metric_value(metrics, "specpair_cpu_threads") == 1
        assert "cpu threads: 1 (serving.cpuThreads is 1)" in server.log()
        # The CPU it runs on, as the benchmarks report it.
        cpu = cpu_info()
        bf16 = str(cpu["bf16_gemm"]).lower()
        labels = {"cpu_model": str(cpu["cpu_model"]), "cpu_isa": str(cpu["cpu_isa"])}
        assert metric_value(metrics, "specpair_cpu_info", **labels, bf16_gemm=bf16) == 1, metrics
        assert f"cpu: {cpu['cpu_model']} ({cpu['cpu_isa']}, " in server.log()


def test_a_bad_count_is_refused_naming_the_field(pair: tuple[Path, Path], tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", *pair)
    done = subprocess.run(
        [sys.executable, "-m", "specpair_runtime", "serve", "--config", str(config),
         "--cpu-threads", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "serving.cpuThreads" in done.stderr and "greater than or equal to 1" in done.stderr
