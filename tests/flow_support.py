"""Flows and drops without a kernel, for the model's and the runtime's tests: flow keys and counts, an agent
on the in-memory datapath (the kernel's semantics) and what its flow ring credits to each pod, pods that
are observed, and drop drains."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import Counter
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from factories import make_pod
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.flow_http import flows_handler
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.http import build_app, serve
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace
from podmeter.model.drops import DropDrain, DropKey, DropLedger, TcpEvent
from podmeter.model.endpoints import AddressBook
from podmeter.model.flow_records import FlowRecord, name_flows
from podmeter.model.flows import ICMP, TCP, UDP, FlowCounts, FlowKey, Observation
from podmeter.model.records import Pod
from podmeter.runtime.agent import Agent, AgentSettings

FROM, TO = Observation.FROM_POD, Observation.TO_POD


def key(src: str, dst: str, sport: int = 40000, dport: int = 80, proto: int = TCP, obs: Observation = FROM) -> FlowKey:
    return FlowKey(src, dst, sport, dport, proto, obs)

def counts(packets: int = 1, size: int = 100, flags: int = 0, at: int = 5_000_000_000) -> FlowCounts:
    return FlowCounts(packets, size, at, at, flags)


def flow_agent(datapath: MemoryDatapath, **settings: float) -> Agent:
    agent = Agent(AgentSettings(node_name="node-a", **settings), connection=None, datapath=datapath,  # type: ignore[arg-type]
                  flows=datapath)
    agent.apply_batch([Replace(PODS, []), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    return agent


def sent_by(agent: Agent) -> Counter[str]:
    """Packets each pod (by UID) sent, from the from-pod records in the ring."""
    sent: Counter[str] = Counter()
    for _, record in agent.flow_feed.ring.after(0):
        if record.observation is FROM and record.source.endpoint is not None:
            sent[record.source.endpoint.uid] += record.packets
    return sent


def pod(name: str, ip: str, **kwargs: object) -> Pod:
    return make_pod(name, ips=(ip,), observe=True, **kwargs)

def drops_of(ledger: DropLedger) -> dict[str, dict[tuple[Direction, str], int]]:
    return {s.name: dict(s.drops) for s in ledger.values()}

def drain_of(*drops: tuple[str, Direction, str, int], tcp: tuple[tuple[str, TcpEvent, int], ...] = ()) -> DropDrain:
    return DropDrain([(DropKey(ip, d, r), n) for ip, d, r, n in drops], [],
                     [((ip, event), n) for ip, event, n in tcp], [])


# --- podmeter observe against a served feed ------------------------------------------------------------


def sample_records(n: int, start: int = 0) -> list[FlowRecord]:
    """Records from shop/web (a bare pod): odd ones to shop/db, even ones to the world; TCP, UDP, ICMP in
    turn; record i at i seconds (what ``podmeter observe``'s tests print and filter)."""
    book = AddressBook([make_pod("web", "shop", ips=("10.0.0.1",)), make_pod("db", "shop", ips=("10.0.0.2",))])
    protocols = (TCP, UDP, ICMP)
    entries = [(FlowKey("10.0.0.1", "10.0.0.2" if i % 2 else "8.8.8.8", 40000 + i, 5432, protocols[i % 3],
                        Observation.FROM_POD),
                FlowCounts(1, 100 + i, i * 10**9, i * 10**9, 0b10 if protocols[i % 3] == TCP else 0))
               for i in range(start, start + n)]
    return name_flows(entries, book, "node-a", 0.0)


@contextlib.asynccontextmanager
async def served(feed: FlowFeed) -> AsyncIterator[int]:
    """The agent's HTTP app serving ``feed``'s flows on a free loopback port."""
    app = build_app(CollectorRegistry(), lambda: True, {}, debug_streams={"/debug/flows": flows_handler(feed)})
    runner, port = await serve(app, "127.0.0.1:0")
    try:
        yield port
    finally:
        await runner.cleanup()


async def observe(port: int, *args: str) -> tuple[int, list[str], str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "podmeter", "observe", "--server", f"127.0.0.1:{port}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode().splitlines(), err.decode()
