"""Retina's node-level series, for the dashboards built on them (Retina's "clusters" dashboard), with
``--retina-compat`` in either context (Retina exports them whatever its pod-level context is).

What podmeter's kernel data gives honestly, and nothing else (docs/metrics.md, "Retina's node-level
series", lists every one of Retina's node-level series with why podmeter exports it or not):

* ``networkobservability_forward_count`` (packets) and ``_bytes`` with ``direction`` (``ingress``: into a
  pod, ``egress``: out of one): the node totals of the per-pod counters (``podmeter_node_*_total``), so
  every observed pod's traffic, pods whose series are gone included;
* ``networkobservability_drop_count`` and ``_bytes`` with ``reason`` (Retina's name where it means the
  kernel's reason exactly, else the kernel's: :func:`podmeter.model.retina_flows.retina_reason`) and
  ``direction`` (``ingress``, ``egress``: podmeter always knows where the packet was going): the node's
  drops of observed IPs (``podmeter_node_drops_total``, lifecycle reasons left out as there);
* ``networkobservability_tcp_connection_stats{statistic_name="resetcount"}`` and
  ``networkobservability_tcp_flag_counters{flag="rst"}``: RSTs the observed pods' sockets sent and
  received (the node's share of ``podmeter_pod_tcp_resets_total``), the one flag podmeter counts per
  segment. The lower-case values are the ones Retina's dashboard queries. The ``resetcount`` sample is
  rendered in the family of the node's ``TcpExt`` counters (:mod:`podmeter.adapters.metrics.node_stats`,
  which exports the series Retina reads from the node's kernel files): one family, one HELP and TYPE.

All are gauges, as Retina's exporter types them (they only grow). Computed at scrape time from the
ledgers' node totals, which never decrease: a bounded number of samples (two directions, the kernel's
reasons).
"""

from __future__ import annotations

from collections.abc import Mapping

from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.drops import DropLedger, TcpEvent
from podmeter.model.retina_flows import retina_reason

RETINA_NODE_HELP = {
    "networkobservability_forward_count": "Forwarded packets of the node's observed pods, by direction.",
    "networkobservability_forward_bytes": "Forwarded bytes of the node's observed pods, by direction.",
    "networkobservability_drop_count": "Dropped packets of the node's observed pods, by reason and direction.",
    "networkobservability_drop_bytes": "Dropped bytes of the node's observed pods, by reason and direction.",
    "networkobservability_tcp_connection_stats": "TCP statistics: the node's TcpExt counters (lower-cased) and "
                                                 "resetcount, the RSTs of the node's observed pods.",
    "networkobservability_tcp_flag_counters": "TCP segments of the node's observed pods by flag (rst).",
    "networkobservability_tcp_state": "Open TCP sockets of the node by state.",
    "networkobservability_tcp_connection_remote": "Open TCP sockets of the node by remote address.",
    "networkobservability_udp_connection_stats": "UDP sockets of the node (active: open).",
    "networkobservability_interface_stats": "The kernel's generic counters of the node's interfaces.",
}
RESETS = "resetcount"  # tcp_connection_stats' statistic_name for RSTs, as Retina's dashboard queries it
RST = "rst"  # tcp_flag_counters' flag, likewise


def family(name: str, samples: list[str]) -> list[str]:
    """A family's HELP and TYPE lines (a gauge, as Retina's exporter types them) and its samples."""
    return [f"# HELP {name} {RETINA_NODE_HELP[name]}", f"# TYPE {name} gauge", *samples]


def render_forward(totals: Mapping[Direction, Traffic]) -> bytes:
    """The forward series from the node's traffic totals."""
    ordered = sorted(totals.items(), key=lambda item: item[0].value)
    out: list[str] = []
    for name, field in (("networkobservability_forward_count", "packets"),
                        ("networkobservability_forward_bytes", "bytes")):
        out += family(name, [f'{name}{{direction="{direction.value}"}} {getattr(total, field)}'
                              for direction, total in ordered])
    return ("\n".join(out) + "\n").encode()


def render_drops(ledger: DropLedger) -> bytes:
    """The drop series and the RST flag count from the drop ledger's node totals (the RSTs'
    ``tcp_connection_stats`` sample is :mod:`podmeter.adapters.metrics.node_stats`' family's)."""
    by_reason: dict[tuple[str, Direction], list[int]] = {}  # Retina's reason may merge kernel reasons
    for (direction, reason), packets in ledger.node_drops.items():
        total = by_reason.setdefault((retina_reason(reason), direction), [0, 0])
        total[0] += packets
        total[1] += ledger.node_drop_bytes.get((direction, reason), 0)
    out: list[str] = []
    for name, index in (("networkobservability_drop_count", 0), ("networkobservability_drop_bytes", 1)):
        out += family(name, [f'{name}{{reason="{escape(reason)}",direction="{direction.value}"}} {values[index]}'
                              for (reason, direction), values in sorted(by_reason.items())])
    out += family("networkobservability_tcp_flag_counters",
                  [f'networkobservability_tcp_flag_counters{{flag="{RST}"}} {node_resets(ledger)}'])
    return ("\n".join(out) + "\n").encode()


def node_resets(ledger: DropLedger) -> int:
    """RSTs the node's observed pods sent and received."""
    return ledger.node_tcp.get(TcpEvent.RESET_SENT, 0) + ledger.node_tcp.get(TcpEvent.RESET_RECEIVED, 0)
