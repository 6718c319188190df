"""Probes that found weaknesses, each a test that failed on the code before its fix.

* a zone-scoped IPv6 ``podIP`` (accepted by the decoder, not encodable by the datapath) stopped the writer:
  now the pod is treated as having no such address, it is counted, and later pods are applied;
* valid objects dropped by decoder limits (257 labels, 300 labels and 65 owner references, a long observe
  annotation): they now decode, are observed and get an identity;
* an unexpected error killed a task silently with ``/healthz`` 200: now it is logged, counted, ``/healthz``
  answers 503 and the agent command exits non-zero;
* a missing CRD (a real API server answers a plain-text 404) left the agent unready forever and was
  reported as a 500: now it is an empty collection (a degraded mode) and reported as the 404 it is;
* a forged Lease with a huge ``leaseDurationSeconds`` stopped leadership indefinitely: now the
  candidate's own lease duration decides;
* the eBPF attach worker (a thread) dying after start-up left ``/healthz`` at 200 and attached nothing
  more: now the agent supervises it like its tasks (counted as task ``attach``, unhealthy, exits non-zero).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from agent_harness import AgentHarness, Cluster
from bpf_support import Topology, needs_root
from core_harness import Core
from factories import namespace_json, pod_json
from lab_server import LabServer, lab_apiserver
from mock_transport import MockAnswer, MockTransport
from podmeter.adapters.datapath.ebpf import AttachManager, EbpfDatapath
from podmeter.adapters.datapath.ebpf import attach as attach_module
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.http import build_app, serve
from podmeter.adapters.kube.lease import MemoryLeaseStore
from podmeter.adapters.kube.reflector import Reflector, ReflectorSettings
from podmeter.adapters.kube.resources import METRICS_CONFIGURATIONS
from podmeter.model.deltas import Delta, Replace
from podmeter.model.identity import LabelFilter, key_of_flat
from podmeter.model.lease import LeaseRecord
from podmeter.model.records import decode_namespace, decode_pod
from podmeter.runtime.leadership import LeaderElector
from podmeter.runtime.supervision import Supervisor
from waiting import wait_for

__all__ = ["lab_apiserver"]


# --- a zone-scoped IPv6 address ------------------------------------------------------------------------


def test_a_zone_scoped_address_is_no_address_of_the_pod_and_is_counted() -> None:
    raw = pod_json("odd", ips=("fe80::1%eth0",), observe=True)
    odd = decode_pod(json.dumps(raw).encode())
    assert odd.ips == () and odd.unusable_ips == ("fe80::1%eth0",)
    dual = decode_pod(json.dumps(pod_json("dual", ips=("10.0.0.1", "fe80::2%eth0"), observe=True)).encode())
    assert dual.ips == ("10.0.0.1",)
    core = Core(MemoryDatapath())
    core.upsert_pod(odd)
    core.upsert_pod(dual)
    core.flush()
    assert core.datapath.contents() == {"10.0.0.1"}  # type: ignore[attr-defined]


def test_the_agent_keeps_applying_pods_after_a_zone_scoped_one(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop", observe=True)
    with AgentHarness(lab_apiserver) as harness:
        # A real API server refuses such an address (as the lab's does: below); the agent must survive it
        # anyway, so it is put in the store behind the validation.
        lab_apiserver.admin.inject("pods", pod_json("odd", "shop", ips=("fe80::1%eth0",)))
        cluster.pod("shop", "web", "10.3.0.7")
        harness.wait_filter({"10.3.0.7"})
        assert harness.on_loop(harness.agent.snapshot).unusable_pod_ips == 1
        assert harness.agent.supervisor.healthy


# --- everything Kubernetes accepts decodes ---------------------------------------------------------------


def test_objects_with_many_labels_and_owner_references_decode_and_count() -> None:
    ns = namespace_json("big", observe=True)
    ns["metadata"]["labels"] = {f"l{i}": "v" for i in range(257)}
    assert decode_namespace(json.dumps(ns).encode()).observe
    raw = pod_json("many", "big", ips=("10.0.9.9",), labels={f"k{i}": str(i) for i in range(300)})
    raw["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": f"o{i}", "uid": f"u{i}"} for i in range(64)
    ] + [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "many-5d9f7", "uid": "rs", "controller": True}]
    raw["metadata"]["annotations"] = {"podmeter.io/observe": "true", "note": "x" * 70_000}
    pod = decode_pod(json.dumps(raw).encode())
    assert len(pod.labels) == 600 and pod.owner_kind == "ReplicaSet" and pod.observe
    key = key_of_flat(pod.namespace, pod.labels, LabelFilter())
    assert len(key.label_dict()) == 300  # the operator gives it an identity like any other pod
    long_value = pod_json("long", ips=("10.0.9.8",))
    long_value["metadata"]["annotations"] = {"podmeter.io/observe": "t" * 100}
    assert decode_pod(json.dumps(long_value).encode()).observe is False  # decoded: not "true", not lost


# --- supervision -----------------------------------------------------------------------------------------


async def test_a_task_that_dies_is_logged_counted_and_makes_healthz_unhealthy() -> None:
    supervisor = Supervisor()

    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("an unexpected bug")

    supervisor.spawn(broken(), "writer")
    app = build_app(CollectorRegistry(), lambda: True, {}, healthy=lambda: supervisor.healthy)
    runner, port = await serve(app, "127.0.0.1:0")
    try:
        await asyncio.wait_for(supervisor.failed.wait(), 5)
        assert supervisor.failures == {"writer": 1}
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as r:
            assert r.status == 503
    finally:
        await runner.cleanup()
        await supervisor.cancel_all()


def test_the_agent_process_exits_non_zero_when_its_writer_dies(lab_apiserver: LabServer, tmp_path: Any) -> None:
    """A pod with a hostile name cannot break the writer any more; to show the supervision itself, the
    test makes the writer raise through a fault planted in the process (as the lab's faulty agent)."""
    script = (
        "import sys, runpy\n"
        "from podmeter.runtime import agent as a\n"
        "def boom(self, items): raise RuntimeError('planted')\n"
        "a.Agent.apply_batch = boom\n"
        "sys.argv = ['podmeter'] + sys.argv[1:]\n"
        "runpy.run_module('podmeter', run_name='__main__')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, "agent", "--kubeconfig", str(lab_apiserver.kubeconfig),
                             "--node-name", "n", "--datapath", "memory", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 1
    assert b"task writer died: RuntimeError: planted" in out and b"Traceback" in out


@needs_root
def test_an_attach_worker_that_dies_after_start_up_makes_the_agent_unhealthy(
        lab_apiserver: LabServer, topology: Topology, open_datapath: Callable[..., EbpfDatapath],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real attach manager and its thread: its first pass succeeds, a later one (the periodic dump)
    meets an error nothing in the worker handles."""
    datapath = open_datapath(64)
    assert datapath.programs is not None
    pod = topology.add_pod()
    broken = [False]
    read_links = attach_module.read_links

    def read_links_or_fail() -> Any:
        if broken[0]:
            raise OSError("planted: the netlink dump failed")
        return read_links()

    monkeypatch.setattr(attach_module, "read_links", read_links_or_fail)
    with AttachManager(datapath.programs, netns=topology.host_path, resync_interval=0.2) as manager:
        assert set(manager.attached()) == {pod.host_veth}
        harness = AgentHarness(lab_apiserver, links=manager)
        with harness:
            assert harness.agent.supervisor.healthy
            broken[0] = True  # the next periodic pass fails on the worker thread; nobody calls sync()
            wait_for(lambda: not harness.agent.supervisor.healthy, 5, "the agent unhealthy")
            assert harness.on_loop(harness.agent.snapshot).task_failures == {"attach": 1}
            assert harness.agent.supervisor.failed.is_set()  # the agent command exits 1 on this


# --- a CRD that is not installed -------------------------------------------------------------------------


async def test_a_missing_crd_is_an_empty_collection_reported_as_404() -> None:
    answers = [MockAnswer(404, {"Content-Type": "text/plain"}, b"404 page not found\n")] * 3

    def handler(method: str, path: str, params: dict[str, str]) -> MockAnswer:
        return answers.pop(0) if answers else MockAnswer(404, {"Content-Type": "text/plain"}, b"404 page not found\n")

    deltas: list[Delta[Any]] = []

    async def sink(delta: Delta[Any]) -> None:
        deltas.append(delta)

    settings = ReflectorSettings(optional=True)
    settings.backoff.initial = settings.backoff.cap = 0.01
    reflector = Reflector(METRICS_CONFIGURATIONS, MockTransport(handler), sink, settings)
    task = asyncio.create_task(reflector.run())
    await asyncio.wait_for(reflector.synced.wait(), 5)
    await asyncio.sleep(0.1)
    task.cancel()
    assert [type(d) for d in deltas] == [Replace] and not deltas[0].items  # once, not per retry
    assert reflector.stats.failures.get("http_404", 0) >= 2 and "http_500" not in reflector.stats.failures


# --- leader election by the candidate's own duration ----------------------------------------------------


async def test_a_forged_lease_with_a_huge_duration_does_not_stop_leadership() -> None:
    store = MemoryLeaseStore()
    now = datetime.now(UTC)
    await store.create(LeaseRecord("forger", 1_000_000, now, now))
    clock = [0.0]
    elector = LeaderElector(store, "op-a", lease_duration=3.0, renew_deadline=2.0, retry_period=0.5,
                            clock=lambda: clock[0])
    assert await elector.step() is False  # a live-looking holder: wait
    clock[0] = 3.5  # the record did not change for our lease duration: the holder is gone
    assert await elector.step() is True
    record = await store.get()
    assert record is not None and record.holder == "op-a" and record.duration_s == 3


def test_the_lab_api_server_refuses_what_a_real_one_refuses(lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    cluster.pod("shop", "p", None)
    status, _, body = lab_apiserver.request(
        "PATCH", "/api/v1/namespaces/shop/pods/p/status",
        {"status": {"podIP": "fe80::1%eth0", "podIPs": [{"ip": "fe80::1%eth0"}]}}, "application/merge-patch+json")
    assert status == 422 and "must be a valid IP address" in body["message"]
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "l"},
             "spec": {"holderIdentity": "x", "leaseDurationSeconds": "15"}}
    status, _, body = lab_apiserver.request("POST", "/apis/coordination.k8s.io/v1/namespaces/default/leases", lease)
    assert status == 400 and "leaseDurationSeconds" in body["message"]
    lease["spec"]["leaseDurationSeconds"] = 0
    status, _, body = lab_apiserver.request("POST", "/apis/coordination.k8s.io/v1/namespaces/default/leases", lease)
    assert status == 422 and "must be greater than 0" in body["message"]
