"""The one flow-serving core (``adapters.flow_serving``) under hostile and busy readers, over real gRPC and
real HTTP: no request freezes the event loop the agent's writer shares (a wildcard of 45 stars, thousands
of CIDRs, a full ring), a follower that keeps up receives a drain of more than 4,096 records whole, one
that is lapped is told what it lost, and streams nobody reads are bounded and give their memory back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web

from hubble_support import Client, serving
from podmeter.adapters.flow_http import flows_handler
from podmeter.adapters.flow_serving import Batch, Busy, Encoded, FlowFeed, Gap
from podmeter.adapters.hubble.filters import MAX_VALUES
from podmeter.adapters.hubble.proto import flow_pb2, observer_pb2
from podmeter.adapters.hubble.server import HubbleServer, parse_listen
from podmeter.model.flow_records import FlowFilter
from podmeter.model.flows import UDP
from record_support import records


class LoopLag:
    """The longest the event loop went without running a 10 ms ticker (what the agent's writer and
    ``/readyz`` would have waited)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.perf_counter() - before - 0.01)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@pytest.fixture
async def full() -> AsyncIterator[tuple[FlowFeed, HubbleServer, Client]]:
    feed = FlowFeed(8192)
    feed.publish(records(8192))
    async with serving(feed) as (server, client):
        yield feed, server, client


async def test_a_wildcard_of_45_stars_neither_backtracks_nor_freezes_the_loop(full: Any) -> None:
    _, _, client = full
    pattern = "*" * 45 + "x"
    async with LoopLag() as lag:
        started = time.perf_counter()
        got = await client.flows(number=8192, whitelist=[flow_pb2.FlowFilter(node_name=[pattern])], timeout=30)
        took = time.perf_counter() - started
    assert got == []  # node-a has no x at its end
    assert took < 5 and lag.worst < 0.25, (took, lag.worst)
    matching = await client.flows(number=3, whitelist=[flow_pb2.FlowFilter(node_name=["*" * 45 + "a"])])
    assert len(matching) == 3


async def test_thousands_of_cidrs_cost_a_lookup_and_beyond_the_bound_are_refused(full: Any) -> None:
    _, _, client = full
    cidrs = [f"10.{i // 256}.{i % 256}.0/24" for i in range(MAX_VALUES - 1)] + ["10.0.0.1/32"]
    async with LoopLag() as lag:
        got = await client.flows(number=8192, whitelist=[flow_pb2.FlowFilter(source_ip=cidrs)], timeout=30)
    assert len(got) > 0 and all(r.flow.IP.source.startswith("10.0.0.") for r in got)
    assert lag.worst < 0.25, lag.worst
    too_many = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(50_000)]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await client.flows(number=10, whitelist=[flow_pb2.FlowFilter(source_ip=too_many)])
    assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_a_follower_that_keeps_up_receives_a_drain_of_5000_records_whole() -> None:
    feed = FlowFeed(8192)
    server = HubbleServer(feed, "node-a", parse_listen("127.0.0.1:0"))
    await server.start()
    try:
        async with Client(f"127.0.0.1:{server.port}") as client:
            call = client.observer.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
            for _ in range(200):
                if feed.followers:
                    break
                await asyncio.sleep(0.02)
            feed.publish(records(5000))  # one drain, beyond the 4,096 that once cut every follower off
            got = [await asyncio.wait_for(call.read(), 10) for _ in range(5000)]
            call.cancel()
        assert all(r.HasField("flow") for r in got)
        assert [r.flow.time.seconds for r in got] == [r.time.seconds for r in got]
        assert feed.gaps == 0 and feed.cut_off == 0
    finally:
        await server.stop(0)


async def test_a_lapped_follower_is_told_how_many_records_it_lost_and_goes_on() -> None:
    feed = FlowFeed(100)
    reader = feed.open(FlowFilter(), follow=True)
    async with reader:
        feed.publish(records(250))  # the ring holds the last 100: 150 went by before the reader looked
        items = []
        async for item in reader.follow():
            items.append(item)
            if len(items) == 101:
                break
    assert items[0] == Gap(150)
    assert [r.time for r in items[1:] if not isinstance(r, Gap)] == [r.time for r in records(100, start=150)]
    assert (feed.gaps, feed.lost, feed.streams) == (1, 150, 0)


async def test_streams_are_bounded_in_all_and_per_client_and_an_idle_follower_yields_its_slot() -> None:
    feed = FlowFeed(10, max_streams=4, max_per_client=2, max_followers=2, follower_idle=0.0)
    a, b = feed.open(FlowFilter(), follow=False, client="a"), feed.open(FlowFilter(), follow=False, client="a")
    with pytest.raises(Busy, match="this client has 2 reads"):
        feed.open(FlowFilter(), follow=False, client="a")
    f1, f2 = feed.open(FlowFilter(), follow=True, client="b"), feed.open(FlowFilter(), follow=True, client="c")
    with pytest.raises(Busy, match="4 reads"):
        feed.open(FlowFilter(), follow=False, client="d")
    feed._close(a)
    f3 = feed.open(FlowFilter(), follow=True, client="d")  # both followers idle: the idlest yields
    assert f1.cut_off is not None and "yielded its slot" in f1.cut_off and feed.evicted == 1
    assert feed.followers == 2 and feed.refused == 2
    for reader in (b, f2, f3):
        feed._close(reader)
    assert feed.streams == 0


