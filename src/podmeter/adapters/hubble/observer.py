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
- **DNS records** (``model.dns``: the agent's DNS feed, a ring of its own) are served beside the flows as
  Hubble's L7 DNS flows (``adapters.hubble.flows``): a ``GetFlows`` opens a reader on each feed with the
  same selection, sends their past records merged by time (the last ``number`` of both together), then
  follows both, each record as its feed publishes it. Each reader is a cursor of its own: a ``lost_events``
  response counts what one ring overwrote before it was read; both count against their feed's bounds (a
  read refused by either is refused), both are cut off together (a write that does not complete is a write
  of both), and a record sent by either keeps both from looking idle.
- ``ServerStatus``: flows held (both rings), their capacity, flows seen, uptime, one connected node.
- ``GetNamespaces``: the namespaces of the pods at either end of the flows the rings hold, sorted, each in
  podmeter's one cluster (``default``).
- ``GetNodes``: this node.

Next stage: ``adapters.hubble.server`` registers these handlers beside ``peer`` and ``health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import sys
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from operator import attrgetter
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.wrappers_pb2 import UInt32Value
from grpc import aio

from podmeter.adapters.flow_serving import Batch, Busy, FlowFeed, Gap, Reader
from podmeter.adapters.hubble.access import ListenAddress, TlsFiles
from podmeter.adapters.hubble.filters import BadFilter, UnsupportedFilter, selection
from podmeter.adapters.hubble.flows import CLUSTER, ENCODED, FlowMessages, LabelSource, lost_message
from podmeter.adapters.hubble.proto import observer_pb2, relay_pb2
from podmeter.adapters.hubble.streams import EndableStream
from podmeter.model.flow_records import FlowRecord

UNBOUNDED = sys.maxsize
_TIME = attrgetter("time")


def _encoded(message: bytes) -> bytes:
    return message


