"""``podmeter agent`` as one process object, built from one settings value.

:func:`run` is the command (``cli.agent`` parses the arguments into
:class:`~podmeter.runtime.settings.AgentProcessSettings` and calls it): it checks the settings, opens the
datapath (``runtime.datapaths``: the filter, the flows, the pod links, the drop tracing), builds an
:class:`AgentProcess` on it and serves until SIGTERM or SIGINT, or until a supervised task dies (exit 1).
Bad settings, a missing kubeconfig and a bad Hubble address exit 2; a datapath that cannot be opened exits
1: the agent refuses to run half-blind.

:class:`AgentProcess` owns everything the process runs: the agent (``runtime.agent``: reflectors, queue,
view, writer, drains), the metrics registry and the expositions of the series, the HTTP app of the
endpoints, and the Hubble API when it is asked for.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from podmeter.adapters.conntrack import TranslationReader
from podmeter.adapters.flow_http import flows_handler
from podmeter.adapters.http import build_app, parse_listen, serve
from podmeter.adapters.kube.connection import Connection, ConnectionConfigError, load_connection
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.adapters.metrics.flow_traffic import render_workload_flows
from podmeter.adapters.metrics.hubble_metrics import render_hubble, render_hubble_figures
from podmeter.adapters.metrics.node_stats import NodeStatsExposition
from podmeter.adapters.metrics.pod_dns import PodDnsExposition
from podmeter.adapters.metrics.pod_drops import PodDropExposition
from podmeter.adapters.metrics.pod_traffic import PodTrafficExposition
from podmeter.adapters.metrics.retina import LOCAL, render_remote
from podmeter.adapters.metrics.retina_dns import render_retina_dns
from podmeter.adapters.metrics.retina_node import node_resets, render_drops, render_forward
from podmeter.adapters.metrics.service_traffic import render_service_traffic
from podmeter.model.endpoint_slices import endpoint_labels
from podmeter.model.endpoints import Endpoint
from podmeter.model.hubble_metrics_config import parse as parse_hubble_metrics
from podmeter.runtime.agent import Agent
from podmeter.runtime.datapaths import OpenDatapath, open_datapath
from podmeter.runtime.logs import setup_logging
from podmeter.runtime.service_names import ServiceNames
from podmeter.runtime.settings import AgentProcessSettings, FlowExportSettings, HubbleSettings

if TYPE_CHECKING:
    from podmeter.adapters.flow_export import FlowExporter
    from podmeter.adapters.hubble.server import HubbleConfig, HubbleServer

log = logging.getLogger("podmeter.agent")


def run(settings: AgentProcessSettings) -> int:
    """The command: check, open, serve, close; its exit status."""
    setup_logging(settings.log.level, settings.log.format)
    try:
        parse_listen(settings.listen)
        check_hubble_metrics(settings)
        hubble = hubble_config(settings.hubble)
        check_flow_export(settings.flow_export)
        connection = load_connection(settings.kubeconfig, settings.context)
    except (ValueError, ConnectionConfigError) as exc:
        log.error("%s", exc)
        return 2
    try:
        opened = open_datapath(settings.datapath)
    except Exception as exc:  # setup errors carry an actionable message; refuse to run half-blind
        log.error("cannot open the %s datapath: %s", settings.datapath.kind, exc)
        return 1
    try:
        return asyncio.run(_serve(settings, connection, opened, hubble))
    finally:
        opened.close()


async def _serve(settings: AgentProcessSettings, connection: Connection, opened: OpenDatapath,
                 hubble: HubbleConfig | None) -> int:
    """Built inside the event loop it runs in."""
    return await AgentProcess(settings, connection, opened, hubble).serve()


def hubble_config(settings: HubbleSettings) -> HubbleConfig | None:
    """The Hubble API's options, checked (None: off); gRPC is imported only when one is given (it costs the
    idle agent some 20 MiB of memory otherwise). Raises ValueError (the API's AccessError)."""
    if not settings.asked:
        return None
    from podmeter.adapters.hubble.server import hubble_config as checked

    return checked(settings.listen, settings.tls_cert, settings.tls_key, settings.tls_client_ca)


def check_hubble_metrics(settings: AgentProcessSettings) -> None:
    """Hubble's metrics are both a list and an address, or neither; ValueError naming what is wrong."""
    value, server = settings.agent.hubble_metrics, settings.hubble_metrics_server
    if (value is None) != (server is None):
        raise ValueError("--hubble-metrics and --hubble-metrics-server go together: which metrics, and where")
    if value is not None and server is not None:
        parse_hubble_metrics(value)
        parse_listen(server)


def check_flow_export(settings: FlowExportSettings) -> None:
    """ValueError for a field mask that names no field of Hubble's Flow (the export imports protobuf: only
    when it is on)."""
    if settings.file is not None and settings.field_mask:
        from podmeter.adapters.flow_export import check_field_mask

        check_field_mask(settings.field_mask)


class AgentProcess:
    """Everything one ``podmeter agent`` runs, on a datapath already opened (the caller closes it)."""

    def __init__(self, settings: AgentProcessSettings, connection: Connection, opened: OpenDatapath,
                 hubble: HubbleConfig | None = None) -> None:
        self.settings = settings
        self.connection = connection
        drops = opened.drops
        # The cluster's nodes are watched for the peers the Hubble API announces to Relay; on a local
        # address it announces only this node.
        core = replace(settings.agent, watch_nodes=hubble is not None and not hubble.address.local)
        # Flows to Services are named by the Service, and by the backend the node's conntrack says served
        # them: with a kernel datapath (its links are the node's), never with the memory one.
        services = ServiceNames(TranslationReader().read if opened.links is not None else None)
        self.agent = Agent(core, connection, opened.datapath, opened.flows, drops.source, links=opened.links,
                           services=services, dns=opened.dns)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(AgentStateCollector(self.agent.snapshot))
        self.app = self._http_app(opened)
        self.hubble = self._hubble_server(hubble) if hubble is not None else None
        self.hubble_metrics_app = self._hubble_metrics_app()
        self.hubble_metrics_port: int | None = None  # the bound port, once serving
        self.flow_export = self._flow_exporter(settings.flow_export) if settings.flow_export.file else None

    def _expositions(self, opened: OpenDatapath) -> list[Callable[[], bytes]]:
        """The series rendered as text at each scrape: per pod (and Retina's local context), per workload
        pair (and Retina's remote context), drops."""
        agent, drops, local = self.agent, opened.drops, self.settings.agent.retina_compat == LOCAL
        traffic = PodTrafficExposition(agent.ledger, opened.datapath.read_counters, local)
        drop_series = PodDropExposition(agent.drop_ledger, lambda: drops.hooks,
                                        drops.source.drops_lost if drops.source else None,
                                        agent.drops.stats if agent.drops else None, local)
        renderers = [traffic.render, lambda: render_workload_flows(agent.workload_flows),
                     lambda: render_service_traffic(agent.service_traffic)]
        if agent.dns is not None:
            renderers.append(PodDnsExposition(agent.dns_ledger, agent.dns.source.counts, agent.dns.stats).render)
        retina = agent.retina
        if retina is not None:
            renderers.append(lambda: render_remote(retina.retina, retina.retina_drops))
        core = self.settings.agent
        if core.retina_compat is not None:  # Retina's node-level series, in either context
            node = NodeStatsExposition(lambda: node_resets(agent.drop_ledger), core.retina_remote_addresses_limit,
                                       core.retina_interfaces_limit)
            renderers += [lambda: render_forward(traffic.node_totals), lambda: render_drops(agent.drop_ledger),
                          node.render]
        retina_dns = agent.retina_dns
        if retina_dns is not None:
            renderers.append(lambda: render_retina_dns(retina_dns))
        hubble_metrics = agent.hubble_metrics
        if hubble_metrics is not None:
            renderers.append(lambda: render_hubble_figures(hubble_metrics))
        return [*renderers, drop_series.render]

    def _hubble_metrics_app(self) -> web.Application | None:
        """Hubble's metrics on their own listener (``--hubble-metrics-server``), as Cilium serves them."""
        metrics = self.agent.hubble_metrics
        if metrics is None:
            return None
        return build_app(CollectorRegistry(), self.agent.ready.is_set, {}, expositions=[lambda: render_hubble(metrics)],
                         healthy=lambda: self.agent.supervisor.healthy,
                         metrics_min_interval=self.settings.metrics_min_interval)

    def _http_app(self, opened: OpenDatapath) -> web.Application:
        agent, settings = self.agent, self.settings
        debug = {"/debug/state": agent.debug_state, "/debug/endpoints": agent.debug_endpoints}
        return build_app(self.registry, agent.ready.is_set, debug, settings.debug_remote, self._expositions(opened),
                         debug_streams={"/debug/flows": flows_handler(agent.flow_feed, self.labels, agent.dns_feed)},
                         healthy=lambda: agent.supervisor.healthy,
                         metrics_min_interval=settings.metrics_min_interval)

    def labels(self, endpoint: Endpoint) -> tuple[str, ...]:
        """A flow end's labels (``podmeter observe --labels``, the Hubble API): this node's pods their own,
        other nodes' pods their identity's."""
        return endpoint_labels(endpoint, self.agent.view.pods, self.agent.view.cluster)

    def _hubble_server(self, hubble: HubbleConfig) -> HubbleServer:
        from podmeter.adapters.hubble.server import HubbleServer
        from podmeter.adapters.metrics.hubble_state import HubbleStateCollector

        server = HubbleServer(self.agent.flow_feed, self.settings.agent.node_name, hubble.address, tls=hubble.tls,
                              labels=self.labels, nodes=self.agent,
                              dns_feed=self.agent.dns_feed if self.agent.dns is not None else None)
        self.registry.register(HubbleStateCollector(server.peer_figures))
        return server

    def _flow_exporter(self, settings: FlowExportSettings) -> FlowExporter:
        from podmeter.adapters.flow_export import exporter
        from podmeter.adapters.metrics.flow_export import FlowExportCollector
        from podmeter.model.flow_export import ExportSelector, mask_tree

        assert settings.file is not None
        export = exporter(self.agent.flow_feed, settings.file, self.settings.agent.node_name, self.labels,
                          selector=ExportSelector(settings.allow, settings.deny), mask=mask_tree(settings.field_mask),
                          max_bytes=max(1, int(settings.max_size_mb * 1024 * 1024)), max_backups=settings.max_backups,
                          queue_records=settings.queue_records, retry_interval=settings.retry_interval)
        self.registry.register(FlowExportCollector(export.figures))
        return export

    async def serve(self) -> int:
        """Serve until SIGTERM or SIGINT (0) or until a supervised task dies (1); the pinned state stays."""
        runner, port = await serve(self.app, self.settings.listen)
        hubble_metrics = None
        if self.hubble_metrics_app is not None and self.settings.hubble_metrics_server is not None:
            hubble_metrics, self.hubble_metrics_port = await serve(self.hubble_metrics_app,
                                                                   self.settings.hubble_metrics_server)
            log.info("Hubble's metrics on port %d", self.hubble_metrics_port)
        try:
            if self.hubble is not None:
                await self.hubble.start()
        except ValueError as exc:  # the Hubble API's AccessError
            log.error("%s", exc)
            await runner.cleanup()
            if hubble_metrics is not None:
                await hubble_metrics.cleanup()
            return 1
        log.info("agent for node %s: API server %s (%s), HTTP on port %d", self.settings.agent.node_name,
                 self.connection.server, self.connection.source, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.agent.start()
        if self.flow_export is not None:
            await self.flow_export.start()
        failed = asyncio.ensure_future(self.agent.supervisor.failed.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        crashed = failed.done()
        for waiter in (stopped, failed):  # the one still waiting is not left pending
            waiter.cancel()
        log.info("stopping: pinned state stays for the next agent")
        if self.hubble is not None:
            await self.hubble.stop()
        if self.flow_export is not None:
            await self.flow_export.stop()
        await self.agent.stop()
        await runner.cleanup()
        if hubble_metrics is not None:
            await hubble_metrics.cleanup()
        return 1 if crashed else 0
