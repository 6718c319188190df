"""The multi-node lab's network: one network namespace per node, standing for its host, and a wire between.

```
 <tag>-fabric:  bridge br0 192.168.255.254/24 ── n0 ── n1 ── n2   (one veth per node, enslaved)
 <tag>-n0:      fabric0 192.168.255.1/24, default via .254, 10.244.1.0/26 via .2, 10.244.2.0/26 via .3
 <tag>-n1:      fabric0 192.168.255.2/24, default via .254, 10.244.0.0/26 via .1, 10.244.2.0/26 via .3
 ...
```

Every node namespace is what a host is to a CNI with host-gateway routing (flannel's host-gw, Calico
without encapsulation): ``podmeter node`` builds its pods' sandboxes there (each pod's host-side veth and
/32 route, :mod:`podmeter.lab.netns`), and a route per other node's pod CIDR sends their traffic over the
wire to that node's address. ``fabric0`` carries the node's default route, so the agent's attach manager
sees it for what it is, the uplink, and never attaches to it (docs/datapath.md, "Attaching"); only the pod
links are counted. IPv4 forwarding is on in every node namespace. Nothing here touches the machine's own
interfaces, routes or sysctls: every namespace is new and removed at the end (:meth:`Fabric.destroy`,
idempotent), the veths with them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute

from podmeter.lab.netns import NETNS_DIR, create_netns, in_namespace, remove_netns
from podmeter.lab.scenario import FABRIC

BRIDGE = "br0"
UPLINK = "fabric0"  # the node side of a node's veth to the wire
GATEWAY = str(FABRIC[254])  # the bridge's address in the fabric namespace


@dataclass(frozen=True)
class FabricNode:
    """One node of the fabric: its Kubernetes name, its namespace and address, its pod CIDR."""

    name: str
    index: int
    netns: str  # /run/netns/<tag>-n<index>
    address: str  # the node's IP on the wire (also what host-network pods get)
    pod_cidr: str


class Fabric:
    """The namespaces and links of a multi-node lab run (see the module docstring)."""

    def __init__(self, tag: str, nodes: Sequence[tuple[str, str]]) -> None:
        """``nodes``: (name, pod CIDR) of each node, in order."""
        if len(nodes) > 253:
            raise ValueError("at most 253 nodes on one fabric")
        self.tag = tag
        self.netns = str(NETNS_DIR / f"{tag}-fabric")
        self.nodes = [FabricNode(name, i, str(NETNS_DIR / f"{tag}-n{i}"), str(FABRIC[i + 1]), cidr)
                      for i, (name, cidr) in enumerate(nodes)]

    def create(self, loopback_addresses: Sequence[str] = ()) -> None:
        """Build everything; on failure remove what was built. ``loopback_addresses``: extra /32s on each
        node namespace's ``lo`` (the address of an API server outside, which a relay then serves)."""
        try:
            create_netns(self.netns)
            with in_namespace(self.netns), IPRoute() as ipr:
                _up(ipr, "lo")
                ipr.link("add", ifname=BRIDGE, kind="bridge")
                bridge = socket.if_nametoindex(BRIDGE)
                ipr.addr("add", index=bridge, address=GATEWAY, prefixlen=FABRIC.prefixlen)
                ipr.link("set", index=bridge, state="up")
                for node in self.nodes:
                    create_netns(node.netns)
                    wire = f"n{node.index}"
                    ipr.link("add", ifname=wire, kind="veth", peer={"ifname": UPLINK, "net_ns_fd": node.netns})
                    index = socket.if_nametoindex(wire)
                    ipr.link("set", index=index, master=bridge)
                    ipr.link("set", index=index, state="up")
            for node in self.nodes:
                self._wire_node(node, loopback_addresses)
        except BaseException:
            self.destroy()
            raise

    def _wire_node(self, node: FabricNode, loopback_addresses: Sequence[str]) -> None:
        with in_namespace(node.netns), IPRoute() as ipr:
            lo = _up(ipr, "lo")
            for address in loopback_addresses:
                ip = ipaddress.ip_address(address)
                if not ip.is_loopback:
                    ipr.addr("add", index=lo, address=str(ip), prefixlen=ip.max_prefixlen)
            uplink = socket.if_nametoindex(UPLINK)
            ipr.addr("add", index=uplink, address=node.address, prefixlen=FABRIC.prefixlen)
            ipr.link("set", index=uplink, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=GATEWAY, oif=uplink)
            for other in self.nodes:
                if other is not node:
                    ipr.route("add", dst=other.pod_cidr, gateway=other.address, oif=uplink)
            # /proc/sys/net is the namespace of the thread that opens it: this node's.
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")

    def destroy(self) -> None:
        """Remove every namespace (their veths go with them). Idempotent."""
        for node in self.nodes:
            remove_netns(node.netns)
        remove_netns(self.netns)

    def node(self, name: str) -> FabricNode:
        return next(n for n in self.nodes if n.name == name)


def _up(ipr: IPRoute, name: str) -> int:
    index = socket.if_nametoindex(name)
    with contextlib.suppress(Exception):
        ipr.link("set", index=index, state="up")
    return index
