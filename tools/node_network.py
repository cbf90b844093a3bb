"""The node's pod network: a host-only bridge, CNI's bridge plugin, and a guard.

Pods live on the bridge ``specpair0`` (10.217.0.0/24 by default, host-local
addresses), set up by Debian's ``containernetworking-plugins`` through the
kubelet. The host holds the bridge's first address, the *node address*:

- the apiserver listens there, so pods reach it through the ``kubernetes``
  Service (a pod's loopback is its own, so 127.0.0.1 cannot serve);
- the kubelet reports it as the Node's InternalIP;
- the Service range routes to the bridge, so ClusterIPs (kube-proxy's
  iptables rules) answer from the host even without a default route.

The guard (iptables chains ``SPECPAIR-NODE-IN`` and ``SPECPAIR-NODE-FWD``)
keeps all of it on this machine: the node address accepts connections only
from the host itself and, for the apiserver's port alone, from pods; nothing
is forwarded between the bridge and any other interface. Pods therefore have
no route off the machine.

`setup` and `teardown` are idempotent; `teardown` also removes what a killed
node left behind (the bridge, the chains, kube-proxy's and the kubelet's
``KUBE-*`` chains).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

BRIDGE = "specpair0"
NETWORK_NAME = "specpair"
DEFAULT_SUBNET = "10.217.0.0/24"
GUARD_INPUT = "SPECPAIR-NODE-IN"
GUARD_FORWARD = "SPECPAIR-NODE-FWD"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
CNI_VERSION = "0.4.0"  # the newest CNI spec the v1.20 kubelet's libcni speaks


class NetworkError(RuntimeError):
    """The node's network could not be set up; the message says which command failed."""


@dataclass(frozen=True)
class PodNetwork:
    """The pod subnet, the node address (its first host) and the Service range."""

    subnet: str
    service_range: str

    @property
    def node_address(self) -> str:
        return str(next(ipaddress.ip_network(self.subnet).hosts()))

    @property
    def prefix(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen


def cni_config(network: PodNetwork, ipam_dir: Path) -> dict[str, object]:
    """The CNI conflist: the bridge plugin on BRIDGE with host-local addresses."""
    return {
        "cniVersion": CNI_VERSION,
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                # Nothing leaves the machine (the guard drops it), so no NAT.
                "ipMasq": False,
                # A pod can reach itself through its own Service.
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": network.subnet, "gateway": network.node_address}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


def write_cni_config(network: PodNetwork, conf_dir: Path, ipam_dir: Path) -> Path:
    conf_dir.mkdir(parents=True, exist_ok=True)
    path = conf_dir / f"10-{NETWORK_NAME}.conflist"
    path.write_text(json.dumps(cni_config(network, ipam_dir), indent=2) + "\n")
    return path


def guard_rules(network: PodNetwork, apiserver_port: int) -> dict[str, list[list[str]]]:
    """The guard chains' rules (pure): chain → iptables arguments after ``-A chain``."""
    node = network.node_address
    return {
        GUARD_INPUT: [
            ["-i", "lo", "-j", "RETURN"],
            ["-i", BRIDGE, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"],
            ["-i", BRIDGE, "-d", node, "-p", "tcp", "--dport", str(apiserver_port), "-j", "RETURN"],
            ["-i", BRIDGE, "-j", "DROP"],
            ["-d", node, "-j", "DROP"],
        ],
        GUARD_FORWARD: [
            ["-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"],
            ["-i", BRIDGE, "-j", "DROP"],
            ["-o", BRIDGE, "-j", "DROP"],
        ],
    }


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _command(["ip", *args], check=check)


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _command(["iptables", "-w", "10", *args], check=check)


def _command(argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def overlapping_routes(network: PodNetwork) -> list[str]:
    """Routes of this machine (not ours) that overlap the pod subnet or the Service range."""
    ours = (ipaddress.ip_network(network.subnet), ipaddress.ip_network(network.service_range))
    found = []
    for line in _ip("-4", "route", "show").stdout.splitlines():
        destination, _, rest = line.partition(" ")
        if destination == "default" or f"dev {BRIDGE}" in rest:
            continue
        try:
            route = ipaddress.ip_network(destination, strict=False)
        except ValueError:
            continue
        if any(route.overlaps(net) for net in ours):
            found.append(line)
    return found


def setup(network: PodNetwork) -> str:
    """Bridge, node address and Service route; returns ip_forward's old value.

    The guard follows once the apiserver's port is known (`install_guard`).
    """
    clashes = overlapping_routes(network)
    if clashes:
        raise NetworkError(
            f"the pod subnet {network.subnet} or the Service range {network.service_range} "
            f"overlaps this machine's routes: {clashes}; set SPECPAIR_NODE_SUBNET"
        )
    forward = IP_FORWARD.read_text().strip()
    if _ip("link", "show", BRIDGE, check=False).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "replace", f"{network.node_address}/{network.prefix}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    _ip("route", "replace", network.service_range, "dev", BRIDGE, "src", network.node_address)
    return forward


def install_guard(network: PodNetwork, apiserver_port: int) -> None:
    remove_guard()
    for chain, rules in guard_rules(network, apiserver_port).items():
        _iptables("-N", chain)
        for rule in rules:
            _iptables("-A", chain, *rule)
    _iptables("-I", "INPUT", "1", "-j", GUARD_INPUT)
    _iptables("-I", "FORWARD", "1", "-j", GUARD_FORWARD)


def remove_guard() -> None:
    for parent, chain in (("INPUT", GUARD_INPUT), ("FORWARD", GUARD_FORWARD)):
        while _iptables("-D", parent, "-j", chain, check=False).returncode == 0:
            pass
        _iptables("-F", chain, check=False)
        _iptables("-X", chain, check=False)


def remove_kube_chains() -> None:
    """Drop every ``KUBE-*`` chain and the rules that jump to them (kube-proxy's, the kubelet's).

    `kube-proxy --cleanup` leaves the kubelet's chains behind, and a killed
    node leaves everything; one node at a time runs on a machine (tools/node.py's
    lock), so these chains are this node's.
    """
    dump = _command(["iptables-save"], check=True).stdout
    kept = [line for line in dump.splitlines() if not _mentions_kube_chain(line)]
    if len(kept) == len(dump.splitlines()):
        return
    done = subprocess.run(
        ["iptables-restore", "-w", "10"],
        input="\n".join(kept) + "\n",
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise NetworkError(f"iptables-restore without the KUBE-* chains: {done.stderr.strip()}")


def _mentions_kube_chain(line: str) -> bool:
    if line.startswith(":KUBE-"):
        return True
    if not line.startswith("-A "):
        return False
    words = line.split()
    return words[1].startswith("KUBE-") or any(
        flag in ("-j", "-g") and target.startswith("KUBE-")
        for flag, target in itertools.pairwise(words)
    )


def teardown(forward: str | None) -> None:
    """Remove the guard, the KUBE-* chains and the bridge; restore ip_forward."""
    remove_guard()
    remove_kube_chains()
    if _ip("link", "show", BRIDGE, check=False).returncode == 0:
        _ip("link", "delete", BRIDGE, check=False)
    if forward is not None and IP_FORWARD.read_text().strip() != forward:
        IP_FORWARD.write_text(forward + "\n")
