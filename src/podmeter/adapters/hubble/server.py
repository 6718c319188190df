"""The agent's Hubble API over gRPC (grpc.aio, in the agent's event loop), so that `hubble observe`, `hubble
status`, Hubble Relay and Hubble UI read podmeter's flows. One server, its services apart, as Hubble's are:

- ``adapters.hubble.access``: where it listens and who may connect (Unix socket or loopback, else TLS with
  client certificates), and the TLS files, reread when they change;
- ``adapters.hubble.observer``: ``observer.Observer`` (GetFlows, ServerStatus, GetNodes, GetNamespaces) on
  the agent's flow-serving core;
- ``adapters.hubble.peer``: ``peer.Peer/Notify``, the cluster's nodes for Hubble Relay;
- ``adapters.hubble.health``: ``grpc.health.v1.Health``.

This module binds the address and registers the three; the agent process (``runtime.agent_process``) wires it.
"""

from __future__ import annotations

import contextlib
import logging
from importlib import metadata

from grpc import aio

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.access import (
    AccessError,
    HubbleConfig,
    ListenAddress,
    TlsFiles,
    _Certificates,
    check_access,
    hubble_config,
    parse_listen,
    tls_files,
    tls_server_name,
)
from podmeter.adapters.hubble.flows import LabelSource, no_labels
from podmeter.adapters.hubble.health import HEALTHY_SERVICES, HealthService
from podmeter.adapters.hubble.observer import ObserverService
from podmeter.adapters.hubble.peer import MAX_PEER_CLIENTS, PEER_QUEUE, NodeSource, PeerService

__all__ = ["HEALTHY_SERVICES", "MAX_PEER_CLIENTS", "PEER_QUEUE", "SUGGESTED_PORT", "AccessError", "HubbleConfig",
           "HubbleServer", "ListenAddress", "NodeSource", "TlsFiles", "check_access", "hubble_config",
           "parse_listen", "tls_files", "tls_server_name"]

log = logging.getLogger("podmeter.hubble")

SUGGESTED_PORT = 4246  # Hubble's own gRPC is 4244 on nodes, Relay 4245: the next free one (docs/hubble.md)
MAX_REQUEST = 256 * 1024  # bytes of one request: a filter list far beyond any client's, far below a flood


def _version() -> str:
    try:
        return f"podmeter/{metadata.version('podmeter')}"
    except metadata.PackageNotFoundError:
        return "podmeter"


class HubbleServer:
    """The gRPC server of one agent. Start it inside the agent's event loop; stop it before the loop ends."""

    def __init__(self, feed: FlowFeed, node_name: str, address: ListenAddress, *, tls: TlsFiles | None = None,
                 labels: LabelSource = no_labels, version: str | None = None, nodes: NodeSource | None = None,
                 announce_peers: bool | None = None, peer_queue: int = PEER_QUEUE,
                 dns_feed: FlowFeed | None = None) -> None:
        check_access(address, tls)
        self.address, self.tls = address, tls
        self.observer = ObserverService(feed, node_name, address, tls=tls, labels=labels, version=version or _version(),
                                       dns_feed=dns_feed)
        self.peer = PeerService(node_name, address, tls=tls, nodes=nodes, announce_peers=announce_peers,
                                peer_queue=peer_queue)
        self.health = HealthService()
        self.port: int | None = None  # the bound TCP port, once started
        self._server: aio.Server | None = None

    @property
    def streams(self) -> int:
        """GetFlows calls in progress."""
        return self.observer.streams

    @property
    def peer_clients_dropped(self) -> int:
        return self.peer.peer_clients_dropped

    def peer_figures(self) -> tuple[int, int]:
        """(Notify clients now, Notify clients dropped for falling behind so far), for ``/metrics``."""
        return self.peer.peer_figures()

    async def start(self) -> None:
        server = aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_REQUEST)])
        server.add_generic_rpc_handlers((self.observer.handlers(), self.peer.handlers(), self.health.handlers()))
        path = self.address.unix_path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if self.tls is None:
                port = server.add_insecure_port(self.address.target)
            else:
                port = server.add_secure_port(self.address.target, _Certificates(self.tls).credentials())
        except (OSError, RuntimeError, ValueError) as exc:
            raise AccessError(f"cannot listen on {self.address.text} for the Hubble API: {exc}") from exc
        await server.start()
        if path is not None:
            path.chmod(0o660)  # the owner and its group only: flows name pods and IPs
        self.port = port if path is None else None
        self._server = server
        log.info("Hubble API (observer.Observer) on %s%s, %s", self.address.text,
                 f" (port {port})" if path is None else "", "TLS with client certificates" if self.tls else "no TLS")
        self.peer.start(self.port)

    async def stop(self, grace: float = 1.0) -> None:
        self.peer.stop()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.address.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.address.unix_path.unlink()
