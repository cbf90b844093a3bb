"""tools/deploy.py's pure parts: the chart's image values, a kubeconfig's credentials."""

from __future__ import annotations

from pathlib import Path

import pytest
from tools.control_plane import kubeconfig_yaml
from tools.deploy import DeployError, KubeconfigClient, image_values


def test_the_chart_points_at_a_local_operator_image() -> None:
    assert image_values("specpair/operator:dev") == [
        "--set",
        "image.repository=specpair/operator",
        "--set",
        "image.tag=dev",
    ]
    assert image_values("localhost:5000/op:1")[1] == "image.repository=localhost:5000/op"
    with pytest.raises(DeployError, match="needs a tag"):
        image_values("specpair-operator")


def test_the_client_takes_what_start_node_writes(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "admin.kubeconfig"
    ca = tmp_path / "ca.crt"
    kubeconfig.write_text(kubeconfig_yaml("https://10.217.0.1:6443", ca, "t0ken", "admin"))
    client = KubeconfigClient.load(kubeconfig)
    assert (client.server, client.ca, client.token) == ("https://10.217.0.1:6443", ca, "t0ken")