async def serve_http(feed: FlowFeed) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/debug/flows", flows_handler(feed))
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def stalled_client(port: int, request: bytes) -> socket.socket:
    """A client that sends ``request`` and never reads: its receive window (4 KiB) fills at once, so the
    server's writes to it wait, as they do for a client that stopped reading behind a slow network."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(client, request)
    return client


async def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def eventually(condition: Callable[[], bool], timeout: float, what: str,
                     describe: Callable[[], Awaitable[str]] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s" + (f": {await describe()}" if describe else ""))
        await asyncio.sleep(0.05)


async def test_a_thousand_never_read_debug_flows_clients_are_bounded_and_give_their_memory_back() -> None:
    feed = FlowFeed(8192, write_timeout=2.0)
    feed.publish(records(8192))
    async for port in serve_http(feed):
        before = await rss_mib()
        sockets = []
        try:
            for _ in range(1000):  # raw TCP with a small window: a request, then never a byte read
                sockets.append(await stalled_client(port, b"GET /debug/flows?last=8192 HTTP/1.1\r\nHost: x\r\n\r\n"))
            await eventually(lambda: feed.refused > 0 or feed.streams >= feed.max_streams, 20, "the streams' bound")
            assert feed.streams <= feed.max_streams
            await eventually(lambda: feed.cut_off > 0 and feed.streams == 0, 60, "the stalled streams cut off",
                             lambda: asyncio.sleep(0, f"{feed.streams} open, {feed.cut_off} cut off"))
        finally:
            for client in sockets:
                client.close()
        grown = await rss_mib() - before
        for _ in range(100):  # the feed gives the memory back a moment after the burst (GIVE_BACK_DELAY)
            if grown < 25:
                break
            await asyncio.sleep(0.1)
            grown = await rss_mib() - before
        assert grown < 25, f"{grown:.0f} MiB more after the stalled clients went"
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/debug/flows?last=3") as ok:
            assert ok.status == 200 and len((await ok.read()).splitlines()) == 3


def test_encoded_bytes_are_made_once_and_bounded_whatever_the_churn() -> None:
    made: list[float] = []
    encoded = Encoded(lambda record: made.append(record.time) or str(record.time).encode(), 100)
    batch = records(100)
    assert [encoded(r) for r in batch] == [encoded(r) for r in batch] and len(made) == 100  # once each
    for _ in range(10):  # churn: ten rings' worth of new records
        for record in records(100, start=1000):
            encoded(record)
    assert len(encoded) == 100  # never more than its bound: what it keeps alive is at most a ring


async def test_followers_read_batches_that_end_at_multiples_and_are_joined_once_for_every_follower() -> None:
    feed = FlowFeed(1000)
    made: list[float] = []
    encoded = Encoded(lambda record: made.append(record.time) or f"{record.time}\n".encode(), 1000)
    feed.publish(records(10))  # the followers open after these: their cursors are at 10
    readers = [feed.open(FlowFilter(), follow=True) for _ in range(3)]
    udp = feed.open(FlowFilter(protocol="udp"), follow=True)
    batch = records(700, start=10)
    feed.publish(batch)
    joined: list[list[bytes]] = []
    for reader in readers:
        async with reader:
            got: list[bytes] = []
            following = reader.follow_batches()
            while sum(part.count(b"\n") for part in got) < 700:
                item = await anext(following)
                assert not isinstance(item, Gap) and item.whole
                assert item.high % 256 == 0 or item.high == feed.ring.last_seq
                got.append(encoded.lines(item))
            await following.aclose()
            joined.append(got)
    assert [len(parts) for parts in joined] == [3, 3, 3]  # 11-256, 257-512, 513-710
    assert all(a is b for a, b in zip(joined[0], joined[2], strict=True))  # the same bytes for every follower
    assert b"".join(joined[0]) == b"".join(f"{r.time}\n".encode() for r in batch) and len(made) == 700
    async with udp:
        following = udp.follow_batches()
        item = await anext(following)
        await following.aclose()
    assert isinstance(item, Batch) and not item.whole and item.records
    assert {r.protocol for r in item.records} == {UDP}


def test_joined_batches_are_bounded_by_the_records_they_hold() -> None:
    encoded = Encoded(lambda record: b"x\n", 100)
    batch = records(256)
    for low in range(1, 2000, 50):
        encoded.lines(Batch(low, low + 49, batch[:50], True))
    assert encoded._joined_records <= 100 and len(encoded._joined) == 2


async def test_a_pinned_follower_never_yields_its_slot() -> None:
    """The agent's own follower (the flow export) keeps its slot however long its filter matches nothing."""
    feed = FlowFeed(10, max_followers=1, follower_idle=0.0)
    pinned = feed.open(FlowFilter(), follow=True, client="flow-export", pinned=True)
    with pytest.raises(Busy, match="1 follow"):
        feed.open(FlowFilter(), follow=True, client="b")
    assert pinned.cut_off is None and feed.evicted == 0 and feed.followers == 1
    feed._close(pinned)
