"""The CPU thread count: configured, OMP_NUM_THREADS, or torch's default capped by the quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair_runtime.config import ConfigError, RuntimeConfig, parse_runtime_config
from specpair_runtime.cpu_threads import ThreadPlan, cgroup_cpu_limit, plan_cpu_threads


def cgroup_files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "200000 100000"}, 2.0),
        ({"cpu.max": "150000 100000"}, 1.5),
        ({"cpu.max": "garbage"}, None),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "400000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 4),
        ({"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "0"}, None),
        ({}, None),
    ],
)
def test_cgroup_cpu_limit_reads_v2_and_v1(
    tmp_path: Path, files: dict[str, str], limit: float | None
) -> None:
    assert cgroup_cpu_limit(cgroup_files(tmp_path, files)) == limit


def test_a_configured_count_wins_over_everything() -> None:
    plan = plan_cpu_threads(3, {"OMP_NUM_THREADS": "8"}, torch_default=16, cpu_limit=2.0)
    assert plan == ThreadPlan(3, "serving.cpuThreads is 3")


def test_omp_num_threads_is_left_to_torch() -> None:
    plan = plan_cpu_threads(None, {"OMP_NUM_THREADS": "4"}, torch_default=4, cpu_limit=2.0)
    assert plan.threads is None and "OMP_NUM_THREADS is '4'" in plan.reason


@pytest.mark.parametrize(
    ("limit", "threads"), [(2.0, 2), (2.5, 2), (0.5, 1), (1.0, 1), (16.0, None), (64.0, None)]
)
def test_the_quota_caps_torchs_default_rounding_down(limit: float, threads: int | None) -> None:
    plan = plan_cpu_threads(None, {}, torch_default=16, cpu_limit=limit)
    assert plan.threads == threads
    if threads is not None:
        assert f"quota is {limit:g} CPUs" in plan.reason


def test_without_a_quota_torchs_default_stays() -> None:
    assert plan_cpu_threads(None, {}, torch_default=2, cpu_limit=None).threads is None


def config_with(serving: dict[str, object]) -> RuntimeConfig:
    return parse_runtime_config(
        {
            "pair": {"name": "p", "version": "v"},
            "target": {"source": "/models/t"},
            "draft": {"source": "/models/d"},
            "serving": serving,
        }
    )


@pytest.mark.parametrize("value", [0, -1, 1025])
def test_a_bad_count_names_the_field(value: int) -> None:
    with pytest.raises(ConfigError, match=r"serving\.cpuThreads"):
        config_with({"cpuThreads": value})
