"""Per-pod traffic series through the real agent (lab API server over HTTP, in-memory datapath).

Traffic is injected into the in-memory datapath exactly as the kernel program counts it (only for IPs in
the filter); the kernel path with real packets is in test_metrics_kernel.py.
"""

from __future__ import annotations

import threading
import time
import tracemalloc

from agent_harness import AgentHarness, Cluster, wait_for
from factories import make_pod
from lab_server import LabServer
from metrics_support import pod_value, scrape
from podmeter.adapters.metrics.pod_traffic import PodTrafficExposition
from podmeter.model.datapath import Direction
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.runtime.agent import Agent, AgentSettings

IN, OUT = Direction.INGRESS, Direction.EGRESS


def send(agent: AgentHarness, ip: str, direction: Direction, packets: int, size: int) -> None:
    agent.on_loop(lambda: agent.datapath.count(ip, direction, packets, packets * size))  # type: ignore[attr-defined]


def test_observed_pod_series_and_no_series_for_others(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "seen", "10.4.0.1", observe=True)
        cluster.pod("shop", "unseen", "10.4.0.2")
        agent.wait_filter({"10.4.0.1"})
        send(agent, "10.4.0.1", OUT, 3, 100)
        send(agent, "10.4.0.1", IN, 2, 50)
        send(agent, "10.4.0.2", OUT, 9, 999)  # not in the filter: the kernel would not count it
        samples = scrape(agent)
        assert pod_value(samples, "podmeter_pod_bytes_total", "seen", "egress") == 300
        assert pod_value(samples, "podmeter_pod_packets_total", "seen", "ingress") == 2
        assert pod_value(samples, "podmeter_pod_bytes_total", "unseen", "egress") is None
        assert samples[("podmeter_node_bytes_total", (("direction", "egress"),))] == 300
        retina = scrape(agent, retina=True)
        assert any(name.startswith("networkobservability_adv_forward_bytes") and dict(labels)["podname"] == "seen"
                   and dict(labels)["ip"] == "10.4.0.1" for name, labels in retina)


