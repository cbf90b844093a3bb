"""The CPU thread count: configured, OMP_NUM_THREADS, or torch's default capped by the quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair_runtime.config import ConfigError, RuntimeConfig, parse_runtime_config
from specpair_runtime.cpu_threads import ThreadPlan, cgroup_cpu_limit, plan_cpu_threads


def cgroup_files(root: Path, files: dict[str, str], own: str | None = None) -> Path:
    """Lay out cgroup files under ``root``; ``own``: the /proc/self/cgroup text."""
    for name, text in files.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    if own is not None:
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/cgroup").write_text(own)
    return root


V2 = {"cgroup.controllers": "cpu memory"}


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({**V2, "cpu.max": "max 100000"}, None),
        ({**V2, "cpu.max": "200000 100000"}, 2.0),
        ({**V2, "cpu.max": "150000 100000"}, 1.5),
        ({**V2, "cpu.max": "garbage"}, None),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "400000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, 4),
        ({"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "0"}, None),
        ({}, None),
    ],
)
def test_a_namespaced_container_reads_the_mount_root(
    tmp_path: Path, files: dict[str, str], limit: float | None
) -> None:
    assert cgroup_cpu_limit(cgroup_files(tmp_path, files, "0::/\n")) == limit


def test_v2_follows_the_own_cgroup_and_takes_the_smallest_limit_above_it(tmp_path: Path) -> None:
    files = {
        **V2,
        "cpu.max": "max 100000",
        "kubepods/cpu.max": "800000 100000",
        "kubepods/pod1/cpu.max": "300000 100000",
        "kubepods/pod1/app/cpu.max": "max 100000",
        "kubepods/pod2/cpu.max": "100000 100000",  # another pod's: not ours
    }
    root = cgroup_files(tmp_path, files, "0::/kubepods/pod1/app\n")
    assert cgroup_cpu_limit(root) == 3.0


def test_v1_finds_the_cpu_controller_among_the_hierarchies(tmp_path: Path) -> None:
    files = {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
    }
    own = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert cgroup_cpu_limit(cgroup_files(tmp_path, files, own)) == 1.5


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
        assert f"quota: {limit:g} CPU" in plan.reason


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
