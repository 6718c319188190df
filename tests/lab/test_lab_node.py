"""The lab node: its IP pool, and `podmeter node --datapath memory` against the lab API server."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from lab_server import LabServer
from podmeter.lab.kube import KubeClient, pod_path
from podmeter.lab.node import RUN_SECONDS_ANNOTATION, IpPool, Node, NodeSettings, PoolExhausted


def test_the_pool_hands_out_the_lowest_free_ip_so_freed_ips_come_back_first() -> None:
    pool = IpPool("10.9.0.0/29")
    assert pool.size == 6
    first = [pool.allocate() for _ in range(3)]
    assert first == ["10.9.0.1", "10.9.0.2", "10.9.0.3"]
    pool.release("10.9.0.2")
    assert pool.allocate() == "10.9.0.2"
    assert pool.claim("10.9.0.5") and not pool.claim("10.9.0.5")
    assert [pool.allocate() for _ in range(2)] == ["10.9.0.4", "10.9.0.6"]
    with pytest.raises(PoolExhausted, match="all 6 pod IPs are in use"):
        pool.allocate()
    pool.release("10.9.0.9")  # never handed out: ignored
    assert pool.used == 6


@pytest.mark.parametrize("cidr", ["10.0.0.0/31", "fd00::/120", "banana"])
def test_unusable_cidrs_are_refused(cidr: str) -> None:
    with pytest.raises(ValueError):
        IpPool(cidr)


def _pod(name: str, node: str, annotations: dict[str, str] | None = None, host: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"nodeName": node, "hostNetwork": host, "containers": [{"name": "c", "image": "i"}]}}


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_memory_node_runs_pods_completes_jobs_and_reuses_ips(lab_apiserver: LabServer) -> None:
    client = KubeClient(lab_apiserver.url, lab_apiserver.token, None)
    node = Node(NodeSettings("n1", "10.9.0.0/29", datapath="memory", watch_timeout=5), client)
    worker = threading.Thread(target=node.run, daemon=True)
    worker.start()
    try:
        client.create(pod_path("default"), _pod("a", "n1"))
        client.create(pod_path("default"), _pod("job", "n1", {RUN_SECONDS_ANNOTATION: "0.3"}))
        client.create(pod_path("default"), _pod("host", "n1", host=True))
        client.create(pod_path("default"), _pod("elsewhere", "n2"))

        def status(name: str) -> dict[str, Any]:
            return (client.get(pod_path("default", name)) or {}).get("status", {})

        _wait(lambda: status("a").get("phase") == "Running" and status("job").get("phase") == "Succeeded")
        assert status("a")["podIP"] == "10.9.0.1" and status("a")["podIPs"] == [{"ip": "10.9.0.1"}]
        assert status("job")["podIP"] == "10.9.0.2"  # a finished pod keeps its IP in status...
        _wait(lambda: status("host").get("phase") == "Running")
        assert status("host")["podIP"] == "192.168.255.1"
        assert status("elsewhere").get("phase") == "Pending"  # another node's pod is not ours
        client.create(pod_path("default"), _pod("b", "n1"))
        _wait(lambda: status("b").get("phase") == "Running")
        assert status("b")["podIP"] == "10.9.0.2"  # ...but the IP is free again: reused at once
        client.delete(pod_path("default", "a"))
        _wait(lambda: "10.9.0.1" not in {r.ip for r in node.running.values()})
        assert node.pool.used == 1
    finally:
        node.stop()
        worker.join(timeout=10)
    assert node.running == {} and node.pool.used == 0


def test_oldest_reuse_hands_out_every_other_ip_before_a_freed_one_returns() -> None:
    pool = IpPool("10.9.0.0/29", reuse="oldest")
    assert pool.allocate() == "10.9.0.1"
    pool.release("10.9.0.1")
    assert [pool.allocate() for _ in range(6)] == [f"10.9.0.{i}" for i in (2, 3, 4, 5, 6, 1)]
    with pytest.raises(ValueError, match="lowest or oldest"):
        IpPool("10.9.0.0/29", reuse="random")


def test_a_stale_running_event_never_revives_a_pod_the_node_finished() -> None:
    node = Node(NodeSettings("n1", "10.9.0.0/29", datapath="memory"), client=None)  # type: ignore[arg-type]
    meta = {"uid": "u1", "name": "p", "namespace": "d"}
    with node._lock:
        node._handle({"metadata": meta, "spec": {}, "status": {"phase": "Pending"}}, deleted=False)
        assert node.running["u1"].ip == "10.9.0.1"
        node._handle({"metadata": meta, "status": {"phase": "Succeeded", "podIP": "10.9.0.1"}}, deleted=False)
        assert "u1" not in node.running
        # The Running event of its own status write, delivered late: the pod stays finished.
        node._handle({"metadata": meta, "status": {"phase": "Running", "podIP": "10.9.0.1"}}, deleted=False)
        assert "u1" not in node.running and node.stats.started == 1
