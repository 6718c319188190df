"""``podmeter node``: act as kubelet + CNI for one lab node (see :mod:`podmeter.lab.node`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

from podmeter.adapters.kube.connection import ConnectionConfigError
from podmeter.lab.kube import KubeClient
from podmeter.lab.netns import is_root, link_prefix_problem
from podmeter.lab.node import IpPool, Node, NodeSettings
from podmeter.lab.service_proxy import ServiceProxy
from podmeter.runtime.logs import setup_logging

log = logging.getLogger("podmeter.node")


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "node", help="run a lab node: pods become network namespaces with veths and IPs",
        description=__doc__)
    p.add_argument("--kubeconfig", help="kubeconfig of the (lab) API server (default: $KUBECONFIG)")
    p.add_argument("--node-name", required=True, help="pods with this spec.nodeName run here")
    p.add_argument("--pod-cidr", default="10.244.0.0/26",
                   help="IPv4 CIDR the pod IPs come from; small, so IPs are reused quickly")
    p.add_argument("--datapath", choices=("ebpf", "memory"), default="ebpf",
                   help="ebpf: real namespaces and veths (root); memory: assign IPs only")
    p.add_argument("--node-ip", default="192.168.255.1", help="IP given to host-network pods")
    p.add_argument("--ip-reuse", choices=("lowest", "oldest"), default="lowest",
                   help="lowest: a freed IP goes to the next pod (reuse races); oldest: the longest-free IP")
    p.add_argument("--link-prefix", type=_link_prefix, default="pm", metavar="PREFIX",
                   help="the host side of each pod's link is PREFIX + 11 characters of its UID, as a CNI names "
                        "it (eni: AWS VPC CNI, azv: Azure CNI); 1 to 4 lowercase letters or digits")
    p.add_argument("--service-proxy", action="store_true",
                   help="rewrite Services' ClusterIPs and NodePorts to ready backends in this netns, as kube-proxy's "
                        "nftables mode does (needs nft and root)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.set_defaults(func=run)


def _link_prefix(text: str) -> str:
    problem = link_prefix_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, "text")
    if args.datapath == "ebpf" and not is_root():
        print("podmeter node: --datapath ebpf builds namespaces and veths and needs root; "
              "use --datapath memory to assign IPs only", file=sys.stderr)
        return 1
    try:
        IpPool(args.pod_cidr)
        client = KubeClient.from_kubeconfig(args.kubeconfig or "")
    except (ValueError, ConnectionConfigError) as exc:
        print(f"podmeter node: {exc}", file=sys.stderr)
        return 2
    settings = NodeSettings(args.node_name, args.pod_cidr, args.datapath, args.node_ip, ip_reuse=args.ip_reuse,
                            link_prefix=args.link_prefix)
    node = Node(settings, client)

    def stop(signum: int, frame: FrameType | None) -> None:
        node.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # A daemon thread: a watch blocked in a read must not keep the process after a stop.
    worker = threading.Thread(target=node.run, name="node", daemon=True)
    worker.start()
    proxy = ServiceProxy(KubeClient.from_kubeconfig(args.kubeconfig or "")) if args.service_proxy else None
    if proxy is not None:
        proxy.start()
    log.info("node %s: pod CIDR %s (%d IPs), datapath %s", args.node_name, args.pod_cidr, node.pool.size,
             args.datapath)
    while worker.is_alive() and not node.stopping:
        worker.join(timeout=0.2)
    worker.join(timeout=2.0)
    if proxy is not None:
        proxy.stop()
    node.teardown_all()  # idempotent: whatever the worker did not remove yet
    stats = node.stats
    log.info("node stopped: %d pods started, %d built (%.1f ms each on average), %d stopped, %d completed, "
             "errors %s", stats.started, stats.built, 1000 * stats.build_seconds / max(1, stats.built),
             stats.stopped, stats.completed, dict(stats.errors) or "none")
    return 0
