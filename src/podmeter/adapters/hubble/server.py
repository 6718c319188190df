"""The agent's Hubble API: ``observer.Observer`` and ``grpc.health.v1.Health`` over gRPC (grpc.aio, in the agent's
event loop), so that `hubble observe`, `hubble status`, Hubble Relay and Hubble UI read podmeter's flows.

- ``GetFlows``: the last ``number`` matching records oldest first (the first ``number`` with ``first``; all
  of them between ``since`` and ``until`` when ``number`` is 0, none without either), then the stream ends
  with OK; with ``follow``, after the same past records (with ``number`` 0: all since ``since``, none
  without it), new records as the agent drains them, until the client cancels. ``first`` with ``follow``
  is ``INVALID_ARGUMENT``, as in Hubble; so is a bad filter, and a filter on what podmeter does not know
  (the interface, the node's labels, encryption, CEL) is ``UNIMPLEMENTED`` (``adapters.hubble.filters``).
  A follower is a follower of the agent's flow feed like any other: its bounded queue is the only buffer,
  and a reader that falls behind (or stops reading) is cut off and counted by the feed; its stream ends
  with ``RESOURCE_EXHAUSTED``. gRPC's own flow control bounds what a stalled client holds in the
  transport.
- ``ServerStatus``: flows held (the ring), the ring's capacity, flows seen, uptime, one connected node.
- ``GetNamespaces``: the namespaces of the pods at either end of the flows the ring holds, sorted, each in
  podmeter's one cluster (``default``).
- ``GetNodes``: this node.
- ``peer.Peer/Notify`` (what Hubble Relay asks to find nodes): every node of the cluster with an address
  (``PEER_ADDED``: the node's InternalIP and the port this server listens on, as every agent of the
  DaemonSet does), then ``PEER_ADDED``/``PEER_DELETED``/``PEER_UPDATED`` as nodes come, go or change
  address, until the client cancels. The nodes come from the agent's node store (:class:`NodeSource`).
  Listening on a Unix socket or loopback, the other agents are not reachable either: only this node is
  announced. One bounded queue per client: one that falls ``peer_queue`` changes behind is dropped
  (``RESOURCE_EXHAUSTED``, counted in ``peer_clients_dropped``) and reconnects to a fresh list.
- ``Health/Check``: SERVING for ``hubble.server.Observer`` (what `hubble status` asks first), for
  ``observer.Observer`` and for the server as a whole (``""``).

Access: flows name pods and IPs, so the server listens on a Unix socket or a loopback address unless it has
TLS with client certificates (:func:`check_access`), as Hubble Relay connects to nodes.

This module is an adapter: the feed comes in through the :class:`Feed` protocol (``runtime.flow_feed.FlowFeed``
is one), and the agent's command line wires it (``cli.agent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.wrappers_pb2 import UInt32Value
from grpc import aio

from podmeter.adapters.flow_serving import Busy, FlowFeed, Gap, Reader
from podmeter.adapters.hubble.filters import BadFilter, UnsupportedFilter, selection
from podmeter.adapters.hubble.flows import CLUSTER, FlowMessages, LabelSource, lost_message, no_labels
from podmeter.adapters.hubble.proto import health_pb2, observer_pb2, peer_pb2, relay_pb2
from podmeter.model.flow_records import FlowRecord
from podmeter.model.records import Node

log = logging.getLogger("podmeter.hubble")

SUGGESTED_PORT = 4246  # Hubble's own gRPC is 4244 on nodes, Relay 4245: the next free one (docs/hubble.md)
HEALTHY_SERVICES = frozenset({"", "hubble.server.Observer", "observer.Observer"})
UNBOUNDED = sys.maxsize
CUT_OFF_CHECK = 1.0  # seconds between two checks that a follower stuck in a write has been cut off
MAX_REQUEST = 256 * 1024  # bytes of one request: a filter list far beyond any client's, far below a flood
PEER_QUEUE = 1024  # changes a Notify client may fall behind by before it is dropped
MAX_PEER_CLIENTS = 64  # Notify streams at once (Relays: one each)


class NodeSource(Protocol):
    """The cluster's nodes as the server reads them (``runtime.agent.Agent`` is one). Both are called on the
    event loop the server runs in; ``changed(old, new)`` follows every change of ``cluster_nodes()``."""

    def cluster_nodes(self) -> Iterable[Node]: ...

    def on_nodes_changed(self, changed: Callable[[Node | None, Node | None], None]) -> None: ...


# --- where it listens, and who may connect ------------------------------------------------------------


class AccessError(ValueError):
    """A listen address or TLS setting the server refuses (the message says what to do)."""


@dataclass(frozen=True)
class ListenAddress:
    """``unix:///path`` (``unix:path``) or ``HOST:PORT`` (``[v6]:PORT``; an empty host: every address)."""

    text: str
    target: str  # what gRPC binds
    unix_path: Path | None = None
    loopback: bool = False
    host: str = ""  # "" for every address
    port: int = 0

    @property
    def local(self) -> bool:
        """A Unix socket or a loopback address: reachable from this node only."""
        return self.unix_path is not None or self.loopback


