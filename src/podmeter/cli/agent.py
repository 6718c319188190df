"""``podmeter agent``: watch this node's pods and keep their IPs in the datapath's filter."""

from __future__ import annotations

import argparse
import shlex
from typing import Any, NoReturn

from podmeter.adapters.flow_http import BadQuery, parse_query
from podmeter.adapters.metrics.retina import LOCAL, retina_context
from podmeter.cli.observe import add_filters, filter_query
from podmeter.model.flow_export import mask_paths
from podmeter.model.flow_records import FlowFilter
from podmeter.runtime import agent_process
from podmeter.runtime.settings import (
    AgentProcessSettings,
    AgentSettings,
    DatapathSettings,
    FlowExportSettings,
    HubbleSettings,
    LogSettings,
)

# Every default below is read from the settings (runtime.settings), the one place they are written.


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "agent", help="run the node agent", description=__doc__,
        epilog="Every option can also be set with an environment variable PODMETER_<OPTION> "
               "(e.g. PODMETER_NODE_NAME).")
    p.add_argument("--kubeconfig", default=AgentProcessSettings.kubeconfig,
                   help="kubeconfig file (default: $KUBECONFIG, then the in-cluster account)")
    p.add_argument("--context", default=AgentProcessSettings.context,
                   help="kubeconfig context (default: the current one)")
    p.add_argument("--node-name", required=True, help="this node's name (spec.nodeName of its pods)")
    p.add_argument("--datapath", choices=("ebpf", "memory"), default=DatapathSettings.kind,
                   help="ebpf: the kernel (root); memory: no kernel, for the lab and tests")
    p.add_argument("--bpffs", default=DatapathSettings.bpffs, help="pin directory of the eBPF maps")
    p.add_argument("--filter-map-size", type=_positive, default=DatapathSettings.filter_map_size,
                   help="filter map max_entries")
    p.add_argument("--interface", action="append", default=list(DatapathSettings.interfaces), metavar="NAME",
                   help="also attach to this interface, whatever its kind and whatever it carries (repeatable); "
                        "pod links (a veth or netkit whose peer is in another network namespace, carrying an IP "
                        "of one of this node's pods) are found by themselves")
    p.add_argument("--interface-pattern", action="append", default=list(DatapathSettings.interface_patterns),
                   metavar="GLOB",
                   help="attach to the links whose names match this glob instead of finding pod links by "
                        "what they are (repeatable; e.g. 'eni*'; default: none, pod links are found by "
                        "themselves)")
    p.add_argument("--listen", default=AgentProcessSettings.listen, help="HTTP address for /metrics, /healthz, /readyz")
    p.add_argument("--metrics-min-interval", type=float, default=AgentProcessSettings.metrics_min_interval,
                   help="seconds between two renderings of /metrics at most: scrapers within it get the last "
                        "one, so many scrapers cannot slow the datapath writes")
    p.add_argument("--debug-remote", action="store_true", default=AgentProcessSettings.debug_remote,
                   help="let /debug/state, /debug/endpoints and /debug/flows answer clients that are not on "
                        "loopback too (default: loopback only)")
    p.add_argument("--resync-interval", type=_positive_float, default=AgentSettings.resync_interval,
                   help="seconds between full resyncs against the kernel")
    p.add_argument("--series-grace", type=_positive_float, default=AgentSettings.series_grace,
                   help="seconds a pod's traffic series stays after the pod stops being observed or is deleted: "
                        "two scrape intervals, so the last scrape sees its final value")
    p.add_argument("--flow-map-size", type=_positive, default=DatapathSettings.flow_map_size,
                   help="max_entries of the kernel flow map: distinct flows between two drains")
    p.add_argument("--flow-interval", type=_positive_float, default=AgentSettings.flow_interval,
                   help="seconds between two drains of the kernel flow map")
    p.add_argument("--flow-buffer", type=_positive, default=AgentSettings.flow_buffer,
                   help="recent flow records kept for `podmeter observe`")
    p.add_argument("--flow-series-limit", type=_positive, default=AgentSettings.flow_series_limit,
                   help="workload pairs with a flow series of their own; beyond, one overflow series")
    p.add_argument("--drop-map-size", type=_non_negative, default=DatapathSettings.drop_map_size,
                   help="max_entries of each kernel drop and TCP map: drops by pod, direction and reason, and "
                        "dropped flows, between two drains; 0 turns drops and TCP health off")
    p.add_argument("--drops-include-lifecycle", action="store_true", default=AgentSettings.drops_include_lifecycle,
                   help="count drops whose reason is a socket's lifecycle, not a loss (QUEUE_PURGE, SOCKET_CLOSE, "
                        "UNIX_DISCONNECT: queued data freed as a socket closes) as drops, in the drop series and "
                        "dropped flows; default: apart, in podmeter_pod_lifecycle_drops_total")
    p.add_argument("--retina-compat", nargs="?", const=LOCAL, type=retina_context, default=AgentSettings.retina_compat,
                   metavar="local|remote",
                   help="also export Retina's networkobservability_adv_forward_* and _drop_* series: per pod "
                        "(local, the flag alone) or per flow (remote, as Retina's pod-level dashboards query them), "
                        "and in both its node-level series: networkobservability_forward_*, _drop_*, the TCP "
                        "resets, and the node's sockets, TcpExt and interface counters")
    p.add_argument("--retina-dns-names-limit", type=_positive, default=AgentSettings.retina_dns_names_limit,
                   help="with --retina-compat, DNS query names with Retina DNS series of their own on the node "
                        "(their query label); beyond, the name _other_")
    p.add_argument("--retina-remote-addresses-limit", type=_positive,
                   default=AgentSettings.retina_remote_addresses_limit,
                   help="with --retina-compat, remote addresses of the node's TCP sockets with a "
                        "networkobservability_tcp_connection_remote series of their own (the most sockets first); "
                        "beyond, the address _other_")
    p.add_argument("--retina-interfaces-limit", type=_positive, default=AgentSettings.retina_interfaces_limit,
                   help="with --retina-compat, the node's interfaces with networkobservability_interface_stats "
                        "series of their own (the most bytes first); beyond, the interface _other_")
    p.add_argument("--hubble-listen", metavar="ADDR", default=HubbleSettings.listen,
                   help="serve Hubble's Observer gRPC API (hubble observe, Relay, UI) on unix:///PATH or HOST:PORT "
                        "(default: off; 4246 suggested: docs/hubble.md); a non-loopback address needs the TLS options")
    p.add_argument("--hubble-tls-cert", metavar="PEM", default=HubbleSettings.tls_cert,
                   help="the Hubble API's server certificate")
    p.add_argument("--hubble-tls-key", metavar="PEM", default=HubbleSettings.tls_key,
                   help="the Hubble API's server key")
    p.add_argument("--hubble-tls-client-ca", metavar="PEM", default=HubbleSettings.tls_client_ca,
                   help="CA that signs the Hubble API's client certificates (required: mutual TLS, as Relay uses)")
    p.add_argument("--hubble-metrics-server", metavar="ADDR", default=AgentProcessSettings.hubble_metrics_server,
                   help="serve Hubble's metrics (hubble_*) on their own /metrics at HOST:PORT (default: off; "
                        "':9965', Cilium's port, is loopback; 0.0.0.0:9965 all interfaces: their labels name pods)")
    p.add_argument("--hubble-metrics", metavar="LIST", default=AgentSettings.hubble_metrics,
                   help="which of Hubble's metrics, in Cilium's hubble-metrics syntax, e.g. 'drop tcp "
                        "flow:sourceContext=pod;destinationContext=pod' (docs/metrics.md, \"Hubble metrics\")")
    p.add_argument("--hubble-metrics-series-limit", type=_positive, default=AgentSettings.hubble_metrics_series_limit,
                   help="series of Hubble's metrics in all; beyond, each family's overflow series")
    _add_flow_export(p)
    p.add_argument("--log-format", choices=("text", "json"), default=LogSettings.format,
                   help="text for people, json: one object per line (ts, level, logger, msg)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=LogSettings.level,
                   type=str.lower, help="the least severe messages logged")
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace) -> AgentProcessSettings:
    """The parsed arguments as the agent process's settings."""
    return AgentProcessSettings(
        agent=AgentSettings(node_name=args.node_name, resync_interval=args.resync_interval,
                            series_grace=args.series_grace, flow_interval=args.flow_interval,
                            flow_buffer=args.flow_buffer, flow_series_limit=args.flow_series_limit,
                            retina_compat=args.retina_compat, retina_dns_names_limit=args.retina_dns_names_limit,
                            retina_remote_addresses_limit=args.retina_remote_addresses_limit,
                            retina_interfaces_limit=args.retina_interfaces_limit,
                            drops_include_lifecycle=args.drops_include_lifecycle,
                            hubble_metrics=args.hubble_metrics,
                            hubble_metrics_series_limit=args.hubble_metrics_series_limit),
        kubeconfig=args.kubeconfig, context=args.context,
        datapath=DatapathSettings(kind=args.datapath, bpffs=args.bpffs, filter_map_size=args.filter_map_size,
                                  flow_map_size=args.flow_map_size, drop_map_size=args.drop_map_size,
                                  interfaces=tuple(args.interface), interface_patterns=tuple(args.interface_pattern)),
        listen=args.listen, metrics_min_interval=args.metrics_min_interval, debug_remote=args.debug_remote,
        hubble=HubbleSettings(args.hubble_listen, args.hubble_tls_cert, args.hubble_tls_key,
                              args.hubble_tls_client_ca),
        log=LogSettings(args.log_format, args.log_level),
        hubble_metrics_server=args.hubble_metrics_server,
        flow_export=FlowExportSettings(
            file=args.flow_export_file, max_size_mb=args.flow_export_file_max_size_mb,
            max_backups=args.flow_export_file_max_backups, allow=tuple(args.flow_export_allow),
            deny=tuple(args.flow_export_deny), field_mask=tuple(args.flow_export_field_mask)),
    )


