"""The chart's HA pieces: replicas with leader election, and a PodDisruptionBudget."""

from __future__ import annotations

from tools.control_plane import Binaries

from tests.support.helm_chart import find, render


def test_two_replicas_elect_a_leader_and_a_drain_leaves_one(
    control_plane_binaries: Binaries,
) -> None:
    objects = render(control_plane_binaries)
    (deployment,) = find(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-election" in args and "--lease-seconds=8" in args
    (pdb,) = find(objects, "PodDisruptionBudget")
    # helm template's default capabilities serve policy/v1; a 1.20 cluster gets v1beta1
    # (tests/integration/test_helm_install.py installs into one).
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_one_replica_gets_no_budget(control_plane_binaries: Binaries) -> None:
    objects = render(control_plane_binaries, {"replicas": "1"})
    assert not find(objects, "PodDisruptionBudget")
    assert find(objects, "Deployment")[0]["spec"]["replicas"] == 1
