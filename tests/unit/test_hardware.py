"""The CPU description that benchmark reports carry."""

from __future__ import annotations

from pathlib import Path

from specpair_runtime.hardware import cpu_info, cpu_model

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu avx avx2 fma

processor\t: 1
model name\t: AMD EPYC
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
CPU part\t: 0xd0c

Hardware\t: BCM2835
"""


def test_x86_model_name() -> None:
    assert cpu_model(X86) == "AMD EPYC"


def test_arm_hardware_line_wins_over_cpu_part() -> None:
    assert cpu_model(ARM) == "BCM2835"


def test_no_model_line() -> None:
    assert cpu_model("processor\t: 0\nmodel name\t:\n") is None
    assert cpu_model("") is None


def test_cpu_info_reads_the_given_file(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(X86)
    info = cpu_info(path)
    assert info["cpu_model"] == "AMD EPYC"
    assert isinstance(info["cpu_isa"], str) and info["cpu_isa"]
    assert isinstance(info["bf16_gemm"], bool)


def test_cpu_info_without_the_file(tmp_path: Path) -> None:
    info = cpu_info(tmp_path / "missing")
    assert isinstance(info["cpu_model"], str) and info["cpu_model"]
