"""``peer.Peer/Notify``, what Hubble Relay asks to find nodes: every node of the cluster with an address
(``PEER_ADDED``: the node's InternalIP and the port this server listens on, as every agent of the DaemonSet
does), then ``PEER_ADDED``/``PEER_DELETED``/``PEER_UPDATED`` as nodes come, go or change address, until the
client cancels. The nodes come from the agent's node store (:class:`NodeSource`). Listening on a Unix socket
or loopback, the other agents are not reachable either: only this node is announced. One bounded queue per
client: one that falls ``peer_queue`` changes behind is dropped (``RESOURCE_EXHAUSTED``, counted in
``peer_clients_dropped``) and reconnects to a fresh list.

Invariant: after :meth:`PeerService.start`, ``peers`` maps each announced node to its address, and every
Notify client has been sent exactly the changes that turned its first list into ``peers`` (or has been
dropped); this node is always in it, at the address it listens on (or its InternalIP on a wildcard).

Next stage: ``adapters.hubble.server`` registers the handler beside ``observer`` and ``health``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc import aio

from podmeter.adapters.hubble.access import ListenAddress, TlsFiles, tls_server_name
from podmeter.adapters.hubble.proto import peer_pb2
from podmeter.adapters.hubble.streams import EndableStream
from podmeter.model.hostport import host_port
from podmeter.model.records import Node

log = logging.getLogger("podmeter.hubble")

PEER_QUEUE = 1024  # changes a Notify client may fall behind by before it is dropped
MAX_PEER_CLIENTS = 64  # Notify streams at once (Relays: one each)


class NodeSource(Protocol):
    """The cluster's nodes as the server reads them (``runtime.agent.Agent`` is one). Both are called on the
    event loop the server runs in; ``changed(old, new)`` follows every change of ``cluster_nodes()``."""

    def cluster_nodes(self) -> Iterable[Node]: ...

    def on_nodes_changed(self, changed: Callable[[Node | None, Node | None], None]) -> None: ...


@dataclass(eq=False)
class _PeerClient:
    """One Notify stream: its bounded queue of changes (None: the stream ends), and whether the server
    dropped it for falling behind."""

    queue: asyncio.Queue[peer_pb2.ChangeNotification | None]
    stream: EndableStream
    dropped: bool = False


class PeerService:
    """The Notify handler of one agent. ``announce_peers``: None announces the other nodes only where this
    server is reachable from them (not on a Unix socket or loopback); True announces them anyway (tests of
    several agents on one machine)."""

    def __init__(self, node_name: str, address: ListenAddress, *, tls: TlsFiles | None, nodes: NodeSource | None,
                 announce_peers: bool | None, peer_queue: int) -> None:
        self.node_name, self.address, self.tls, self.nodes, self.peer_queue = node_name, address, tls, nodes, peer_queue
        wanted = not address.local if announce_peers is None else announce_peers
        self.announcing = nodes is not None and wanted
        self.peers: dict[str, str] = {}
        self.peer_clients_dropped = 0  # Notify clients dropped for falling behind
        self.port: int | None = None
        self._peer_clients: set[_PeerClient] = set()
        self._stopping = asyncio.Event()
        if nodes is not None:
            nodes.on_nodes_changed(self._node_changed)

    def handlers(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Notify": grpc.unary_stream_rpc_method_handler(
                self.notify, request_deserializer=peer_pb2.NotifyRequest.FromString,
                response_serializer=peer_pb2.ChangeNotification.SerializeToString),
        }
        return grpc.method_handlers_generic_handler("peer.Peer", methods)

    def start(self, port: int | None) -> None:
        self.port = port
        self._stopping = asyncio.Event()
        self.peers = {self.node_name: self._own_address(None)}
        if self.announcing and self.nodes is not None:
            for node in self.nodes.cluster_nodes():
                self._node_changed(None, node)
            log.info("Hubble API: peer.Peer/Notify announces every node with an address, at its InternalIP "
                     "and port %d (the nodes' agents must listen there too)", self.port or self.address.port)
        elif self.address.local:
            log.info("Hubble API: peer.Peer/Notify announces this node only: %s is not reachable from other "
                     "nodes, nor would their agents be; for Hubble Relay to find every node, listen on the "
                     "node's address with TLS (docs/hubble.md)", self.address.text)

    def stop(self) -> None:
        self._stopping.set()
        for client in self._peer_clients:  # the queue always has room for the end (one above the cap)
            client.queue.put_nowait(None)
        self._peer_clients.clear()

    def peer_figures(self) -> tuple[int, int]:
        """(Notify clients now, Notify clients dropped for falling behind so far), for ``/metrics``."""
        return len(self._peer_clients), self.peer_clients_dropped

    @property
    def peer_address(self) -> str:
        """Where a peer (Hubble Relay) reaches this server: the listen address, the node's name for a
        wildcard host (Relay resolves it), or the Unix socket."""
        a = self.address
        if a.unix_path is not None:
            return f"unix://{a.unix_path}"
        port = self.port or a.port
        host = a.host or self.node_name
        return host_port(host, port)

    @property
    def tls_server_name(self) -> str:
        """The name Relay checks this server's certificate against (:func:`tls_server_name`)."""
        return tls_server_name(self.node_name)

    def _own_address(self, node: Node | None) -> str:
        """This node's peer address: where it listens; on a wildcard host its InternalIP once the node store
        has it (the name otherwise, which Relay must resolve)."""
        if self.address.host or self.address.unix_path is not None or node is None or node.address is None:
            return self.peer_address
        return host_port(node.address, self.port or self.address.port)

    def _node_changed(self, old: Node | None, new: Node | None) -> None:
        """A change of the node store: what it changes in ``peers`` goes to every Notify client. Never
        raises (it runs in the agent's node reflector)."""
        if not self.announcing or not self.peers:  # not started: start() lists the store itself
            return
        name = new.name if new is not None else old.name if old is not None else ""
        if name == self.node_name:
            address: str | None = self._own_address(new)
        elif new is None or new.address is None:
            address = None
        else:
            address = host_port(new.address, self.port or self.address.port)
        before = self.peers.get(name)
        if address == before:
            return  # a status update that moved no address (most node updates): nothing for Relay
        if address is None:
            assert before is not None
            del self.peers[name]
            self._publish(self._change(name, before, peer_pb2.PEER_DELETED))
            return
        self.peers[name] = address
        self._publish(self._change(name, address, peer_pb2.PEER_ADDED if before is None else peer_pb2.PEER_UPDATED))

    def _change(self, name: str, address: str, kind: peer_pb2.ChangeNotificationType.ValueType
                ) -> peer_pb2.ChangeNotification:
        tls = peer_pb2.TLS(server_name=tls_server_name(name)) if self.tls is not None else None
        return peer_pb2.ChangeNotification(name=name, address=address, type=kind, tls=tls)

    def _publish(self, change: peer_pb2.ChangeNotification) -> None:
        for client in list(self._peer_clients):
            if client.queue.qsize() < self.peer_queue:
                client.queue.put_nowait(change)
                continue
            self._peer_clients.discard(client)  # its queue is freed with it: nothing more is held for it
            client.dropped = True
            self.peer_clients_dropped += 1
            client.queue.put_nowait(None)  # the slot above the cap: the handler ends the stream when it reads
            log.warning("Hubble API: a peer.Peer/Notify client fell %d changes behind and was dropped "
                        "(%d dropped so far); it reconnects to the current peers", self.peer_queue,
                        self.peer_clients_dropped)

    async def notify(self, request: peer_pb2.NotifyRequest, context: aio.ServicerContext[Any, Any]) -> None:
        if self._stopping.is_set():
            return
        if len(self._peer_clients) >= MAX_PEER_CLIENTS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{MAX_PEER_CLIENTS} clients already ask this agent for its peers; try again later")
        client = _PeerClient(asyncio.Queue(self.peer_queue + 1), EndableStream(
            context, f"this peer client fell {self.peer_queue} changes behind and was dropped; call Notify "
                     "again for the current peers"))
        current = list(self.peers.items())  # taken as the client subscribes, in one step: no change is lost
        self._peer_clients.add(client)
        watchdog = asyncio.create_task(client.stream.watch(lambda: client.dropped), name="hubble-peer-watchdog")
        try:
            for name, address in current:
                await context.write(self._change(name, address, peer_pb2.PEER_ADDED))
            while (change := await client.queue.get()) is not None:
                await context.write(change)
            if client.dropped:
                await client.stream.end()
        finally:
            self._peer_clients.discard(client)
            watchdog.cancel()
