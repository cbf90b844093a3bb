"""`python -m specpair_operator run`: flags default to environment variables and go back there."""

from __future__ import annotations

import os

import pytest

from specpair_operator.__main__ import RUN_FLAGS, _parser


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in RUN_FLAGS:
        # setenv first, so that monkeypatch also undoes what `export` writes.
        monkeypatch.setenv(flag.env, "")
        monkeypatch.delenv(flag.env)


def test_flags_default_to_their_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPAIR_WORKERS", "7")
    monkeypatch.setenv("SPECPAIR_RESYNC_SECONDS", "2.5")
    monkeypatch.setenv("SPECPAIR_METRICS_ADDRESS", "0.0.0.0")
    args = _parser().parse_args(["run"])
    assert (args.workers, args.resync_seconds, args.metrics_address) == (7, 2.5, "0.0.0.0")
    assert (args.metrics_port, args.lease_seconds, args.scrape_seconds) == (8080, 8, 30.0)
    assert _parser().parse_args(["run", "--workers", "3"]).workers == 3  # the flag wins


def test_a_bad_environment_value_names_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPECPAIR_METRICS_PORT", "eighty")
    with pytest.raises(SystemExit) as raised:
        _parser().parse_args(["run"])
    assert raised.value.code == 2
    assert "--metrics-port: invalid int value: 'eighty'" in capsys.readouterr().err
    _parser().parse_args(["plan", "-f", "pair.yaml"])  # other commands do not read it


def test_parsed_values_go_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parser().parse_args(["run", "--lease-name", "mine", "--resync-seconds", "1"])
    for flag in RUN_FLAGS:
        flag.export(args)
    assert os.environ["SPECPAIR_LEASE_NAME"] == "mine"
    assert float(os.environ["SPECPAIR_RESYNC_SECONDS"]) == 1.0
    assert int(os.environ["SPECPAIR_METRICS_PORT"]) == 8080
