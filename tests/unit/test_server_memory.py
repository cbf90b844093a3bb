"""Memory-pressure hysteresis, the probe's test hook and the pause decision."""

from __future__ import annotations

import pytest

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.server.memory import MemoryProbe, PressureGate
from specpair_runtime.server.scheduler import pause_reason


def test_gate_turns_on_above_threshold_and_off_only_below_the_margin() -> None:
    gate = PressureGate(threshold=0.9, margin=0.05)
    readings = [0.5, 0.9, 0.91, 0.92, 0.88, 0.86, 0.91, 0.84, 0.86, 0.95]
    changes = [gate.update(r) for r in readings]
    # 0.9 itself is not above; 0.88 and 0.86 are inside the band, so no flapping.
    assert changes == [None, None, True, None, None, None, None, False, None, True]
    assert gate.under_pressure


def test_low_threshold_keeps_a_positive_release_point() -> None:
    gate = PressureGate(threshold=0.04, margin=0.05)
    assert gate.release_below == pytest.approx(0.02)
    assert gate.update(0.05) is True
    assert gate.update(0.03) is None
    assert gate.update(0.01) is False


def test_probe_reads_a_real_fraction_and_the_hook_overrides_it() -> None:
    probe = MemoryProbe("cpu")
    real = probe.reading()
    assert 0.0 < real < 1.0
    probe.force(0.99)
    assert probe.reading() == 0.99
    probe.force(None)
    assert 0.0 < probe.reading() < 1.0


def test_pause_reason_prefers_memory_pressure_then_batch_size() -> None:
    knobs = SpeculationKnobs(disable_above_batch_size=2)
    assert pause_reason(False, 2, knobs) is None
    assert pause_reason(False, 3, knobs) == "batch_size"
    assert pause_reason(True, 3, knobs) == "memory_pressure"
    assert pause_reason(True, 1, knobs) == "memory_pressure"
    assert pause_reason(False, 100, SpeculationKnobs()) is None
