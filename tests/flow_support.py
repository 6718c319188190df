"""Flows and drops without a kernel, for the model's and the runtime's tests: flow keys and counts, an agent
on the in-memory datapath (the kernel's semantics) and what its flow ring credits to each pod, pods that
are observed, and drop drains."""

from __future__ import annotations

from collections import Counter

from factories import make_pod
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace
from podmeter.model.drops import DropDrain, DropKey, DropLedger, TcpEvent
from podmeter.model.flows import TCP, FlowCounts, FlowKey, Observation
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
