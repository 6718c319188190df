"""``/debug/flows`` over real HTTP and the real ``podmeter observe`` command reading it.

The agent's HTTP app (the same ``build_app`` as the agent's) serves a feed that the test publishes into;
``podmeter observe`` runs as a process, as users run it: ``--last N`` prints the last N in order and
exits, ``--follow`` prints flows as they are published, filters reach the server, ``-o json`` follows
the documented record fields, and a bad request or an unreachable agent is a clear error.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from factories import make_pod
from podmeter.adapters.flow_http import flows_handler
from podmeter.adapters.http import build_app, serve
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import FlowRecord, name_flows
from podmeter.model.flows import ICMP, TCP, UDP, FlowCounts, FlowKey, Observation
from podmeter.runtime.flow_feed import FlowFeed

CONTRACT_END = {"ip", "port", "namespace", "pod", "workload"}
CONTRACT = {"time", "source", "destination", "protocol", "packets", "bytes", "tcp_flags", "observation", "node"}


def records(n: int, start: int = 0) -> list[FlowRecord]:
    book = AddressBook([make_pod("web", "shop", ips=("10.0.0.1",)), make_pod("db", "shop", ips=("10.0.0.2",))])
    protocols = (TCP, UDP, ICMP)
    entries = [(FlowKey("10.0.0.1", "10.0.0.2" if i % 2 else "8.8.8.8", 40000 + i, 5432, protocols[i % 3],
                        Observation.FROM_POD),
                FlowCounts(1, 100 + i, i * 10**9, i * 10**9, 0b10 if protocols[i % 3] == TCP else 0))
               for i in range(start, start + n)]
    return name_flows(entries, book, "node-a", 0.0)


@pytest.fixture
async def agent_http() -> AsyncIterator[tuple[FlowFeed, int]]:
    feed = FlowFeed(100)
    app = build_app(CollectorRegistry(), lambda: True, {}, debug_streams={"/debug/flows": flows_handler(feed)})
    runner, port = await serve(app, "127.0.0.1:0")
    try:
        yield feed, port
    finally:
        await runner.cleanup()


async def observe(port: int, *args: str) -> tuple[int, list[str], str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "podmeter", "observe", "--server", f"127.0.0.1:{port}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode().splitlines(), err.decode()


async def test_last_n_prints_the_last_n_in_order_as_contract_json(agent_http: tuple[FlowFeed, int]) -> None:
    feed, port = agent_http
    feed.publish(records(10))
    code, lines, err = await observe(port, "--last", "3", "-o", "json")
    assert code == 0, err
    got = [json.loads(line) for line in lines]
    assert [r["source"]["port"] for r in got] == [40007, None, 40009]  # 40008 is ICMP: no ports
    for r in got:
        assert set(r) >= CONTRACT and set(r["source"]) >= CONTRACT_END and set(r["destination"]) >= CONTRACT_END
    assert got[2]["protocol"] == "TCP" and got[2]["tcp_flags"] == ["SYN"] and got[2]["observation"] == "from-pod"
    assert got[0]["protocol"] == "UDP" and got[0]["tcp_flags"] == [] and got[1]["icmp"] == {"type": 40008, "code": 5432}
    assert got[2]["destination"]["pod"] == "db" and got[1]["destination"]["world"] is True


async def test_compact_output_reads_at_a_glance(agent_http: tuple[FlowFeed, int]) -> None:
    feed, port = agent_http
    feed.publish(records(1, start=1))
    code, lines, _ = await observe(port, "--last", "1")
    assert code == 0
    assert "node-a: shop/web 10.0.0.1:40001 -> shop/db 10.0.0.2:5432 UDP from-pod 1 pkts 101 B" in lines[0]


async def test_filters_reach_the_server(agent_http: tuple[FlowFeed, int]) -> None:
    feed, port = agent_http
    feed.publish(records(9))
    cases: dict[tuple[str, ...], int] = {
        ("--protocol", "udp"): 3, ("--to-pod", "shop/db"): 4, ("--workload", "world"): 5,
        ("--port", "40004"): 1, ("--namespace", "shop"): 9, ("--from-pod", "db"): 0,
        ("--protocol", "icmp"): 3, ("--since", "6"): 3,
    }
    for args, expected in cases.items():
        code, lines, err = await observe(port, "--last", "100", "-o", "json", *args)
        assert (code, len(lines)) == (0, expected), (args, err)


async def test_follow_streams_new_flows_as_they_are_published(agent_http: tuple[FlowFeed, int]) -> None:
    feed, port = agent_http
    feed.publish(records(5))  # history: not shown with --follow alone
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "podmeter", "observe", "--server", f"127.0.0.1:{port}", "--follow", "-o", "json",
        "--protocol", "tcp", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        for _ in range(100):
            if feed.followers:
                break
            await asyncio.sleep(0.05)
        assert feed.followers == 1
        feed.publish(records(6, start=100))
        assert proc.stdout is not None
        got = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 10)) for _ in range(2)]
        assert [r["source"]["port"] for r in got] == [40102, 40105]  # the TCP ones, in order
    finally:
        proc.terminate()
        await proc.wait()
    for _ in range(100):  # the agent notices the reader went
        if not feed.followers:
            break
        await asyncio.sleep(0.05)
    assert feed.followers == 0


async def test_a_bad_parameter_is_a_400_that_names_it(agent_http: tuple[FlowFeed, int]) -> None:
    _, port = agent_http
    async with aiohttp.ClientSession() as session:
        for query, word in (("port=x", "port"), ("colour=red", "colour"), ("since=yesterday", "since")):
            async with session.get(f"http://127.0.0.1:{port}/debug/flows?{query}") as response:
                assert response.status == 400 and word in await response.text()


async def test_an_unreachable_agent_is_a_clear_error() -> None:
    code, _, err = await observe(1, "--last", "1")
    assert code == 1 and "cannot reach the agent at 127.0.0.1:1" in err and "--server" in err


def test_since_takes_durations_and_times() -> None:
    from podmeter.cli.observe import parse_since

    assert parse_since("5m", now=1000.0) == 700.0
    assert parse_since("1500") == 1500.0
    assert parse_since("2026-12-01T00:00:00Z") == 1796083200.0
    with pytest.raises(Exception, match="expected a duration"):
        parse_since("yesterday")


