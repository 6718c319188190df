"""The workload-pair flow series as Prometheus scrapes them from the agent's ``/metrics``.

A real :class:`~podmeter.runtime.agent.Agent` (driven through its writer's ``apply_batch``, the in-memory
datapath as its flow source) behind the agent's own HTTP app, wired as ``podmeter agent`` wires it: the
state collector and the workload-pair exposition. Scrapes go over HTTP and are read by Prometheus' own
text parser. Checked: the series limit folds new pairs into the ``_other_`` series and counts them in
``podmeter_workload_flow_series_folded_total``; a pair idle for ``flow_series_idle`` leaves ``/metrics``
while a busy one stays; a pair that talks again starts from zero (a counter reset).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from factories import make_pod
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.http import build_app, serve
from podmeter.adapters.metrics.agent_state import AgentStateCollector
from podmeter.adapters.metrics.flow_traffic import render_workload_flows
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace
from podmeter.model.flow_series import OTHER
from podmeter.model.flows import TCP, UDP, FlowKey, Observation
from podmeter.runtime.agent import Agent, AgentSettings
from podmeter.runtime.ticks import Tick

IDLE = 1.0  # seconds: the agent's flow_series_idle here (300 in production)
LIMIT = 2
BYTES = "podmeter_workload_flow_bytes_total"
PACKETS = "podmeter_workload_flow_packets_total"
Pair = tuple[str, str, str, str, str, str, str]  # the labels, in the order of _LABEL_NAMES
_LABEL_NAMES = ("source_namespace", "source_workload_kind", "source_workload", "destination_namespace",
                "destination_workload_kind", "destination_workload", "protocol")
WEB, DB, CACHE = "10.0.0.1", "10.0.0.2", "10.0.0.3"
WEB_DB: Pair = ("shop", "Pod", "web", "shop", "Pod", "db", "TCP")
WEB_CACHE: Pair = ("shop", "Pod", "web", "shop", "Pod", "cache", "TCP")
OVERFLOW: Pair = ("", "", OTHER, "", "", OTHER, OTHER)


class Scraped:
    """One scrape: the workload-pair samples by their labels, and the other samples by name."""

    def __init__(self, text: str) -> None:
        self.bytes: dict[Pair, float] = {}
        self.packets: dict[Pair, float] = {}
        self.values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (BYTES, PACKETS):
                    pair: Pair = tuple(sample.labels[n] for n in _LABEL_NAMES)  # type: ignore[assignment]
                    assert set(sample.labels) == set(_LABEL_NAMES)  # workload granularity: no IPs, no ports
                    (self.bytes if sample.name == BYTES else self.packets)[pair] = sample.value
                elif not sample.labels:
                    self.values[sample.name] = sample.value


@pytest.fixture
async def agent() -> AsyncIterator[tuple[Agent, MemoryDatapath, str]]:
    datapath = MemoryDatapath()
    settings = AgentSettings(node_name="node-a", flow_series_limit=LIMIT, flow_series_idle=IDLE)
    agent = Agent(settings, connection=None, datapath=datapath, flows=datapath)  # type: ignore[arg-type]
    pods = [make_pod(name, "shop", ips=(ip,), observe=True) for name, ip in (("web", WEB), ("db", DB),
                                                                             ("cache", CACHE))]
    agent.apply_batch([Replace(PODS, pods), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    registry = CollectorRegistry()
    registry.register(AgentStateCollector(agent.snapshot))  # as `podmeter agent` registers them
    app = build_app(registry, agent.ready.is_set, {}, expositions=[lambda: render_workload_flows(agent.workload_flows)])
    runner, port = await serve(app, "127.0.0.1:0")
    try:
        yield agent, datapath, f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


def send(datapath: MemoryDatapath, source: str, destination: str, size: int, protocol: int = TCP) -> None:
    key = FlowKey(source, destination, 40000, 80, protocol, Observation.FROM_POD)
    assert datapath.record_flow(key, 1, size, time.monotonic_ns())


async def scrape(url: str) -> Scraped:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return Scraped(await response.text())


async def test_pairs_past_the_limit_fold_into_the_other_series_and_are_counted(
        agent: tuple[Agent, MemoryDatapath, str]) -> None:
    core, datapath, url = agent
    send(datapath, WEB, DB, 100)
    send(datapath, WEB, CACHE, 200)
    core.apply_batch([Tick.DRAIN])
    send(datapath, DB, CACHE, 30, UDP)  # two new pairs, the limit reached: both go to the overflow series
    send(datapath, CACHE, "8.8.8.8", 40, UDP)
    send(datapath, WEB, DB, 5)  # a pair that has its series keeps it
    core.apply_batch([Tick.DRAIN])
    scraped = await scrape(url)
    assert scraped.bytes == {WEB_DB: 105, WEB_CACHE: 200, OVERFLOW: 70}
    assert scraped.packets == {WEB_DB: 2, WEB_CACHE: 1, OVERFLOW: 2}
    assert scraped.values["podmeter_workload_flow_series_folded_total"] == 2
    assert scraped.values["podmeter_workload_flow_series"] == LIMIT + 1


async def test_an_idle_pair_leaves_metrics_a_busy_one_stays_and_a_returning_one_starts_from_zero(
        agent: tuple[Agent, MemoryDatapath, str]) -> None:
    core, datapath, url = agent
    send(datapath, WEB, DB, 100)
    send(datapath, WEB, CACHE, 200)
    send(datapath, DB, CACHE, 30, UDP)  # folded
    core.apply_batch([Tick.DRAIN])
    await asyncio.sleep(IDLE * 0.6)
    send(datapath, WEB, DB, 1)  # web -> db keeps talking
    core.apply_batch([Tick.DRAIN, Tick.EXPIRE])
    assert set((await scrape(url)).bytes) == {WEB_DB, WEB_CACHE, OVERFLOW}  # none idle for IDLE yet
    await asyncio.sleep(IDLE * 0.6)
    core.apply_batch([Tick.EXPIRE])  # the agent's expire timer
    scraped = await scrape(url)
    assert scraped.bytes == {WEB_DB: 101}  # web -> cache and the overflow series are gone
    assert scraped.values["podmeter_workload_flow_series"] == 1
    assert scraped.values["podmeter_workload_flow_series_folded_total"] == 1  # a counter: it never goes back
    send(datapath, WEB, CACHE, 7)
    core.apply_batch([Tick.DRAIN])
    assert (await scrape(url)).bytes == {WEB_DB: 101, WEB_CACHE: 7}  # a counter reset, rate() takes it
