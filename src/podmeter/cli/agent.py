"""``podmeter agent``: watch this node's pods and keep their IPs in the datapath's filter."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from podmeter.adapters.flow_http import flows_handler
from podmeter.adapters.http import build_app, parse_listen, serve
from podmeter.adapters.kube.connection import ConnectionConfigError, load_connection
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.adapters.metrics.flow_traffic import render_workload_flows
from podmeter.adapters.metrics.pod_drops import PodDropExposition
from podmeter.adapters.metrics.pod_traffic import PodTrafficExposition
from podmeter.adapters.metrics.retina import LOCAL, REMOTE, render_remote, retina_context
from podmeter.model.endpoint_slices import endpoint_labels
from podmeter.model.endpoints import Endpoint
from podmeter.model.retina_flows import WorkloadFlowsAndRetina
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.datapaths import OpenDatapath, open_datapath
from podmeter.runtime.drop_drain import DEFAULT_DROP_MAP_SIZE, DropTracing, open_drops
from podmeter.runtime.logs import setup_logging

if TYPE_CHECKING:
    from podmeter.adapters.hubble.server import HubbleConfig

log = logging.getLogger("podmeter.agent")


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "agent", help="run the node agent", description=__doc__,
        epilog="Every option can also be set with an environment variable PODMETER_<OPTION> "
               "(e.g. PODMETER_NODE_NAME).")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, then the in-cluster account)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--node-name", required=True, help="this node's name (spec.nodeName of its pods)")
    p.add_argument("--datapath", choices=("ebpf", "memory"), default="ebpf",
                   help="ebpf: the kernel (root); memory: no kernel, for the lab and tests (default ebpf)")
    p.add_argument("--bpffs", default="/sys/fs/bpf/podmeter", help="pin directory of the eBPF maps")
    p.add_argument("--filter-map-size", type=_positive, default=65536, help="filter map max_entries")
    p.add_argument("--interface", action="append", default=[], metavar="NAME",
                   help="also attach to this interface, whatever its kind and whatever it carries (repeatable); "
                        "pod links (a veth or netkit whose peer is in another network namespace, carrying an IP "
                        "of one of this node's pods) are found by themselves")
    p.add_argument("--interface-pattern", action="append", default=[], metavar="GLOB",
                   help="attach to the links whose names match this glob instead of finding pod links by "
                        "what they are (repeatable; e.g. 'eni*'; default: none, pod links are found by "
                        "themselves)")
    p.add_argument("--listen", default="127.0.0.1:9978", help="HTTP address for /metrics, /healthz, /readyz")
    p.add_argument("--metrics-min-interval", type=float, default=1.0,
                   help="seconds between two renderings of /metrics at most: scrapers within it get the last "
                        "one, so many scrapers cannot slow the datapath writes (default 1)")
    p.add_argument("--debug-remote", action="store_true",
                   help="let /debug/state, /debug/endpoints and /debug/flows answer clients that are not on "
                        "loopback too (default: loopback only)")
    p.add_argument("--resync-interval", type=_positive_float, default=60.0,
                   help="seconds between full resyncs against the kernel")
    p.add_argument("--series-grace", type=_positive_float, default=30.0,
                   help="seconds a pod's traffic series stays after the pod stops being observed or is deleted, "
                        "so the last scrape sees its final value (default 30: two 15 s scrapes)")
    p.add_argument("--flow-map-size", type=_positive, default=65536,
                   help="max_entries of the kernel flow map: distinct flows between two drains (default 65536)")
    p.add_argument("--flow-interval", type=_positive_float, default=5.0,
                   help="seconds between two drains of the kernel flow map (default 5)")
    p.add_argument("--flow-buffer", type=_positive, default=8192,
                   help="recent flow records kept for `podmeter observe` (default 8192)")
    p.add_argument("--flow-series-limit", type=_positive, default=2000,
                   help="workload pairs with a flow series of their own; beyond, one overflow series "
                        "(default 2000)")
    p.add_argument("--drop-map-size", type=_non_negative, default=DEFAULT_DROP_MAP_SIZE,
                   help="max_entries of each kernel drop and TCP map: drops by pod, direction and reason, and "
                        "dropped flows, between two drains; 0 turns drops and TCP health off (default 16384)")
    p.add_argument("--drops-include-lifecycle", action="store_true",
                   default=AgentSettings.drops_include_lifecycle,
                   help="count drops whose reason is a socket's lifecycle, not a loss (QUEUE_PURGE, SOCKET_CLOSE, "
                        "UNIX_DISCONNECT: queued data freed as a socket closes) as drops, in the drop series and "
                        "dropped flows; default: apart, in podmeter_pod_lifecycle_drops_total")
    p.add_argument("--retina-compat", nargs="?", const=LOCAL, type=retina_context, metavar="local|remote",
                   help="also export Retina's networkobservability_adv_forward_* and _drop_* series: per pod "
                        "(local, the flag alone) or per flow (remote, as Retina's pod-level dashboards query them)")
    p.add_argument("--hubble-listen", metavar="ADDR",
                   help="serve Hubble's Observer gRPC API (hubble observe, Relay, UI) on unix:///PATH or HOST:PORT "
                        "(default: off; 4246 suggested: docs/hubble.md); a non-loopback address needs the TLS options")
    p.add_argument("--hubble-tls-cert", metavar="PEM", help="the Hubble API's server certificate")
    p.add_argument("--hubble-tls-key", metavar="PEM", help="the Hubble API's server key")
    p.add_argument("--hubble-tls-client-ca", metavar="PEM",
                   help="CA that signs the Hubble API's client certificates (required: mutual TLS, as Relay uses)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text for people, json: one object per line (ts, level, logger, msg)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info", type=str.lower,
                   help="the least severe messages logged")
    p.set_defaults(func=run)


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


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    try:
        parse_listen(args.listen)
        hubble = _hubble_config(args)
        connection = load_connection(args.kubeconfig, args.context)
    except (ValueError, ConnectionConfigError) as exc:
        log.error("%s", exc)
        return 2
    try:
        opened = open_datapath(args.datapath, args.bpffs, args.filter_map_size, tuple(args.interface),
                               tuple(args.interface_pattern) or None, flow_map_size=args.flow_map_size)
    except Exception as exc:  # setup errors carry an actionable message; refuse to run half-blind
        log.error("cannot open the %s datapath: %s", args.datapath, exc)
        return 1
    drops = open_drops(opened.datapath, args.drop_map_size)  # never fatal: a notice and drops off
    try:
        return asyncio.run(_serve(args, connection, opened, hubble, drops))
    finally:
        drops.close()
        opened.close()


def _hubble_config(args: argparse.Namespace) -> HubbleConfig | None:
    """The Hubble API's options, checked; gRPC is imported only when one is given (it costs the idle agent
    some 20 MiB of memory otherwise)."""
    if not any((args.hubble_listen, args.hubble_tls_cert, args.hubble_tls_key, args.hubble_tls_client_ca)):
        return None
    from podmeter.adapters.hubble.server import hubble_config

    return hubble_config(args.hubble_listen, args.hubble_tls_cert, args.hubble_tls_key, args.hubble_tls_client_ca)


async def _serve(args: argparse.Namespace, connection: Any, opened: OpenDatapath, hubble: HubbleConfig | None,
                 drops: DropTracing) -> int:
    settings = AgentSettings(node_name=args.node_name, resync_interval=args.resync_interval,
                             series_grace=args.series_grace, flow_interval=args.flow_interval,
                             flow_buffer=args.flow_buffer, flow_series_limit=args.flow_series_limit,
                             # the peers the Hubble API announces to Relay; on a local address only this node
                             watch_nodes=hubble is not None and not hubble.address.local,
                             retina_remote=args.retina_compat == REMOTE,
                             drops_include_lifecycle=args.drops_include_lifecycle)
    datapath = opened.datapath
    agent = Agent(settings, connection, datapath, opened.flows, drops.source)
    agent.links = opened.links
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    registry.register(AgentStateCollector(agent.snapshot))
    renderers = [lambda: render_workload_flows(agent.workload_flows)]
    flows = agent.workload_flows
    if isinstance(flows, WorkloadFlowsAndRetina):  # --retina-compat=remote with flows
        renderers.append(lambda: render_remote(flows.retina, flows.retina_drops))
    traffic = PodTrafficExposition(agent.ledger, datapath.read_counters, args.retina_compat == LOCAL)
    drop_series = PodDropExposition(agent.drop_ledger, lambda: drops.hooks,
                                    drops.source.drops_lost if drops.source else None,
                                    agent.drops.stats if agent.drops else None, args.retina_compat == LOCAL)
    debug = {"/debug/state": agent.debug_state, "/debug/endpoints": agent.debug_endpoints}

    def labels(endpoint: Endpoint) -> tuple[str, ...]:
        return endpoint_labels(endpoint, agent.view.pods, agent.view.cluster)

    app = build_app(registry, agent.ready.is_set, debug, args.debug_remote,
                    [traffic.render, *renderers, drop_series.render],
                    debug_streams={"/debug/flows": flows_handler(agent.flow_feed, labels)},
                    healthy=lambda: agent.supervisor.healthy, metrics_min_interval=args.metrics_min_interval)
    runner, port = await serve(app, args.listen)
    observer = None
    if hubble is not None:
        from podmeter.adapters.hubble.server import HubbleServer
        from podmeter.adapters.metrics.hubble_state import HubbleStateCollector

        observer = HubbleServer(agent.flow_feed, args.node_name, hubble.address, tls=hubble.tls,
                                labels=labels, nodes=agent)
        registry.register(HubbleStateCollector(observer.peer_figures))
    try:
        if observer is not None:
            await observer.start()
    except ValueError as exc:  # the Hubble API's AccessError
        log.error("%s", exc)
        await runner.cleanup()
        return 1
    log.info("agent for node %s: API server %s (%s), HTTP on port %d", args.node_name, connection.server,
             connection.source, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await agent.start()
    failed = asyncio.ensure_future(agent.supervisor.failed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    crashed = failed.done()
    for waiter in (stopped, failed):  # the one still waiting is not left pending
        waiter.cancel()
    log.info("stopping: pinned state stays for the next agent")
    if observer is not None:
        await observer.stop()
    await agent.stop()
    await runner.cleanup()
    return 1 if crashed else 0
