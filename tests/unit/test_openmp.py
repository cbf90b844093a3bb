"""The runtime's OpenMP defaults: sleep when idle, spin briefly; the user's settings win."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from specpair_operator import builders
from specpair_operator.api import parse_spec
from specpair_runtime import cli
from specpair_runtime.openmp import SPIN_COUNT, openmp_defaults, openmp_environ

ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_environment_gets_a_passive_policy_with_a_short_spin() -> None:
    assert openmp_defaults({}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_a_passive_policy_of_the_user_gets_the_spin_whatever_its_case() -> None:
    assert openmp_defaults({"OMP_WAIT_POLICY": " passive"}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_an_active_policy_is_not_cut_short_by_a_spin_count() -> None:
    assert openmp_defaults({"OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_the_users_spin_count_is_kept() -> None:
    environ = {"GOMP_SPINCOUNT": "0", "PATH": "/bin"}
    assert openmp_environ(environ) == {**environ, "OMP_WAIT_POLICY": "PASSIVE"}


def test_the_cli_sets_the_defaults_before_any_command_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)


def test_the_operators_pods_get_the_spin_from_the_runtime() -> None:
    # The pod env keeps the policy it always had; the runtime adds the spin to it.
    sample = yaml.safe_load((ROOT / "crds" / "samples" / "cpu-pair.yaml").read_text())
    container = builders.container(parse_spec(sample["spec"]), [])
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert "GOMP_SPINCOUNT" not in env
    assert openmp_defaults(env) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
