"""The agent's real ``/metrics`` in each ``--retina-compat`` mode, linted by Debian's ``promtool check metrics``.

The agent runs in-process as the command runs it (``podmeter.runtime.agent_process.AgentProcess``, built
from the settings the command line parses: the same HTTP app, renderers and flow drain as ``podmeter
agent``) on the in-memory datapath, whose counters and flows are filled on the agent's loop exactly as the
kernel program fills them; drops come from a drop source in memory (:class:`MemoryDrops`) filled the way the
kernel's drop program fills its maps. ``AgentProcess.serve`` installs its SIGTERM handler, which needs the
main thread: the agent runs there and the test's steps in a thread.

promtool's findings are exact: none without ``--retina-compat``, and with it only the four that Retina's
own names cause (docs/metrics.md, "Retina names").
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import Cluster
from lab_server import LabServer
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.kube.connection import load_connection
from podmeter.cli.agent import settings_from
from podmeter.cli.main import build_parser
from podmeter.model.datapath import Direction
from podmeter.model.drops import HOOKS, DropDrain, DropFlowKey, DropKey
from podmeter.model.flows import TCP, UDP, FlowCounts, FlowKey, Observation
from podmeter.runtime.agent_process import AgentProcess
from podmeter.runtime.datapaths import OpenDatapath
from podmeter.runtime.drop_drain import DropTracing
from waiting import free_port, wait_for
from waiting import http_get as get

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
needs_promtool = pytest.mark.skipif(not os.path.exists(PROMTOOL), reason="promtool (Debian's prometheus) missing")
pytestmark = needs_promtool

RETINA_FINDINGS = {  # what promtool says of Retina's own names, word for word (docs/metrics.md)
    'networkobservability_adv_forward_bytes counter metrics should have "_total" suffix',
    'networkobservability_adv_forward_count counter metrics should have "_total" suffix',
    'networkobservability_adv_forward_count non-histogram and non-summary metrics should not have "_count" suffix',
    'networkobservability_adv_drop_count non-histogram and non-summary metrics should not have "_count" suffix',
    'networkobservability_forward_count non-histogram and non-summary metrics should not have "_count" suffix',
    'networkobservability_drop_count non-histogram and non-summary metrics should not have "_count" suffix',
}
WEB, DB, WORLD = "10.4.0.1", "10.4.0.2", "203.0.113.9"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
SAMPLE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class MemoryDrops:
    """A drop source in memory, filled as the kernel's drop program fills its maps: per observed address,
    direction and reason (packets and bytes), and per dropped flow; a drain takes everything."""

    def __init__(self) -> None:
        self.pending = DropDrain()

    @property
    def hooks(self) -> Mapping[str, bool]:
        return dict.fromkeys(HOOKS, True)

    def drop(self, source: str, destination: str, observed: tuple[bool, bool], reason: str, packets: int,
             size: int) -> None:
        """``packets`` TCP packets of ``size`` bytes in all from ``source`` to ``destination`` dropped."""
        for ip, direction, seen in ((source, Direction.EGRESS, observed[0]),
                                    (destination, Direction.INGRESS, observed[1])):
            if seen:
                self.pending.drops.append((DropKey(ip, direction, reason), packets))
                self.pending.drop_bytes.append((DropKey(ip, direction, reason), size))
        key = DropFlowKey(source, destination, 40000, 5432, TCP, *observed, reason)
        self.pending.flows.append((key, FlowCounts(packets, size, 1_000_000_000, 1_000_000_000, 0b10)))

    def drain_drops(self) -> DropDrain:
        taken, self.pending = self.pending, DropDrain()
        return taken

    def drops_lost(self) -> Mapping[str, int]:
        return {}


def promtool(exposition: str) -> tuple[int, set[str]]:
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True,
                          timeout=30)
    findings = {line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()}
    return done.returncode, findings


def samples(exposition: str, prefix: str = "networkobservability_") -> Samples:
    """Samples by the names the exposition writes (prometheus_client's parser would add ``_total`` to a
    counter's samples, which is exactly what must not happen to Retina's names). The whole text must parse."""
    assert list(text_string_to_metric_families(exposition))
    out: Samples = {}
    for line in exposition.splitlines():
        if line.startswith(prefix):
            found = SAMPLE.fullmatch(line)
            assert found, line
            labels = frozenset((k, v.replace('\\"', '"')) for k, v in LABEL.findall(found["labels"] or ""))
            out[(found["name"], labels)] = float(found["value"])
    return out


def types(exposition: str) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in exposition.splitlines() if line.startswith("# TYPE ")}


class RunningAgent:
    """``podmeter agent --datapath memory`` with ``flags``, its loop and datapath reachable from the test."""

    def __init__(self, server: LabServer, flags: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = build_parser("agent").parse_args(
            ["agent", "--node-name", "node-a", "--datapath", "memory", "--listen", f"127.0.0.1:{self.port}",
             "--kubeconfig", str(server.kubeconfig), "--flow-interval", "0.1", "--metrics-min-interval", "0",
             "--drop-map-size", "0", *flags])
        self.memory = MemoryDatapath(1024, flow_capacity=1024)
        self.drops = MemoryDrops()
        self.loop = asyncio.new_event_loop()
        self.cluster = Cluster(server)

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def metrics(self) -> str:
        status, text = get(self.url + "/metrics")
        assert status == 200
        return str(text)

    def run(self, steps: Callable[[RunningAgent], None]) -> None:
        """Serve in this (the main) thread while ``steps`` run in another; SIGTERM ends the agent as it
        would end the process, and a failure of ``steps`` is raised here."""
        failure: list[BaseException] = []
        task: list[asyncio.Task[int]] = []

        def drive() -> None:
            try:
                wait_for(lambda: _ready(self.url), timeout=20, what="/readyz")
            except BaseException as exc:
                failure.append(exc)
                self.loop.call_soon_threadsafe(task[0].cancel)  # no SIGTERM handler yet, perhaps
                return
            try:
                steps(self)
            except BaseException as exc:
                failure.append(exc)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent's own handler: stop, as for the process

        opened = OpenDatapath(self.memory, self.memory, drops=DropTracing(self.drops))
        settings = settings_from(self.args)

        async def serve() -> int:
            return await AgentProcess(settings, load_connection(settings.kubeconfig), opened).serve()

        main = self.loop.create_task(serve())
        task.append(main)
        thread = threading.Thread(target=drive, daemon=True)
        thread.start()
        try:
            code = self.loop.run_until_complete(main)
        except asyncio.CancelledError:
            code = None
        finally:
            thread.join(30)
            self.loop.close()
        if failure:
            raise failure[0]
        assert code == 0


def _ready(url: str) -> bool:
    try:
        return get(url + "/readyz")[0] == 200
    except OSError:
        return False


def two_pods_and_traffic(agent: RunningAgent) -> None:
    """Pods web and db of node-a; web sends db 3 datagrams (seen leaving web and entering db) and the
    world 2; the per-pod counters as the kernel counts the same packets; and drops (below)."""
    agent.cluster.namespace("shop", observe=True)
    agent.cluster.pod("shop", "web", WEB)
    agent.cluster.pod("shop", "db", DB)
    wait_for(lambda: {WEB, DB} <= set(json.loads(get(agent.url + "/debug/state")[1])["filter"]["actual"]),
             what="both IPs in the filter")

    def inject() -> None:
        now = 1_000_000_000
        for source, destination, observation, packets in ((WEB, DB, Observation.FROM_POD, 3),
                                                           (WEB, DB, Observation.TO_POD, 3),
                                                           (WEB, WORLD, Observation.FROM_POD, 2)):
            key = FlowKey(source, destination, 40000, 53, UDP, observation)
            assert agent.memory.record_flow(key, packets, packets * 100, now)
        agent.memory.count(WEB, Direction.EGRESS, 5, 500)
        agent.memory.count(DB, Direction.INGRESS, 3, 300)
        # netfilter drops 2 of web's segments to db (both ends observed: one dropped flow), and the world's
        # one segment to web finds no socket
        agent.drops.drop(WEB, DB, (True, True), "NETFILTER_DROP", 2, 120)
        agent.drops.drop(WORLD, WEB, (False, True), "NO_SOCKET", 1, 60)

    agent.on_loop(inject)


@pytest.fixture
def lab(lab_apiserver: LabServer) -> Iterator[LabServer]:
    yield lab_apiserver


def test_default_mode_is_promtool_clean_and_has_no_retina_series(lab: LabServer) -> None:
    def steps(agent: RunningAgent) -> None:
        two_pods_and_traffic(agent)
        wait_for(lambda: "podmeter_workload_flow_packets_total{" in agent.metrics(), what="flow series")
        text = agent.metrics()
        assert 'podmeter_pod_packets_total{namespace="shop",pod="web",direction="egress"' in text
        assert "networkobservability_" not in text
        assert promtool(text) == (0, set())

    RunningAgent(lab, []).run(steps)


def test_local_mode_has_retina_counters_with_unknown_and_only_the_documented_findings(lab: LabServer) -> None:
    def steps(agent: RunningAgent) -> None:
        two_pods_and_traffic(agent)
        text = agent.metrics()
        assert types(text)["networkobservability_adv_forward_count"] == "counter"
        assert types(text)["networkobservability_adv_forward_bytes"] == "counter"
        web = frozenset({"direction": "egress", "ip": WEB, "namespace": "shop", "podname": "web",
                         "workload_kind": "unknown", "workload_name": "unknown"}.items())  # a bare pod
        found = samples(text)
        assert found[("networkobservability_adv_forward_count", web)] == 5
        assert found[("networkobservability_adv_forward_bytes", web)] == 500
        assert not any("source_podname" in dict(labels) for _, labels in found)  # never both contexts
        wait_for(lambda: "networkobservability_adv_drop_count{" in agent.metrics(), what="drop series")
        text = agent.metrics()
        assert types(text)["networkobservability_adv_drop_count"] == "gauge"  # as Retina's exporter has them
        assert types(text)["networkobservability_adv_drop_bytes"] == "gauge"

        def pod(direction: str, ip: str, name: str, reason: str) -> frozenset[tuple[str, str]]:
            return frozenset({"direction": direction, "ip": ip, "namespace": "shop", "podname": name,
                              "reason": reason, "workload_kind": "unknown", "workload_name": "unknown"}.items())

        found = samples(text)
        dropped = {labels: (value, found[("networkobservability_adv_drop_bytes", labels)])
                   for (name, labels), value in found.items() if name == "networkobservability_adv_drop_count"}
        assert dropped == {pod("egress", WEB, "web", "IPTABLE_RULE_DROP"): (2, 120),  # Retina's name: exact
                           pod("ingress", DB, "db", "IPTABLE_RULE_DROP"): (2, 120),
                           pod("ingress", WEB, "web", "NO_SOCKET"): (1, 60)}  # the kernel's: Retina has none
        code, findings = promtool(text)
        assert (code, findings) == (3, RETINA_FINDINGS)
        agent.cluster.delete_pod("shop", "web")
        wait_for(lambda: WEB not in json.loads(get(agent.url + "/debug/state")[1])["filter"]["actual"],
                 what="web's IP out of the filter")
        # Within the grace period the pod holds no IP, yet its series keeps its labels (no new series).
        assert samples(agent.metrics())[("networkobservability_adv_forward_count", web)] == 5
        assert samples(agent.metrics())[("networkobservability_adv_drop_count", pod("egress", WEB, "web",
                                                                                    "IPTABLE_RULE_DROP"))] == 2

    RunningAgent(lab, ["--retina-compat"]).run(steps)


def test_remote_mode_has_the_series_retinas_pod_level_dashboards_query(lab: LabServer) -> None:
    def steps(agent: RunningAgent) -> None:
        before = agent.metrics()
        assert promtool(before) == (0, set())  # no flows yet: the families have no samples to lint
        two_pods_and_traffic(agent)
        wait_for(lambda: "networkobservability_adv_forward_count{" in agent.metrics(), what="remote series")
        text = agent.metrics()
        assert types(text)["networkobservability_adv_forward_count"] == "counter"

        def end(prefix: str, ip: str, pod: str | None) -> dict[str, str]:
            values = (ip, "shop", pod, "unknown", "unknown") if pod else (ip, *["unknown"] * 4)
            names = ("ip", "namespace", "podname", "workload_kind", "workload_name")
            return {f"{prefix}_{name}": value for name, value in zip(names, values, strict=True)}

        web_db = {**end("source", WEB, "web"), **end("destination", DB, "db")}
        expected = {
            frozenset({"direction": "EGRESS", **web_db}.items()): 3,
            frozenset({"direction": "INGRESS", **web_db}.items()): 3,
            frozenset({"direction": "EGRESS", **end("source", WEB, "web"), **end("destination", WORLD, None)}
                      .items()): 2,
        }
        found = samples(text)
        assert {labels: value for (name, labels), value in found.items()
                if name == "networkobservability_adv_forward_count"} == expected
        assert found[("networkobservability_adv_forward_bytes", next(iter(expected)))] == 300
        assert not any("podname" in dict(labels) for _, labels in found)  # no local-context series
        assert samples(text, "podmeter_retina_")[("podmeter_retina_flow_series", frozenset())] == 3
        # The dashboards' panels: pod-to-pod traffic, and traffic to addresses no pod holds.
        to_pods = [labels for (name, labels), _ in found.items() if name == "networkobservability_adv_forward_count"
                   and dict(labels)["source_podname"] != "unknown" and dict(labels)["destination_podname"] != "unknown"]
        assert len(to_pods) == 2
        wait_for(lambda: "networkobservability_adv_drop_count{" in agent.metrics(), what="remote drop series")
        text = agent.metrics()
        assert types(text)["networkobservability_adv_drop_count"] == "gauge"
        found = samples(text)
        dropped = {labels: (value, found[("networkobservability_adv_drop_bytes", labels)])
                   for (name, labels), value in found.items() if name == "networkobservability_adv_drop_count"}
        # One dropped flow record, one series, seen where it was dropped: leaving web, and entering web.
        assert dropped == {
            frozenset({"direction": "EGRESS", "reason": "IPTABLE_RULE_DROP", **web_db}.items()): (2, 120),
            frozenset({"direction": "INGRESS", "reason": "NO_SOCKET", **end("source", WORLD, None),
                       **end("destination", WEB, "web")}.items()): (1, 60)}
        # The dashboard's drop panel: drops between pods by source pod.
        assert [dict(labels)["source_podname"] for labels in dropped
                if dict(labels)["source_podname"] != "unknown" and dict(labels)["destination_podname"] != "unknown"
                ] == ["web"]
        assert samples(text, "podmeter_retina_")[("podmeter_retina_drop_series", frozenset())] == 2
        code, findings = promtool(text)
        assert (code, findings) == (3, RETINA_FINDINGS)

    RunningAgent(lab, ["--retina-compat=remote"]).run(steps)


@pytest.mark.parametrize("context", ["local", "remote"])
def test_the_node_level_series_are_the_node_totals_in_either_context(lab: LabServer, context: str) -> None:
    def steps(agent: RunningAgent) -> None:
        before = samples(agent.metrics())
        resets = frozenset({"statistic_name": "resetcount"}.items())
        assert before[("networkobservability_tcp_connection_stats", resets)] == 0  # exists before the first RST
        assert before[("networkobservability_tcp_flag_counters", frozenset({"flag": "rst"}.items()))] == 0
        two_pods_and_traffic(agent)
        wait_for(lambda: "networkobservability_drop_count{" in agent.metrics(), what="node drop series")
        text = agent.metrics()
        assert {name: types(text)[name] for name in ("networkobservability_forward_count",
                                                      "networkobservability_drop_bytes")} == {
            "networkobservability_forward_count": "gauge", "networkobservability_drop_bytes": "gauge"}
        found = samples(text)

        def node(name: str, **labels: str) -> float:
            return found[(name, frozenset(labels.items()))]

        # web sent 5 packets (500 bytes), db received 3: the per-pod counters' node totals
        assert node("networkobservability_forward_count", direction="egress") == 5
        assert node("networkobservability_forward_bytes", direction="ingress") == 300
        dropped = {(dict(labels)["reason"], dict(labels)["direction"]): (value, node(
            "networkobservability_drop_bytes", **dict(labels)))
            for (name, labels), value in found.items() if name == "networkobservability_drop_count"}
        assert dropped == {("IPTABLE_RULE_DROP", "egress"): (2, 120), ("IPTABLE_RULE_DROP", "ingress"): (2, 120),
                           ("NO_SOCKET", "ingress"): (1, 60)}
        # The node's own stack, read from this machine's /proc/net: the agent's TCP listener is open, and
        # resetcount shares its family with the kernel's TcpExt counters (one HELP and TYPE).
        assert node("networkobservability_tcp_state", state="LISTEN") >= 1
        assert node("networkobservability_tcp_connection_stats", statistic_name="tcptimeouts") >= 0
        assert node("networkobservability_udp_connection_stats", statistic_name="active") >= 0
        assert text.count("# TYPE networkobservability_tcp_connection_stats gauge") == 1
        assert {types(text)[name] for name in ("networkobservability_tcp_state",
                                               "networkobservability_tcp_connection_remote",
                                               "networkobservability_interface_stats")} == {"gauge"}
        errors = samples(text, "podmeter_node_stats_errors_total")
        assert len(errors) == 12 and not any(errors.values()), errors  # every file read, every line parsed
        assert promtool(text) == (3, RETINA_FINDINGS)

    RunningAgent(lab, [f"--retina-compat={context}"]).run(steps)


def test_the_old_boolean_environment_value_still_means_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PODMETER_RETINA_COMPAT", "true")
    assert build_parser("agent").parse_args(["agent", "--node-name", "n"]).retina_compat == "local"
    monkeypatch.setenv("PODMETER_RETINA_COMPAT", "off")
    assert build_parser("agent").parse_args(["agent", "--node-name", "n"]).retina_compat is None
    monkeypatch.delenv("PODMETER_RETINA_COMPAT")
    args = build_parser("agent").parse_args(["agent", "--node-name", "n", "--retina-compat", "remote"])
    assert args.retina_compat == "remote"