def parse_listen(text: str) -> ListenAddress:
    if text.startswith("unix:"):
        path = text.removeprefix("unix://") if text.startswith("unix://") else text.removeprefix("unix:")
        if not path:
            raise AccessError(f"--hubble-listen {text!r}: expected unix:///PATH")
        return ListenAddress(text, f"unix:{path}", unix_path=Path(path))
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise AccessError(f"--hubble-listen {text!r}: expected unix:///PATH or HOST:PORT")
    host = host.removeprefix("[").removesuffix("]")
    if host in ("", "*", "0.0.0.0", "::"):
        return ListenAddress(text, f"[::]:{port}", port=int(port))
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = ipaddress.ip_address(host).is_loopback
    return ListenAddress(text, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", loopback=loopback,
                         host=host, port=int(port))


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key, and the CA its clients' certificates must be signed by (PEM)."""

    cert: Path
    key: Path
    client_ca: Path


def tls_files(cert: str | None, key: str | None, client_ca: str | None) -> TlsFiles | None:
    given = {"--hubble-tls-cert": cert, "--hubble-tls-key": key, "--hubble-tls-client-ca": client_ca}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise AccessError(f"TLS needs all three of --hubble-tls-cert, --hubble-tls-key and "
                          f"--hubble-tls-client-ca; missing: {', '.join(missing)}")
    assert cert and key and client_ca
    return TlsFiles(Path(cert), Path(key), Path(client_ca))


def check_access(address: ListenAddress, tls: TlsFiles | None) -> None:
    """Refuse a non-local address without TLS: flows name pods and IPs."""
    if not address.local and tls is None:
        raise AccessError(
            f"--hubble-listen {address.text} is reachable from other machines, and flows name pods and IPs: "
            "it needs TLS with client certificates (--hubble-tls-cert, --hubble-tls-key, --hubble-tls-client-ca), "
            "as Hubble Relay connects; or listen on a Unix socket (unix:///var/run/podmeter/hubble.sock) or on "
            "loopback (127.0.0.1:4246)")