def run(args: argparse.Namespace) -> int:
    return agent_process.run(settings_from(args))


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, not {value}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    return number


def _add_flow_export(p: argparse.ArgumentParser) -> None:
    """The flow export file's options (docs/flow-export.md), Hubble's exporter's."""
    p.add_argument("--flow-export-file", metavar="PATH", default=FlowExportSettings.file,
                   help="write every flow record as one JSON line of Hubble's exporter format to this file (created "
                        "0600; default: off)")
    p.add_argument("--flow-export-file-max-size-mb", type=_positive_float, metavar="MB",
                   default=FlowExportSettings.max_size_mb,
                   help="rotate the flow export file before it grows past this many MiB")
    p.add_argument("--flow-export-file-max-backups", type=_non_negative, metavar="N",
                   default=FlowExportSettings.max_backups, help="rotated flow export files kept, the newest")
    p.add_argument("--flow-export-allow", action="append", type=export_filter, metavar="FILTERS",
                   default=list(FlowExportSettings.allow),
                   help="export only the records matching these filters of `podmeter observe` (e.g. "
                        "'namespace=shop verdict=dropped'); repeatable: a record matching any of them (default: all)")
    p.add_argument("--flow-export-deny", action="append", type=export_filter, metavar="FILTERS",
                   default=list(FlowExportSettings.deny),
                   help="never export the records matching these filters of `podmeter observe` (e.g. "
                        "'to-pod=kube-system/coredns'); repeatable: a record matching any of them")
    p.add_argument("--flow-export-field-mask", type=_mask, metavar="PATHS",
                   default=list(FlowExportSettings.field_mask),
                   help="the Flow fields exported, comma-separated paths (e.g. "
                        "time,source.namespace,destination.pod_name,verdict; default: every field)")


class _FilterParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentTypeError(message)


_FILTER_PARSER = _FilterParser(prog="filter", add_help=False)
add_filters(_FILTER_PARSER)


def export_filter(text: str) -> FlowFilter:
    """A filter of the flow export in ``podmeter observe``'s filter options, with or without their ``--``:
    ``namespace=shop verdict=dropped``, ``--to-pod shop/db``. Parsed by observe's own options and checked by
    the agent's own ``/debug/flows`` query parser, so both speak one language."""
    try:
        split = shlex.split(text)
    except ValueError as exc:  # an unclosed quote
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
    words = [f"--{word}" if "=" in word and not word.startswith("-") else word for word in split]
    args = _FILTER_PARSER.parse_args(words)
    params = filter_query(args)
    if not params:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one filter (namespace=NS, to-pod=NS/NAME, "
                                         "verdict=dropped, ...)")
    try:
        wanted, _, _ = parse_query(params)
    except BadQuery as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return wanted


def _mask(value: str) -> tuple[str, ...]:
    try:
        return mask_paths(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