def test_switched_off_series_ends_after_grace_and_restarts_from_zero(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    with AgentHarness(lab_apiserver, series_grace=1.0) as agent:
        cluster.pod("shop", "web", "10.4.0.1", observe=True)
        agent.wait_filter({"10.4.0.1"})
        send(agent, "10.4.0.1", OUT, 4, 100)
        cluster.annotate_pod("shop", "web", None)
        agent.wait_filter(set())
        assert pod_value(scrape(agent), "podmeter_pod_bytes_total", "web", "egress") == 400  # final value
        wait_for(lambda: pod_value(scrape(agent), "podmeter_pod_bytes_total", "web", "egress") is None,
                 timeout=5, what="series gone after the grace period")
        cluster.annotate_pod("shop", "web", True)
        agent.wait_filter({"10.4.0.1"})
        assert pod_value(scrape(agent), "podmeter_pod_bytes_total", "web", "egress") == 0
        send(agent, "10.4.0.1", OUT, 1, 10)
        assert pod_value(scrape(agent), "podmeter_pod_bytes_total", "web", "egress") == 10


def test_ip_reuse_delete_first(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "old", "10.4.0.9")
        agent.wait_filter({"10.4.0.9"})
        send(agent, "10.4.0.9", OUT, 5, 100)
        cluster.delete_pod("shop", "old")
        agent.wait_filter(set())
        cluster.pod("shop", "new", "10.4.0.9")
        agent.wait_filter({"10.4.0.9"})
        send(agent, "10.4.0.9", OUT, 2, 100)
        samples = scrape(agent)
        assert pod_value(samples, "podmeter_pod_bytes_total", "old", "egress") == 500
        assert pod_value(samples, "podmeter_pod_bytes_total", "new", "egress") == 200


def test_ip_reuse_new_owner_before_the_delete(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    with AgentHarness(lab_apiserver) as agent:
        cluster.pod("shop", "old", "10.4.0.9")
        agent.wait_filter({"10.4.0.9"})
        send(agent, "10.4.0.9", OUT, 5, 100)
        cluster.pod("shop", "new", "10.4.0.9")  # the old pod's delete has not arrived yet
        wait_for(lambda: agent.state()["filter"]["desired"].get("10.4.0.9") == ["shop/old", "shop/new"],
                 what="both pods hold the IP")
        send(agent, "10.4.0.9", OUT, 2, 100)
        cluster.delete_pod("shop", "old")
        wait_for(lambda: agent.state()["pods"] == 1, what="old deleted")
        send(agent, "10.4.0.9", OUT, 1, 100)
        samples = scrape(agent)
        assert agent.filter() == {"10.4.0.9"}  # the IP never left the filter
        assert pod_value(samples, "podmeter_pod_bytes_total", "old", "egress") == 500
        assert pod_value(samples, "podmeter_pod_bytes_total", "new", "egress") == 300


def test_scraping_during_churn_never_raises_or_goes_down(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    stop = threading.Event()
    errors: list[BaseException] = []
    highest: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    scrapes = 0

    with AgentHarness(lab_apiserver, series_grace=0.5) as agent:
        def scraper() -> None:
            nonlocal scrapes
            while not stop.is_set():
                try:
                    for key, value in scrape(agent).items():
                        if key[0].endswith("_total") and not key[0].startswith("podmeter_node_"):
                            assert value >= highest.get(key, 0), (key, value, highest.get(key))
                            highest[key] = value
                    scrapes += 1
                except BaseException as exc:  # reported below
                    errors.append(exc)
                    return

        thread = threading.Thread(target=scraper)
        thread.start()
        try:
            for i in range(40):
                ip = f"10.4.1.{i % 6 + 1}"  # six IPs for forty pods: constant reuse
                cluster.pod("shop", f"p{i}", ip)
                send(agent, ip, OUT, 1, 100)
                if i >= 3:
                    cluster.delete_pod("shop", f"p{i - 3}")
        finally:
            stop.set()
            thread.join(10)
    assert not errors, errors[0]
    assert scrapes > 5


def test_thousand_pods_leave_no_series_and_no_memory() -> None:
    """1,000 pods created and deleted with traffic: nothing stays, and a second round costs nothing more."""
    from podmeter.adapters.datapath.memory import MemoryDatapath

    datapath = MemoryDatapath(2048)
    agent = Agent(AgentSettings(node_name="node-a", series_grace=0.0), connection=None, datapath=datapath)  # type: ignore[arg-type]
    agent.apply_batch([Replace(PODS, []), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])

    def round_of_pods(offset: int) -> None:
        pods = [make_pod(f"job-{offset + i}", ips=(f"10.5.{i // 250}.{i % 250 + 1}",), observe=True)
                for i in range(1000)]
        agent.apply_batch([Upsert(PODS, p) for p in pods])
        for pod in pods:
            datapath.count(pod.ips[0], Direction.EGRESS, 2, 200)
        agent.apply_batch([Delete(PODS, p.uid, p) for p in pods])
        agent.ledger.expire(time.monotonic() + 1)

    def ledger_bytes() -> int:
        """Live memory allocated by the traffic ledger and the metrics collector (not the fake kernel)."""
        snapshot = tracemalloc.take_snapshot().filter_traces([
            tracemalloc.Filter(True, "*/podmeter/model/traffic.py"),
            tracemalloc.Filter(True, "*/podmeter/adapters/metrics/pod_traffic.py"),
        ])
        return sum(stat.size for stat in snapshot.statistics("filename"))

    round_of_pods(0)  # warm up: interned strings, dict tables at their steady size
    tracemalloc.start()
    round_of_pods(1000)
    before = ledger_bytes()
    round_of_pods(2000)
    after = ledger_bytes()
    tracemalloc.stop()
    text = PodTrafficExposition(agent.ledger, datapath.read_counters).render().decode()
    assert "podmeter_pod_bytes_total{" not in text
    assert not agent.ledger.series and not agent.ledger.owners
    assert datapath.counters == {} and datapath.entries == set()
    assert 'podmeter_node_packets_total{direction="egress"} 6000' in text
    assert after <= before + 1024, f"the ledger grew from {before} to {after} bytes"


def test_an_ip_changing_hands_reads_its_own_counters_not_the_whole_map() -> None:
    """The ledger's base for a new owner is the kernel's count of the IPs that moved, read key by key
    (``Datapath.read_counters_of``); the whole counters map is read at scrapes only."""
    from collections.abc import Iterable

    from podmeter.adapters.datapath.memory import MemoryDatapath
    from podmeter.model.datapath import Traffic

    class Reads(MemoryDatapath):
        whole = 0
        narrow: list[set[str]] = []

        def read_counters(self) -> dict[tuple[str, Direction], Traffic]:
            Reads.whole += 1
            return super().read_counters()

        def read_counters_of(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
            ips = list(ips)
            Reads.narrow.append(set(ips))
            return super().read_counters_of(ips)

    datapath = Reads(64)
    agent = Agent(AgentSettings(node_name="node-a"), connection=None, datapath=datapath)  # type: ignore[arg-type]
    pods = [make_pod(f"p{i}", ips=(f"10.6.0.{i}",), observe=True) for i in range(1, 21)]
    agent.apply_batch([Replace(PODS, pods), Replace(NAMESPACES, []), Replace(CONFIGURATIONS, [])])
    for pod in pods:
        datapath.count(pod.ips[0], OUT, 3, 300)
    Reads.narrow.clear()
    late = make_pod("late", ips=("10.6.0.1",), observe=True)  # p1's delete is late: the IP changes hands
    agent.apply_batch([Upsert(PODS, late)])
    assert Reads.narrow == [{"10.6.0.1"}] and Reads.whole == 0
    assert datapath.read_counters_of(["10.6.0.1", "10.9.9.9"]) == {("10.6.0.1", OUT): Traffic(3, 300)}
    assert agent.ledger.owners["10.6.0.1"].uid == late.uid