def _seconds(stamp: Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


class ObserverService:
    """The Observer's handlers on one agent's flow feed and, when it reads DNS, its DNS feed."""

    def __init__(self, feed: FlowFeed, node_name: str, address: ListenAddress, *, tls: TlsFiles | None,
                 labels: LabelSource, version: str, dns_feed: FlowFeed | None = None) -> None:
        self.feed, self.node_name, self.address, self.tls, self.labels = feed, node_name, address, tls, labels
        self.feeds = [feed] if dns_feed is None else [feed, dns_feed]
        self.version = version
        self.started = time.monotonic()
        self.streams = 0  # GetFlows calls in progress
        # shared: a record is encoded once
        self.messages = FlowMessages(labels, min(ENCODED, sum(f.ring.capacity for f in self.feeds)))

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
        selector = dataclasses.replace(wanted, until=None) if request.follow else wanted
        stream = EndableStream(context, "")
        async with contextlib.AsyncExitStack() as held:  # a read refused by a later feed frees the earlier ones
            readers: list[Reader] = []
            for feed in self.feeds:
                try:
                    reader = feed.open(selector, follow=request.follow, client=context.peer())
                except Busy as exc:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                reader.end = stream.end_with
                readers.append(await held.enter_async_context(reader))
            self.streams += 1
            try:
                await self._serve(request, readers, context, until)
            finally:
                self.streams -= 1

    async def _serve(self, request: observer_pb2.GetFlowsRequest, readers: list[Reader],
                     context: aio.ServicerContext[Any, Any], until: float | None) -> None:
        for past in await self._past(request, readers):
            with _writing(readers):
                await context.write(self.messages.encoded(past))
        if request.follow:
            await self._follow(readers, context, until)
        for reader in readers:
            await reader.finish()

    async def _follow(self, readers: list[Reader], context: aio.ServicerContext[Any, Any],
                      until: float | None) -> None:
        encoded = self.messages.encoded
        # closed on the way out, however it ends (a cancelled call too): its reads' tasks end with it
        async with contextlib.aclosing(_interleaved([reader.follow_batches() for reader in readers])) as items:
            async for item in items:
                if isinstance(item, Gap):
                    with _writing(readers):
                        await context.write(lost_message(item.lost, self.node_name))
                    continue
                for record in item.records:  # one message per flow: Hubble's protocol
                    if until is not None and record.time > until:
                        return
                    with _writing(readers):
                        await context.write(encoded(record))
                for reader in readers:  # the stream was sent something: no reader of it is idle
                    reader.last_sent = time.monotonic()

    async def _past(self, request: observer_pb2.GetFlowsRequest, readers: Sequence[Reader]) -> list[FlowRecord]:
        """The past records of every reader, merged by time: the last ``number`` of them all (the first with
        ``first``)."""
        # number 0 means "all" within a time window; a follower's window is only ever opened by since
        window = request.HasField("since") or (request.HasField("until") and not request.follow)
        if request.number == 0 and not window:
            return []
        count = request.number or UNBOUNDED
        pasts = [await reader.history(count, first=request.first) for reader in readers]
        if len(pasts) == 1:
            return pasts[0]
        merged = list(heapq.merge(*pasts, key=_TIME))
        return merged[:count] if request.first else merged[max(0, len(merged) - count):]

    async def server_status(self, request: observer_pb2.ServerStatusRequest, context: aio.ServicerContext[Any, Any]
                            ) -> observer_pb2.ServerStatusResponse:
        return observer_pb2.ServerStatusResponse(
            num_flows=self._held(), max_flows=self._capacity(), seen_flows=self._seen(),
            uptime_ns=int((time.monotonic() - self.started) * 1e9),
            num_connected_nodes=UInt32Value(value=1), num_unavailable_nodes=UInt32Value(value=0),
            version=self.version)

    async def get_nodes(self, request: observer_pb2.GetNodesRequest, context: aio.ServicerContext[Any, Any]
                        ) -> observer_pb2.GetNodesResponse:
        node = observer_pb2.Node(
            name=self.node_name, version=self.version, address=self.address.text, state=relay_pb2.NODE_CONNECTED,
            tls=observer_pb2.TLS(enabled=self.tls is not None), uptime_ns=int((time.monotonic() - self.started) * 1e9),
            num_flows=self._held(), max_flows=self._capacity(), seen_flows=self._seen())
        return observer_pb2.GetNodesResponse(nodes=[node])

    async def get_namespaces(self, request: observer_pb2.GetNamespacesRequest,
                             context: aio.ServicerContext[Any, Any]) -> observer_pb2.GetNamespacesResponse:
        """The namespaces of the pods at either end of the ring's flows (a world end has none), sorted."""
        found: set[str] = set()
        for _, record in (held for feed in self.feeds for held in feed.ring.after(0)):
            for end in (record.source.endpoint, record.destination.endpoint):
                if end is not None and end.namespace:
                    found.add(end.namespace)
        return observer_pb2.GetNamespacesResponse(
            namespaces=[observer_pb2.Namespace(cluster=CLUSTER, namespace=name) for name in sorted(found)])

    def _held(self) -> int:
        return sum(len(feed.ring) for feed in self.feeds)

    def _capacity(self) -> int:
        return sum(feed.ring.capacity for feed in self.feeds)

    def _seen(self) -> int:
        return sum(feed.published for feed in self.feeds)


@contextlib.contextmanager
def _writing(readers: Sequence[Reader]) -> Iterator[None]:
    """A write of the stream is a write of every reader: one that does not complete cuts them all off."""
    with contextlib.ExitStack() as stack:
        for reader in readers:
            stack.enter_context(reader.writing())
        yield


async def _interleaved(sources: list[AsyncGenerator[Batch | Gap, None]]) -> AsyncGenerator[Batch | Gap, None]:
    """What the sources yield, each item as soon as its source has it; ends when one source ends (its read
    was cut off: the stream ends). The sources are closed on the way out."""
    if len(sources) == 1:
        async with contextlib.aclosing(sources[0]) as only:
            async for item in only:
                yield item
        return
    pending = {asyncio.ensure_future(anext(source)): source for source in sources}
    try:
        while True:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                source = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    return
                yield item
                pending[asyncio.ensure_future(anext(source))] = source
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
        for source in sources:
            await source.aclose()
