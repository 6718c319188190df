"""``observer.Observer``: the flows of the agent's flow-serving core (``adapters.flow_serving``) as Hubble
serves them.

- ``GetFlows``: the last ``number`` matching records oldest first (the first ``number`` with ``first``; all
  of them between ``since`` and ``until`` when ``number`` is 0, none without either), then the stream ends
  with OK; with ``follow``, after the same past records (with ``number`` 0: all since ``since``, none
  without it), new records as the agent drains them, until the client cancels. ``first`` with ``follow``
  is ``INVALID_ARGUMENT``, as in Hubble; so is a bad filter, and a filter on what podmeter does not know
  (the interface, the node's labels, encryption, CEL) is ``UNIMPLEMENTED`` (``adapters.hubble.filters``).
  A follower is a cursor on the agent's ring like any other reader: one the ring laps is sent a
  ``lost_events`` response (``HUBBLE_RING_BUFFER``) with the number it missed; one that does not read is
  cut off (``RESOURCE_EXHAUSTED``) by the core's write timeout, and every read counts against its bounds.
- ``ServerStatus``: flows held (the ring), the ring's capacity, flows seen, uptime, one connected node.
- ``GetNamespaces``: the namespaces of the pods at either end of the flows the ring holds, sorted, each in
  podmeter's one cluster (``default``).
- ``GetNodes``: this node.

Next stage: ``adapters.hubble.server`` registers these handlers beside ``peer`` and ``health``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.wrappers_pb2 import UInt32Value
from grpc import aio

from podmeter.adapters.flow_serving import Busy, FlowFeed, Gap, Reader
from podmeter.adapters.hubble.access import ListenAddress, TlsFiles
from podmeter.adapters.hubble.filters import BadFilter, UnsupportedFilter, selection
from podmeter.adapters.hubble.flows import CLUSTER, ENCODED, FlowMessages, LabelSource, lost_message
from podmeter.adapters.hubble.proto import observer_pb2, relay_pb2
from podmeter.adapters.hubble.streams import EndableStream
from podmeter.model.flow_records import FlowRecord

UNBOUNDED = sys.maxsize


def _encoded(message: bytes) -> bytes:
    return message


def _seconds(stamp: Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


class ObserverService:
    """The Observer's handlers on one agent's flow feed."""

    def __init__(self, feed: FlowFeed, node_name: str, address: ListenAddress, *, tls: TlsFiles | None,
                 labels: LabelSource, version: str) -> None:
        self.feed, self.node_name, self.address, self.tls, self.labels = feed, node_name, address, tls, labels
        self.version = version
        self.started = time.monotonic()
        self.streams = 0  # GetFlows calls in progress
        self.messages = FlowMessages(labels, min(ENCODED, feed.ring.capacity))  # shared: a record is encoded once

    def handlers(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
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
        return grpc.method_handlers_generic_handler("observer.Observer", methods)

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
        stream = EndableStream(context, "")
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
        encoded = self.messages.encoded
        async for item in reader.follow_batches():
            if isinstance(item, Gap):
                with reader.writing():
                    await context.write(lost_message(item.lost, self.node_name))
                continue
            for record in item.records:  # one message per flow: Hubble's protocol
                if until is not None and record.time > until:
                    return
                with reader.writing():
                    await context.write(encoded(record))

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
