"""``/debug/flows`` over real HTTP and the real ``podmeter observe`` command reading it.

The agent's HTTP app (the same ``build_app`` as the agent's) serves a feed that the test publishes into;
``podmeter observe`` runs as a process, as users run it: ``--last N`` prints the last N in order and
exits, ``--follow`` prints flows as they are published, every filter reaches the server, ``-o json``
follows the documented record fields, and a bad request or an unreachable agent is a clear error. A
follower asking for a long history misses nothing published while the history goes out and holds its
slot from the first byte; a follower leaving is no error in the agent's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import sys
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from flow_support import observe, sample_records, served
from podmeter.adapters.flow_http import flows_handler
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.http import build_app, serve
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_records import FlowRecord

CONTRACT_END = {"ip", "port", "namespace", "pod", "workload"}
CONTRACT = {"time", "source", "destination", "protocol", "packets", "bytes", "tcp_flags", "observation", "node"}


@pytest.fixture
async def agent_http() -> AsyncIterator[tuple[FlowFeed, int]]:
    feed = FlowFeed(100)
    async with served(feed) as port:
        yield feed, port


async def test_last_n_prints_the_last_n_in_order_as_contract_json(agent_http: tuple[FlowFeed, int]) -> None:
    feed, port = agent_http
    feed.publish(sample_records(10))
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
    feed.publish(sample_records(1, start=1))
    code, lines, _ = await observe(port, "--last", "1")
    assert code == 0
    assert "node-a: shop/web 10.0.0.1:40001 -> shop/db 10.0.0.2:5432 UDP from-pod 1 pkts 101 B" in lines[0]


def dropped(batch: list[FlowRecord]) -> list[FlowRecord]:
    return [msgspec.structs.replace(r, verdict="dropped", drop_reason="NETFILTER_DROP") for r in batch]


async def test_every_filter_reaches_the_server_through_the_command(agent_http: tuple[FlowFeed, int]) -> None:
    """Records 0..10 from shop/web (a bare pod: its own workload): odd ones to shop/db, even ones to the world;
    TCP, UDP, ICMP in turn; record i at i seconds; 9 and 10 dropped."""
    feed, port = agent_http
    feed.publish(sample_records(9) + dropped(sample_records(2, start=9)))
    cases: dict[tuple[str, ...], int] = {
        ("--namespace", "shop"): 11, ("--namespace", "other"): 0,
        ("--pod", "db"): 5, ("--pod", "shop/web"): 11, ("--pod", "other/web"): 0,
        ("--from-pod", "db"): 0, ("--from-pod", "shop/web"): 11, ("--to-pod", "shop/db"): 5,
        ("--workload", "world"): 6, ("--workload", "shop/db"): 5, ("--workload", "other/db"): 0,
        ("--protocol", "udp"): 4, ("--protocol", "icmp"): 3, ("--port", "40004"): 1, ("--since", "6"): 5,
        ("--verdict", "dropped"): 2, ("--verdict", "forwarded"): 9, ("--verdict", "dropped", "--to-pod", "db"): 1,
        ("--last", "3"): 3, ("--last", "2", "--verdict", "forwarded", "--workload", "world"): 2,
    }

    async def run(args: tuple[str, ...]) -> tuple[int, list[str], str]:
        return await observe(port, *(() if "--last" in args else ("--last", "100")), "-o", "json", *args)

    answers = await asyncio.gather(*(run(args) for args in cases))  # one process each, all at once
    for (args, expected), (code, lines, err) in zip(cases.items(), answers, strict=True):
        assert (code, len(lines)) == (0, expected), (args, err)
    last_two = [json.loads(line) for line in answers[-1][1]]
    assert [(r["bytes"], r["verdict"]) for r in last_two] == [(106, "forwarded"), (108, "forwarded")]


async def test_follow_streams_new_flows_as_they_are_published(agent_http: tuple[FlowFeed, int],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    feed, port = agent_http
    feed.publish(sample_records(5))  # history: not shown with --follow alone
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "podmeter", "observe", "--server", f"127.0.0.1:{port}", "--follow", "-o", "json",
        "--protocol", "tcp", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        for _ in range(100):
            if feed.followers:
                break
            await asyncio.sleep(0.05)
        assert feed.followers == 1
        feed.publish(sample_records(6, start=100))
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
    await asyncio.sleep(0.2)  # the handler's last steps after the slot is given back
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []  # a reader leaving is how a follow ends, not an error of the agent


HISTORY = 40_000  # records of some 480 bytes each: far more than the loopback's socket buffers hold


@functools.cache
def history() -> tuple[FlowRecord, ...]:
    return tuple(sample_records(HISTORY))


async def read_until(response: aiohttp.ClientResponse, final: int) -> list[int]:
    """The records' bytes up to the one of ``final`` bytes (each test record's bytes are 100 + its index:
    its name), or all that came within 10 s of each other (then ``final`` is missing: the test says so)."""
    got: list[int] = []
    with contextlib.suppress(TimeoutError):
        while not got or got[-1] != final:
            got.append(json.loads(await asyncio.wait_for(response.content.readline(), 10))["bytes"])
    return got


def missing(got: list[int], count: int) -> list[int]:
    return sorted(set(range(100, 100 + count)) - set(got))


async def test_records_published_while_a_long_history_goes_out_reach_the_follower_in_order() -> None:
    feed = FlowFeed(HISTORY)
    feed.publish(list(history()))
    url = f"/debug/flows?last={HISTORY}&follow=1"
    async with served(feed) as port, aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session, \
            session.get(url) as response:
        assert response.status == 200
        await asyncio.sleep(0.2)  # not reading: the agent waits for room in the socket with most of the history
        feed.publish(sample_records(50, start=HISTORY))
        got = await read_until(response, 100 + HISTORY - 1)
        for _ in range(100):
            if feed.followers:
                break
            await asyncio.sleep(0.05)
        feed.publish(sample_records(5, start=HISTORY + 50))  # published once the follower surely follows
        got += await read_until(response, 100 + HISTORY + 54)
    assert missing(got, HISTORY + 55) == []
    assert got == [100 + i for i in range(HISTORY + 55)]  # the history, then all that came after, in order


async def test_a_follower_holds_its_slot_from_the_start_so_a_refusal_is_a_503_not_a_cut_stream() -> None:
    feed = FlowFeed(HISTORY, max_followers=1)
    feed.publish(list(history()))
    async with served(feed) as port, aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session, \
            session.get(f"/debug/flows?last={HISTORY}&follow=1") as first:
        assert first.status == 200  # its history still going out: the agent waits for it to read
        async with session.get("/debug/flows?follow=1") as second:
            assert second.status == 503 and "too many readers" in await second.text()
        feed.publish(sample_records(1, start=HISTORY))
        got = await read_until(first, 100 + HISTORY)
    assert got == [100 + i for i in range(HISTORY + 1)]


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




async def test_labels_on_request_name_each_end_s_labels() -> None:
    feed = FlowFeed(100)
    seen: list[str] = []

    def labels(endpoint: Endpoint) -> tuple[str, ...]:
        seen.append(endpoint.pod)
        return ("app", endpoint.pod.split("-")[0], "tier", "db") if endpoint.pod else ()

    app = build_app(CollectorRegistry(), lambda: True, {},
                    debug_streams={"/debug/flows": flows_handler(feed, labels)})
    runner, port = await serve(app, "127.0.0.1:0")
    try:
        feed.publish(sample_records(2))
        code, plain, err = await observe(port, "--last", "2", "-o", "json")
        assert code == 0, err
        assert not seen  # labels are looked up only when asked
        assert all("labels" not in json.loads(line)["source"] for line in plain)  # only when asked
        code, lines, err = await observe(port, "--last", "2", "-o", "json", "--labels")
        assert code == 0, err
        got = [json.loads(line) for line in lines]
        source = got[-1]["source"]
        assert source["labels"] == {"app": source["pod"].split("-")[0], "tier": "db"}
        world = next(r["destination"] for r in got if r["destination"]["world"])
        assert world["labels"] == {}
        code, compact_lines, err = await observe(port, "--last", "2", "--labels")
        assert code == 0 and "{app=" in compact_lines[-1], err
    finally:
        await runner.cleanup()
