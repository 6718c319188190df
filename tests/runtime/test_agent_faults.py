"""The agent under the API server's faults (F7, F8, F17, F18 of docs/design.md): watch closes, compaction gaps,
an API server that goes away, stalled streams, bad objects on the wire."""

from __future__ import annotations

import time

from agent_harness import AgentHarness, Cluster, wait_for
from lab_server import LabServer
from podmeter.adapters.kube.backoff import Backoff
from podmeter.adapters.kube.reflector import ReflectorSettings
from podmeter.adapters.kube.resources import ResourceKind


def populated(server: LabServer, n: int = 5) -> Cluster:
    cluster = Cluster(server)
    cluster.namespace("shop", observe=True)
    for i in range(n):
        cluster.pod("shop", f"web-{i}", f"10.2.0.{i + 1}")
    return cluster


def test_watch_closed_many_times_changes_nothing(lab_apiserver: LabServer) -> None:
    populated(lab_apiserver)
    expected = {f"10.2.0.{i + 1}" for i in range(5)}
    with AgentHarness(lab_apiserver) as agent:
        agent.wait_filter(expected)
        before = agent.state()
        calls = agent.on_loop(lambda: agent.datapath.calls)  # type: ignore[attr-defined]
        for _ in range(25):
            wait_for(lambda: lab_apiserver.admin.open_watches() >= 3, what="the agent's watches open")
            lab_apiserver.admin.close_watches()
        wait_for(lambda: lab_apiserver.admin.open_watches() >= 3, what="watches reopened")
        after = agent.state()
        assert agent.filter() == expected
        assert after["pods"] == before["pods"] == 5
        assert sorted(after["filter"]["desired"]) == sorted(before["filter"]["desired"])
        for name, reflector in after["reflectors"].items():
            assert reflector["relists"] == {"initial": 1}, name  # EOF means re-watch, never relist
        assert after["drift_repaired"] == {}
        assert agent.on_loop(lambda: agent.datapath.calls) == calls  # type: ignore[attr-defined]


def test_deletes_while_disconnected_and_compaction_relist(lab_apiserver: LabServer) -> None:
    cluster = populated(lab_apiserver)
    with AgentHarness(lab_apiserver) as agent:
        agent.wait_filter({f"10.2.0.{i + 1}" for i in range(5)})
        lab_apiserver.admin.stall()  # the agent's streams go silent: it misses what follows
        cluster.delete_pod("shop", "web-0")
        cluster.delete_pod("shop", "web-1")
        cluster.pod("shop", "late", "10.2.0.99")
        lab_apiserver.admin.compact()  # the history of those events is gone
        lab_apiserver.admin.unstall()
        lab_apiserver.admin.close_watches()  # re-watch from the old RV -> 410 -> relist
        agent.wait_filter({"10.2.0.3", "10.2.0.4", "10.2.0.5", "10.2.0.99"})
        relists = agent.state()["reflectors"]["pods"]["relists"]
        assert relists.get("expired", 0) >= 1
        assert agent.state()["drift_repaired"] == {}


def test_api_server_down_30s_agent_keeps_state_and_reconnects(lab_apiserver: LabServer) -> None:
    cluster = populated(lab_apiserver, 3)
    expected = {"10.2.0.1", "10.2.0.2", "10.2.0.3"}

    def slow_backoff(kind: ResourceKind) -> ReflectorSettings:
        return ReflectorSettings(watch_timeout=(20.0, 30.0), inactivity_grace=5.0, request_timeout=5.0,
                                 backoff=Backoff(initial=0.8, cap=8.0))

    with AgentHarness(lab_apiserver, reflector=slow_backoff) as agent:
        agent.wait_filter(expected)
        lab_apiserver.admin.reset_requests()
        lab_apiserver.admin.restart(down_seconds=30)
        time.sleep(15)
        assert agent.filter() == expected  # keeps serving the last good state while the server is away
        assert agent.on_loop(agent.agent.ready.is_set)
        wait_for(lambda: _open_watches(lab_apiserver) >= 3, timeout=40, what="reconnected")
        cluster.delete_pod("shop", "web-0")
        agent.wait_filter({"10.2.0.2", "10.2.0.3"})
        failures = agent.state()["reflectors"]["pods"]["failures"]
        attempts = sum(failures.values())
        # backoff 0.8 s doubling to 8 s over ~30 s: about 7 attempts per reflector, never a hot loop
        assert 2 <= attempts <= 15, failures
        assert lab_apiserver.admin.count("watch") + lab_apiserver.admin.count("list") <= 3 * 6


def _open_watches(server: LabServer) -> int:
    try:
        return server.admin.open_watches()
    except OSError:  # the server is still down
        return 0


def test_stalled_stream_is_detected_and_rewatched(lab_apiserver: LabServer) -> None:
    cluster = populated(lab_apiserver, 1)

    def short_deadline(kind: ResourceKind) -> ReflectorSettings:
        # The server ends a stream at timeoutSeconds even when stalled; a blackholed connection would
        # not. A deadline shorter than the timeout makes the test see what a dead connection causes.
        return ReflectorSettings(watch_timeout=(30.0, 31.0), inactivity_deadline=1.5, request_timeout=5.0,
                                 backoff=Backoff(initial=0.1, cap=0.5))

    with AgentHarness(lab_apiserver, reflector=short_deadline) as agent:
        agent.wait_filter({"10.2.0.1"})
        lab_apiserver.admin.stall(include_new=False)  # open streams send nothing, not even their end
        wait_for(lambda: agent.state()["reflectors"]["pods"]["failures"].get("StreamStalled", 0) >= 1,
                 timeout=10, what="stall detected")
        cluster.pod("shop", "after", "10.2.0.50")  # only a new watch can see this
        agent.wait_filter({"10.2.0.1", "10.2.0.50"})
        assert agent.state()["reflectors"]["pods"]["relists"] == {"initial": 1}


def test_bad_objects_in_the_stream_are_skipped_and_counted(lab_apiserver: LabServer) -> None:
    cluster = populated(lab_apiserver, 2)
    with AgentHarness(lab_apiserver) as agent:
        agent.wait_filter({"10.2.0.1", "10.2.0.2"})
        good = lab_apiserver.request("GET", "/api/v1/namespaces/shop/pods/web-0")[2]
        bad_ip = _variant(good, "bad-ip", status={"phase": "Running", "podIP": "10.2.0.300"})
        bad_types = _variant(good, "bad-types", spec={"nodeName": "node-a", "hostNetwork": "yes"})
        huge = _variant(good, "huge", annotations={"podmeter.io/observe": "x" * (1 << 20)})
        for obj in (bad_ip, bad_types, huge):
            lab_apiserver.admin.inject("pods", obj)
        lab_apiserver.admin.inject_line("pods", "{this is not json")
        # a bad new state of a known pod: its last good state stays
        lab_apiserver.admin.inject("pods", {**good, "status": {"phase": "Running", "podIP": "nope"}})
        wait_for(lambda: agent.state()["reflectors"]["pods"]["decode_errors"] >= 5, what="bad objects counted")
        cluster.pod("shop", "fine", "10.2.0.3")
        agent.wait_filter({"10.2.0.1", "10.2.0.2", "10.2.0.3"})
        assert agent.state()["pods"] == 3


def _variant(pod: dict, name: str, **changes: dict) -> dict:  # type: ignore[type-arg]
    meta = {**pod["metadata"], "name": name, "uid": f"uid-{name}"}
    if "annotations" in changes:
        meta["annotations"] = changes.pop("annotations")
    return {**pod, "metadata": meta, **changes}
