"""bench/bench_cpu_threads.py: a serving step on 1 thread and on all, with a core busy or not."""

from __future__ import annotations

import argparse

import pytest
import torch
from bench.bench_cpu_threads import busy_cores, main, parse_sizes


def test_sizes_keep_zero_for_a_step_without_a_chunk() -> None:
    assert parse_sizes("0, 16,256") == [0, 16, 256]


@pytest.mark.parametrize("text", ["-1", "x", ""])
def test_bad_sizes_name_the_flag(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes(text)
    with pytest.raises(SystemExit):
        main(["--chunks", text])
    assert "argument --chunks:" in capsys.readouterr().err


def test_busy_processes_spin_inside_the_block_and_are_gone_after() -> None:
    with busy_cores(2) as spinners:
        assert len(spinners) == 2 and all(p.poll() is None for p in spinners)
    assert all(p.poll() is not None for p in spinners)


def test_a_short_run_prints_every_setting_and_restores_the_threads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = torch.get_num_threads()
    assert main(["--chunks", "0,8", "--rows", "2", "--rounds", "1", "--busy", "1"]) == 0
    assert torch.get_num_threads() == before
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("0", "8"), ("1", "0"), ("1", "8")]
    assert all(float(value) > 0 for r in rows for value in r[2 : 2 + len({1, before})])
