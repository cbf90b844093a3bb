"""The real node's configuration, as pure functions: its network, its guard, its flags.

tests/e2e/test_node_e2e.py runs the node itself; these pin down what it is
given: pods reach the apiserver and nothing else of the host, nothing is
forwarded off the machine, every daemon but the kubelet listens on
loopback, and the CNI config speaks what the v1.20 kubelet reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools import node, node_network
from tools.control_plane_build import Binaries
from tools.docker_engine import Docker
from tools.node_network import BRIDGE, GUARD_FORWARD, GUARD_INPUT, PodNetwork

NETWORK = PodNetwork("10.217.0.0/24", "10.96.0.0/16")
PATHS = node.NodePaths(Path("/cache/node"), Path("/run/specpair-node"))
BINARIES = Binaries.under(Path("/cache"))
DOCKER = Docker("/usr/bin/docker", "unix:///run/specpair-docker/docker.sock")


def test_the_node_address_is_the_subnets_first_host() -> None:
    assert NETWORK.node_address == "10.217.0.1" and NETWORK.prefix == 24


def test_cni_config_is_the_bridge_plugin_with_host_local_addresses() -> None:
    config: dict[str, Any] = node_network.cni_config(NETWORK, Path("/run/ipam"))
    assert config["cniVersion"] == "0.4.0"  # the newest the v1.20 kubelet's libcni reads
    (bridge,) = config["plugins"]
    assert (bridge["type"], bridge["bridge"], bridge["isGateway"]) == ("bridge", BRIDGE, True)
    assert bridge["ipMasq"] is False  # nothing leaves the machine
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.217.0.0/24", "gateway": "10.217.0.1"}]]
    assert bridge["ipam"]["dataDir"] == "/run/ipam"


def test_pods_reach_the_apiserver_and_nothing_else_on_the_host() -> None:
    rules = node_network.guard_rules(NETWORK, apiserver_port=6443)
    incoming = rules[GUARD_INPUT]
    api = ["-i", BRIDGE, "-d", "10.217.0.1", "-p", "tcp", "--dport", "6443", "-j", "RETURN"]
    assert api in incoming
    # After the apiserver's port and the replies to the host's own connections, a drop.
    assert incoming.index(["-i", BRIDGE, "-j", "DROP"]) > incoming.index(api)
    # From any other interface but loopback, the node address is unreachable.
    assert incoming[0] == ["-i", "lo", "-j", "RETURN"]
    assert incoming[-1] == ["-d", "10.217.0.1", "-j", "DROP"]


def test_nothing_is_forwarded_between_the_bridge_and_another_interface() -> None:
    forward = node_network.guard_rules(NETWORK, 6443)[GUARD_FORWARD]
    assert forward == [
        ["-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"],
        ["-i", BRIDGE, "-j", "DROP"],
        ["-o", BRIDGE, "-j", "DROP"],
    ]


def test_kube_chains_are_recognised_in_an_iptables_dump() -> None:
    lines = [
        ":KUBE-SERVICES - [0:0]",
        "-A OUTPUT -m comment --comment kubernetes -j KUBE-SERVICES",
        "-A KUBE-SVC-X -j KUBE-SEP-Y",
        ":DOCKER - [0:0]",
        "-A OUTPUT -d 10.0.0.1 -j ACCEPT",
        "-A SPECPAIR-NODE-IN -i lo -j RETURN",
    ]
    assert [node_network._mentions_kube_chain(line) for line in lines] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]


def test_the_kubelet_runs_pods_on_docker_with_cni_and_no_open_read_only_port() -> None:
    args = node.kubelet_args(BINARIES, Path("/k.conf"), DOCKER, "cgroupfs", NETWORK, PATHS, (1, 2))
    flags = dict(a.split("=", 1) for a in args[1:])
    assert args[0] == str(BINARIES.kubelet)
    assert flags["--container-runtime"] == "docker"
    assert flags["--docker-endpoint"] == DOCKER.host
    assert flags["--pod-infra-container-image"] == node.PAUSE_IMAGE
    assert (flags["--network-plugin"], flags["--cni-bin-dir"]) == ("cni", "/usr/lib/cni")
    assert flags["--node-ip"] == flags["--address"] == "10.217.0.1"
    assert flags["--read-only-port"] == "0"
    assert flags["--healthz-bind-address"] == "127.0.0.1"
    assert flags["--cgroup-driver"] == "cgroupfs"
    assert flags["--hostname-override"] == node.NODE_NAME
    # Images cannot be pulled again: the kubelet never collects them.
    assert flags["--image-gc-high-threshold"] == "100"


def test_kube_proxy_and_the_scheduler_listen_on_loopback_only() -> None:
    argv = node.proxy_args(BINARIES, Path("/k"), NETWORK, (3, 4))
    proxy = dict(a.split("=", 1) for a in argv[1:])
    assert proxy["--proxy-mode"] == "iptables"
    assert proxy["--metrics-bind-address"] == "127.0.0.1:3"
    assert proxy["--healthz-bind-address"] == "127.0.0.1:4"
    assert proxy["--nodeport-addresses"] == "10.217.0.1/32"
    assert proxy["--cluster-cidr"] == "10.217.0.0/24"
    scheduler = dict(a.split("=", 1) for a in node.scheduler_args(BINARIES, Path("/k"), 5)[1:])
    assert (scheduler["--bind-address"], scheduler["--port"]) == ("127.0.0.1", "0")


def test_the_pods_the_kubelet_ran_are_its_pod_directories(tmp_path: Path) -> None:
    paths = node.NodePaths(tmp_path, tmp_path / "run")
    assert paths.pod_uids() == []
    for uid in ("b-uid", "a-uid"):
        (paths.kubelet_root / "pods" / uid).mkdir(parents=True)
    assert paths.pod_uids() == ["a-uid", "b-uid"]
