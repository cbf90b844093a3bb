"""bench/bench_engines.py's bookkeeping (the servers themselves run in make bench-engines)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.bench_engines import ModeResult, modes


def test_modes_run_specpair_then_vllm_per_dtype(tmp_path: Path) -> None:
    args = argparse.Namespace(
        modes=["specpair", "vllm-target", "vllm-draft"],
        vllm_dtypes=["float32", "bfloat16"],
        threads=2,
        depth=4,
    )
    found = modes(args, tmp_path)
    assert [name for name, _, _ in found] == [
        "specpair",
        "vllm-target-float32",
        "vllm-draft-float32",
        "vllm-target-bfloat16",
        "vllm-draft-bfloat16",
    ]
    assert [model for _, _, model in found] == [None] + ["qwen2.5-coder"] * 4


def test_summary_gives_the_median_its_range_and_the_ratio() -> None:
    result = ModeResult("vllm-draft-float32", rounds=[4.0, 6.0, 5.0], tokens=300)
    result.drafted, result.accepted, result.steps = 400.0, 300.0, 100.0
    row = result.summary(baseline=2.5)
    assert row["tokens_per_second"] == 5.0 and row["range"] == [4.0, 6.0]
    assert row["ratio_to_vllm_target"] == 2.0
    assert row["acceptance_rate"] == 0.75 and row["mean_acceptance_length"] == 4.0