class _Certificates:
    """The TLS files, read again when one of them changes (a rotated certificate is used by new
    connections without a restart)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = self._mtimes()
        self.initial = self._configuration()

    def _mtimes(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in (self.files.cert, self.files.key, self.files.client_ca))

    def _configuration(self) -> Any:
        cert, key, ca = (p.read_bytes() for p in (self.files.cert, self.files.key, self.files.client_ca))
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> Any:
        try:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            configuration = self._configuration()
        except (OSError, ValueError) as exc:
            log.warning("Hubble API: cannot read the new TLS files (the previous ones stay): %s", exc)
            return None
        self._stamp = stamp
        log.info("Hubble API: TLS files changed; new connections use them")
        return configuration

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.initial, self.fetch, require_client_authentication=True)


@dataclass(frozen=True)
class HubbleConfig:
    """Where the agent serves the Hubble API, and with which TLS files."""

    address: ListenAddress
    tls: TlsFiles | None = None


def hubble_config(listen: str | None, cert: str | None = None, key: str | None = None,
                  client_ca: str | None = None) -> HubbleConfig | None:
    """The agent's ``--hubble-*`` options checked before anything starts (None: the API is off);
    :class:`AccessError` says what is wrong."""
    tls = tls_files(cert, key, client_ca)
    if listen is None:
        if tls is not None:
            raise AccessError("--hubble-tls-cert, --hubble-tls-key and --hubble-tls-client-ca need --hubble-listen")
        return None
    address = parse_listen(listen)
    check_access(address, tls)
    if tls is not None:
        try:
            _Certificates(tls)
        except (OSError, ValueError) as exc:
            raise AccessError(f"cannot read the Hubble API's TLS files: {exc}") from None
    return HubbleConfig(address, tls)


# --- the service ----------------------------------------------------------------------------------------


def _encoded(message: bytes) -> bytes:
    return message


def _seconds(stamp: Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def _version() -> str:
    try:
        return f"podmeter/{metadata.version('podmeter')}"
    except metadata.PackageNotFoundError:
        return "podmeter"


@dataclass(eq=False)
class _Stream:
    """A server stream the server may end early, its reader cut off for falling behind (GetFlows, Notify):
    aborted once, by its handler or, when the handler is stuck in a write to a reader that does not read,
    by :meth:`watch`."""

    context: aio.ServicerContext[Any, Any]
    message: str
    ending: bool = False

    async def end(self) -> None:
        await self.end_with(self.message)

    async def end_with(self, message: str) -> None:
        if self.ending:
            return
        self.ending = True
        await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def watch(self, cut_off: Callable[[], bool]) -> None:
        """End the stream once ``cut_off()`` holds and its handler has not ended it itself (it would
        notice only once its write completes)."""
        while not cut_off():
            await asyncio.sleep(CUT_OFF_CHECK)
        await asyncio.sleep(CUT_OFF_CHECK)  # the handler, if it is not stuck, ends it itself meanwhile
        with contextlib.suppress(Exception):
            await self.end()


@dataclass(eq=False)
class _PeerClient:
    """One Notify stream: its bounded queue of changes (None: the stream ends), and whether the server
    dropped it for falling behind."""

    queue: asyncio.Queue[peer_pb2.ChangeNotification | None]
    stream: _Stream
    dropped: bool = False


def tls_server_name(node: str) -> str:
    """The name Relay checks a node's server certificate against: Hubble's naming for a node's server
    (``NODE.CLUSTER.hubble-grpc.cilium.io``, dots of the node name as dashes; the cluster is ``default``)."""
    return f"{node.replace('.', '-')}.{CLUSTER}.hubble-grpc.cilium.io"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HubbleServer:
    """The gRPC server of one agent. Start it inside the agent's event loop; stop it before the loop ends.

    Invariant (peers): after :meth:`start`, ``peers`` maps each announced node to its address, and every
    Notify client has been sent exactly the changes that turned its first list into ``peers`` (or has been
    dropped); this node is always in it, at the address it listens on (or its InternalIP on a wildcard).
    ``announce_peers``: None announces the other nodes only where this server is reachable from them (not
    on a Unix socket or loopback); True announces them anyway (tests of several agents on one machine).
    """

    def __init__(self, feed: FlowFeed, node_name: str, address: ListenAddress, *, tls: TlsFiles | None = None,
                 labels: LabelSource = no_labels, version: str | None = None, nodes: NodeSource | None = None,
                 announce_peers: bool | None = None, peer_queue: int = PEER_QUEUE) -> None:
        check_access(address, tls)
        self.feed, self.node_name, self.address, self.tls, self.labels = feed, node_name, address, tls, labels
        self.nodes, self.peer_queue = nodes, peer_queue
        wanted = not address.local if announce_peers is None else announce_peers
        self.announcing = nodes is not None and wanted
        self.peers: dict[str, str] = {}
        self.peer_clients_dropped = 0  # Notify clients dropped for falling behind
        self._peer_clients: set[_PeerClient] = set()
        if nodes is not None:
            nodes.on_nodes_changed(self._node_changed)
        self.version = version or _version()
        self.started = time.monotonic()
        self.port: int | None = None  # the bound TCP port, once started
        self.streams = 0  # GetFlows calls in progress
        self._server: aio.Server | None = None
        self._stopping = asyncio.Event()
        self.messages = FlowMessages(labels)  # shared by every stream: a record is encoded once

    # --- lifecycle

    async def start(self) -> None:
        server = aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_REQUEST)])
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "GetFlows": grpc.unary_stream_rpc_method_handler(
                self.get_flows, request_deserializer=observer_pb2.GetFlowsRequest.FromString,
                response_serializer=_encoded),  # the handler writes GetFlowsResponse bytes (FlowMessages.encoded)
            "ServerStatus": grpc.unary_unary_rpc_method_handler(
                self.server_status, request_deserializer=observer_pb2.ServerStatusRequest.FromString,
                response_serializer=observer_pb2.ServerStatusResponse.SerializeToString),
            "GetNodes": grpc.unary_unary_rpc_method_handler(
                self.get_nodes, request_deserializer=observer_pb2.GetNodesRequest.FromString,
                response_serializer=observer_pb2.GetNodesResponse.SerializeToString),
            "GetNamespaces": grpc.unary_unary_rpc_method_handler(
                self.get_namespaces, request_deserializer=observer_pb2.GetNamespacesRequest.FromString,
                response_serializer=observer_pb2.GetNamespacesResponse.SerializeToString),
        }
        health: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        }
        peer: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Notify": grpc.unary_stream_rpc_method_handler(
                self.notify, request_deserializer=peer_pb2.NotifyRequest.FromString,
                response_serializer=peer_pb2.ChangeNotification.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("observer.Observer", handlers),
                                         grpc.method_handlers_generic_handler("peer.Peer", peer),
                                         grpc.method_handlers_generic_handler("grpc.health.v1.Health", health)))
        self._stopping = asyncio.Event()
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
        self._start_peers()

    def _start_peers(self) -> None:
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

    async def stop(self, grace: float = 1.0) -> None:
        self._stopping.set()
        for client in self._peer_clients:  # the queue always has room for the end (one above the cap)
            client.queue.put_nowait(None)
        self._peer_clients.clear()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.address.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.address.unix_path.unlink()

    # --- observer.Observer

    async def get_flows(self, request: observer_pb2.GetFlowsRequest, context: aio.ServicerContext[Any, Any]
                        ) -> None:
        """A read of the flow-serving core (``adapters.flow_serving``) written as GetFlowsResponses: the past
        records, then with ``follow`` the new ones, a ``lost_events`` response (HUBBLE_RING_BUFFER) where
        the ring overwrote records before this reader read them."""
        if request.first and request.follow:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first cannot be combined with follow")
        since = _seconds(request.since) if request.HasField("since") else None
        until = _seconds(request.until) if request.HasField("until") else None
        try:
            wanted = selection(request.whitelist, request.blacklist, since, until, self.labels)
        except UnsupportedFilter as exc:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(exc))
        except BadFilter as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            reader = self.feed.open(dataclasses.replace(wanted, until=None) if request.follow else wanted,
                                    follow=request.follow, client=context.peer())
        except Busy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        stream = _Stream(context, "")
        reader.end = stream.end_with
        self.streams += 1
        try:
            async with reader:
                for past in await self._past(request, reader):
                    with reader.writing():
                        await context.write(self.messages.encoded(past))
                if request.follow:
                    await self._follow(reader, context, until)
                await reader.finish()
        finally:
            self.streams -= 1

    async def _follow(self, reader: Reader, context: aio.ServicerContext[Any, Any], until: float | None) -> None:
        async for item in reader.follow():
            if isinstance(item, Gap):
                message = lost_message(item.lost, self.node_name)
            elif until is not None and item.time > until:
                return
            else:
                message = self.messages.encoded(item)
            with reader.writing():
                await context.write(message)

    async def _past(self, request: observer_pb2.GetFlowsRequest, reader: Reader) -> list[FlowRecord]:
        # number 0 means "all" within a time window; a follower's window is only ever opened by since
        window = request.HasField("since") or (request.HasField("until") and not request.follow)
        if request.number == 0 and not window:
            return []
        return await reader.history(request.number or UNBOUNDED, first=request.first)

    async def server_status(self, request: observer_pb2.ServerStatusRequest, context: aio.ServicerContext[Any, Any]
                            ) -> observer_pb2.ServerStatusResponse:
        ring = self.feed.ring
        return observer_pb2.ServerStatusResponse(
            num_flows=len(ring), max_flows=ring.capacity, seen_flows=self.feed.published,
            uptime_ns=int((time.monotonic() - self.started) * 1e9),
            num_connected_nodes=UInt32Value(value=1), num_unavailable_nodes=UInt32Value(value=0),
            version=self.version)

    async def get_nodes(self, request: observer_pb2.GetNodesRequest, context: aio.ServicerContext[Any, Any]
                        ) -> observer_pb2.GetNodesResponse:
        ring = self.feed.ring
        node = observer_pb2.Node(
            name=self.node_name, version=self.version, address=self.address.text, state=relay_pb2.NODE_CONNECTED,
            tls=observer_pb2.TLS(enabled=self.tls is not None), uptime_ns=int((time.monotonic() - self.started) * 1e9),
            num_flows=len(ring), max_flows=ring.capacity, seen_flows=self.feed.published)
        return observer_pb2.GetNodesResponse(nodes=[node])

    async def get_namespaces(self, request: observer_pb2.GetNamespacesRequest,
                             context: aio.ServicerContext[Any, Any]) -> observer_pb2.GetNamespacesResponse:
        """The namespaces of the pods at either end of the ring's flows (a world end has none), sorted."""
        found: set[str] = set()
        for _, record in self.feed.ring.after(0):
            for end in (record.source.endpoint, record.destination.endpoint):
                if end is not None and end.namespace:
                    found.add(end.namespace)
        return observer_pb2.GetNamespacesResponse(
            namespaces=[observer_pb2.Namespace(cluster=CLUSTER, namespace=name) for name in sorted(found)])

    # --- peer.Peer

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
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def tls_server_name(self) -> str:
        """The name Relay checks this server's certificate against (:func:`tls_server_name`)."""
        return tls_server_name(self.node_name)

    def _own_address(self, node: Node | None) -> str:
        """This node's peer address: where it listens; on a wildcard host its InternalIP once the node store
        has it (the name otherwise, which Relay must resolve)."""
        if self.address.host or self.address.unix_path is not None or node is None or node.address is None:
            return self.peer_address
        return _host_port(node.address, self.port or self.address.port)

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
            address = _host_port(new.address, self.port or self.address.port)
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
        client = _PeerClient(asyncio.Queue(self.peer_queue + 1), _Stream(
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

    # --- grpc.health.v1.Health

    async def check(self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext[Any, Any]
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in HEALTHY_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

