"""``speculation.duringPrefill``: the device's default, an explicit value, bad input."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specpair_runtime.config import SpeculationKnobs, resolved_during_prefill


@pytest.mark.parametrize(("device_type", "speculates"), [("cpu", False), ("cuda", True)])
def test_unset_it_follows_the_device(device_type: str, speculates: bool) -> None:
    assert resolved_during_prefill(SpeculationKnobs(), device_type) is speculates


@pytest.mark.parametrize("value", [True, False])
def test_a_set_value_holds_on_every_device(value: bool) -> None:
    knobs = SpeculationKnobs.model_validate({"duringPrefill": value})
    assert knobs.to_wire()["duringPrefill"] is value
    assert {resolved_during_prefill(knobs, d) for d in ("cpu", "cuda")} == {value}


def test_a_bad_value_names_the_field() -> None:
    with pytest.raises(ValidationError, match="duringPrefill"):
        SpeculationKnobs.model_validate({"duringPrefill": "sometimes"})
