"""The agent's flow drain through Services, in its writer task: the node's conntrack is read in a worker
thread after the kernel's entries were taken, so the event loop goes on serving during a long dump, and
the drain keeps its place in the writer's order (named with the view of the moment it took the entries,
finished before the next batch)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from flow_support import flow_agent, key, pod
from podmeter.adapters.conntrack import Translation, Tuple
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.deltas import PODS, SERVICES, Delete, Upsert
from podmeter.model.services import Service, ServicePort, port_table
from podmeter.runtime.service_names import ServiceNames
from podmeter.runtime.ticks import Tick

pytestmark = pytest.mark.fast
TCP = 6
CLIENT, VIP, BACKEND = "10.0.2.7", "10.96.0.10", "10.0.1.5"
DUMP_S = 1.0  # a long dump (10,000 translations take about 0.19 s: bench.conntrack)


def test_a_long_conntrack_dump_leaves_the_event_loop_serving_and_the_drain_in_its_order() -> None:
    dumped = threading.Event()
    threads: list[str] = []

    def slow_dump() -> list[Translation]:
        threads.append(threading.current_thread().name)
        time.sleep(DUMP_S)
        dumped.set()
        return [Translation(Tuple(TCP, CLIENT, 40000, VIP, 80), Tuple(TCP, BACKEND, 8080, CLIENT, 40000), False)]

    datapath = MemoryDatapath()
    services = ServiceNames(slow_dump)
    agent = flow_agent(datapath)
    agent.services = agent.flows.services = services  # type: ignore[union-attr]
    client, backend = pod("client", CLIENT), pod("web", BACKEND)
    agent.apply_batch([Upsert(PODS, client), Upsert(PODS, backend)])

    async def run() -> float:
        await services.apply_services(Upsert(SERVICES, Service(
            "shop", "web", "u-web", "ClusterIP", VIP, port_table([ServicePort("http", TCP, 80)]))))
        writer = asyncio.create_task(agent._write_loop())
        datapath.record_flow(key(CLIENT, VIP, 40000, 80), 3, 300, time.monotonic_ns())
        await agent.queue.put(Tick.DRAIN)
        await asyncio.sleep(0.05)  # the writer took the entries and waits for the dump
        await agent.queue.put(Delete(PODS, client.uid))  # queued during the dump: applied after the drain
        started, gaps, last = time.monotonic(), [], time.monotonic()
        while not dumped.is_set() or agent.flow_feed.ring.last_seq == 0:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            assert now - started < DUMP_S + 10, "the drain never finished"
        await asyncio.sleep(0.05)
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        services.close()
        return max(gaps)

    longest = asyncio.run(run())
    assert longest < DUMP_S / 4, f"the event loop stalled {longest:.2f} s during a {DUMP_S} s dump"
    assert threads and threads[0].startswith("podmeter-conntrack") and services.translations_read == 1
    ((_, record),) = agent.flow_feed.ring.after(0)
    assert record.source.endpoint is not None and record.source.endpoint.pod == "client", \
        "named with the view of the moment the entries were taken, not after the delete queued meanwhile"
    assert record.destination.service is not None and record.destination.service.named == ("shop", "web")
    assert record.destination.endpoint is not None and record.destination.endpoint.pod == "web"
    assert client.uid not in agent.view.pods, "the delete queued during the dump was applied after it"
