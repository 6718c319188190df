"""Cluster-wide endpoints: the operator's PodSlices and the agents' endpoint cache (invariant I7).

Model: the desired slices are a deterministic function of pods and identities (each published pod once,
a pod's change touches one slice, bounded slices); the agent's cache is the union of the stored slices
whatever order their changes come in (Hypothesis). Over real HTTP against the lab API server, with the
real ``podmeter operator`` processes: publication equals the desired set after churn, IP reuse, a lost
watch and a SIGKILLed leader; an agent started after the fact converges to the API server's pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_harness import AgentHarness, Cluster
from etcd_server import EtcdServer, etcd
from factories import make_pod, with_changes
from lab_server import LabServer, lab_apiserver
from operator_support import OperatorProcess
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.kube.slices import KubeSliceApi
from podmeter.model.deltas import POD_SLICES, Delete, Upsert
from podmeter.model.endpoint_slices import (
    MOST,
    ClusterEndpoints,
    PodSlice,
    bucket_of,
    decode_slice,
    desired_slices,
    slice_count,
)
from podmeter.model.identity import IdentityKey, LabelFilter, key_of_flat
from podmeter.model.records import Pod, decode_pod
from podmeter.model.store import Store
from podmeter.runtime.endpoint_publisher import EndpointPublisher, LastSync
from podmeter.runtime.operator_process import kube_client
from waiting import wait_for

__all__ = ["etcd", "lab_apiserver"]

SLICES = "/apis/podmeter.io/v1alpha1/podslices"


def identities_by_app(pods: list[Pod]) -> Callable[[Pod], tuple[int, IdentityKey] | None]:
    ids: dict[IdentityKey, int] = {}

    def identity_of(pod: Pod) -> tuple[int, IdentityKey] | None:
        key = key_of_flat(pod.namespace, pod.labels, LabelFilter())
        return ids.setdefault(key, 256 + len(ids)), key

    return identity_of


# --- the model -------------------------------------------------------------------------------------


def test_each_published_pod_is_in_exactly_one_slice_and_a_change_touches_one_slice() -> None:
    pods = [make_pod(f"p{i}", "shop", ips=(f"10.1.{i // 250}.{i % 250}",), labels={"app": f"a{i % 7}"})
            for i in range(1000)]
    pods.append(make_pod("no-ip", "shop"))
    pods.append(make_pod("done", "shop", ips=("10.9.9.9",), phase="Succeeded"))
    identity_of = identities_by_app(pods)
    slices = desired_slices(pods, identity_of, current=0)
    uids = [e["uid"] for spec in slices.values() for e in spec["endpoints"]]
    assert sorted(uids) == sorted(p.uid for p in pods[:1000])  # once each; no IP-less or finished pod
    assert len(slices) == slice_count(1000, 0) and all(len(s["endpoints"]) <= 2 * MOST for s in slices.values())
    for spec in slices.values():  # the labels of every identity a slice uses travel with it
        assert {str(e["identity"]) for e in spec["endpoints"]} == set(spec["identities"])
    assert desired_slices(reversed(pods), identity_of, current=len(slices)) == slices  # deterministic
    moved = msgspec.structs.replace(pods[3], ips=("10.2.0.3",))
    after = desired_slices([moved, *pods[:3], *pods[4:]], identity_of, current=len(slices))
    assert [name for name in slices if slices[name] != after[name]] == [
        f"pods-{len(slices)}-{bucket_of(pods[3].uid, len(slices))}"]


def test_the_slice_count_has_hysteresis() -> None:
    assert slice_count(0, 0) == 1 and slice_count(150, 1) == 1 and slice_count(201, 1) == 2
    assert slice_count(60, 2) == 2  # 30 a slice: not yet worth halving
    assert slice_count(40, 2) == 1
    assert slice_count(100_000, 0) == 512


def _slice(name: str, version: int, pods: dict[str, str]) -> PodSlice:
    """A slice listing ``pods`` (ip -> pod name)."""
    spec = {"endpoints": [{"uid": f"u-{pod}", "namespace": "shop", "name": pod, "ips": [ip], "identity": 300}
                          for ip, pod in sorted(pods.items())]}
    return decode_slice({"metadata": {"name": name, "resourceVersion": str(version)}, "spec": spec})


slice_steps = st.lists(st.tuples(
    st.sampled_from(["pods-4-1", "pods-4-2", "pods-4-3"]), st.booleans(),
    st.dictionaries(st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]),
                    st.sampled_from(["a", "b", "c"]), max_size=3)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(slice_steps)
def test_the_cache_is_the_union_of_the_stored_slices(steps: list[tuple[str, bool, dict[str, str]]]) -> None:
    cache = ClusterEndpoints()
    store: Store[PodSlice] = Store(POD_SLICES)
    for version, (name, delete, pods) in enumerate(steps):
        delta = Delete(POD_SLICES, name) if delete else Upsert(POD_SLICES, _slice(name, version, pods))
        store.apply(delta, cache.changed)
        listed: dict[str, set[str]] = {}
        for stored in store.objects.values():
            for ip, endpoint in stored.endpoints():
                listed.setdefault(ip, set()).add(endpoint.pod)
        cached = dict(cache.items())
        assert set(cached) == set(listed)  # nothing stale, nothing missing
        assert all(cached[ip].pod in names for ip, names in listed.items())


# --- the publisher's writes, in process over real HTTP ---------------------------------------------


@contextlib.asynccontextmanager
async def publisher_on(server: LabServer, max_writes: int = 100) -> AsyncIterator[EndpointPublisher]:
    """The leader's publisher against ``server``, its slices listed (syncs are driven by the test)."""
    connection = load_connection(str(server.kubeconfig), allow_plain_http=True)
    client = kube_client(connection)
    publisher = EndpointPublisher(KubeSliceApi(client), max_writes=max_writes)
    watch = asyncio.create_task(publisher.watch(connection))
    try:
        await asyncio.wait_for(publisher.synced.wait(), timeout=10)
        yield publisher
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await client.close()


async def test_pod_changes_between_two_syncs_are_one_write_of_their_slice(lab_apiserver: LabServer) -> None:
    pods = [make_pod(f"web-{i}", "shop", ips=(f"10.8.0.{i + 1}",)) for i in range(20)]
    identity_of = identities_by_app(pods)
    async with publisher_on(lab_apiserver) as publisher:
        assert await publisher.sync(pods, identity_of) == 1  # one slice holds 20 pods
        puts = lab_apiserver.admin.count("update", "podmeter.io/podslices")
        moved = [with_changes(p, ips=(f"10.8.1.{i + 1}",)) for i, p in enumerate(pods[:5])]
        assert await publisher.sync(moved + pods[5:], identity_of) == 1  # five changes within one period
        assert await publisher.sync(moved + pods[5:], identity_of) == 0  # nothing left to write
    assert lab_apiserver.admin.count("update", "podmeter.io/podslices") == puts + 1
    assert publisher.stats.writes == {"create": 1, "replace": 1}
    _, _, body = lab_apiserver.request("GET", SLICES)
    (listed,) = body["items"]
    assert {e["ips"][0] for e in listed["spec"]["endpoints"]} >= {f"10.8.1.{i + 1}" for i in range(5)}


async def test_the_write_limit_leaves_writes_pending_that_later_syncs_make(lab_apiserver: LabServer) -> None:
    pods = [make_pod(f"job-{i}", "batch", ips=(f"10.9.{i // 250}.{i % 250 + 1}",)) for i in range(2 * MOST + 10)]
    identity_of = identities_by_app(pods)
    slices = slice_count(len(pods), 0)
    async with publisher_on(lab_apiserver, max_writes=1) as publisher:
        pending = []
        for _ in range(slices):
            assert await publisher.sync(pods, identity_of) == 1
            pending.append(publisher.last.pending)
        assert await publisher.sync(pods, identity_of) == 0
    assert pending == list(range(slices - 1, -1, -1)) and slices > 2  # one slice a sync, until none is left
    assert publisher.last == LastSync(endpoints=len(pods), slices=slices, pending=0)
    assert publisher.stats.writes == {"create": slices} and publisher.stats.syncs == slices + 1


# --- the operator publishes, over real HTTP ----------------------------------------------------------


def api_pods(server: LabServer) -> list[Pod]:
    _, _, body = server.request("GET", "/api/v1/pods")
    return [decode_pod(p) for p in body["items"]]


def published(server: LabServer) -> dict[str, tuple[str, str, tuple[str, ...], int]] | None:
    """uid -> (namespace, name, ips, identity) over every slice the API server holds; None while a pod is
    in two slices (mid-way through a move between slices: new slices are written before old ones go)."""
    _, _, body = server.request("GET", SLICES)
    out: dict[str, tuple[str, str, tuple[str, ...], int]] = {}
    for item in body["items"]:
        for e in item["spec"]["endpoints"]:
            if e["uid"] in out:
                return None
            out[e["uid"]] = (e["namespace"], e["name"], tuple(e["ips"]), e["identity"])
    return out


def expected(server: LabServer, op: OperatorProcess) -> dict[str, tuple[str, str, tuple[str, ...], int]]:
    ids = {(d["namespace"], tuple(sorted(d["labels"].items()))): d["id"] for d in op.debug()["identities"]}
    out = {}
    for pod in api_pods(server):
        key = key_of_flat(pod.namespace, pod.labels, LabelFilter())
        ident = ids.get((key.namespace, tuple(sorted(key.label_dict().items()))))
        if pod.ips and not pod.host_network and pod.phase not in ("Succeeded", "Failed") and ident:
            out[pod.uid] = (pod.namespace, pod.name, pod.ips, ident)
    return out


def converged(server: LabServer, op: OperatorProcess) -> Callable[[], bool]:
    return lambda: bool(published(server)) and published(server) == expected(server, op)


def test_publication_follows_churn_ip_reuse_and_a_lost_watch(
        lab_apiserver: LabServer, operators: Callable[..., OperatorProcess]) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    for i in range(30):
        cluster.pod("shop", f"web-{i}", f"10.4.0.{i + 1}", node=f"node-{i % 3}")
    op = operators("op-a", "--publish-period", "0.2")
    wait_for(converged(lab_apiserver, op), timeout=20, what="30 pods published",
             describe=lambda: (published(lab_apiserver), op.log.read_text()[-2000:]))
    assert op.metric('podmeter_slice_writes_total{op="create"}') == 1  # 30 pods: one slice
    for i in range(10):  # churn, and IP reuse: web-i's IP goes to job-i
        cluster.delete_pod("shop", f"web-{i}")
        cluster.pod("shop", f"job-{i}", f"10.4.0.{i + 1}", node="node-0")
    wait_for(converged(lab_apiserver, op), timeout=20, what="churn and IP reuse published")
    assert all(name.startswith("job-") for _, name, ips, _ in (published(lab_apiserver) or {}).values()
               if ips[0] in {f"10.4.0.{i + 1}" for i in range(10)})
    lab_apiserver.admin.stall()  # the operator's watch goes silent: it misses what follows
    for i in range(10, 15):
        cluster.delete_pod("shop", f"web-{i}")
    lab_apiserver.admin.close_watches()
    wait_for(converged(lab_apiserver, op), timeout=30, what="a lost watch repaired by the relist")
    assert op.metric('podmeter_slice_writes_total{op="create"}') == 1  # the slice was replaced, never made again


def test_a_new_leader_takes_over_the_slices_after_a_sigkill(
        lab_apiserver: LabServer, etcd: EtcdServer, operators: Callable[..., OperatorProcess]) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    for i in range(12):
        cluster.pod("shop", f"web-{i}", f"10.5.0.{i + 1}")
    backend = ["--identity-backend", "etcd", "--etcd-endpoints", etcd.endpoint, "--publish-period", "0.2"]
    a = operators("op-a", *backend)
    wait_for(lambda: a.metric("podmeter_leader") == 1, what="op-a leads")
    b = operators("op-b", *backend)
    wait_for(converged(lab_apiserver, a), timeout=20, what="published by op-a")
    a.stop(signal.SIGKILL)
    for i in range(6):  # while nobody leads: deletes and a reused IP
        cluster.delete_pod("shop", f"web-{i}")
    cluster.pod("shop", "late", "10.5.0.1")
    wait_for(lambda: b.metric("podmeter_leader") == 1, timeout=15, what="op-b leads")
    wait_for(converged(lab_apiserver, b), timeout=20, what="op-b repaired what op-a left",
             describe=lambda: (published(lab_apiserver), expected(lab_apiserver, b)))
    assert b.metric("podmeter_slice_conflicts_total") == 0


def test_an_agent_started_after_the_fact_names_every_pod_of_the_cluster(
        lab_apiserver: LabServer, operators: Callable[..., OperatorProcess]) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    for i in range(20):
        cluster.pod("shop", f"web-{i}", f"10.6.0.{i + 1}", node=f"node-{i % 4}")
    op = operators("op-a", "--publish-period", "0.2")
    wait_for(converged(lab_apiserver, op), timeout=20, what="published")
    with AgentHarness(lab_apiserver, node="node-0") as harness:

        def cache() -> dict[str, Any]:
            return {ip: (e["namespace"], e["pod"], e["node"]) for ip, e in
                    harness.on_loop(harness.agent.debug_endpoints)["endpoints"].items()}

        want = {f"10.6.0.{i + 1}": ("shop", f"web-{i}", f"node-{i % 4}") for i in range(20)}
        wait_for(lambda: cache() == want, timeout=20, what="the agent's cache equals the cluster's pods")
        cluster.delete_pod("shop", "web-5")
        cluster.pod("shop", "reused", "10.6.0.6", node="node-2")  # web-5's IP, now another pod's
        want["10.6.0.6"] = ("shop", "reused", "node-2")
        wait_for(lambda: cache() == want, timeout=20, what="nothing stale after deletion and IP reuse",
                 describe=cache)


def test_slices_are_bounded_and_stale_ones_go_when_the_cluster_shrinks(
        lab_apiserver: LabServer, operators: Callable[..., OperatorProcess]) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("batch")
    for i in range(2 * MOST + 10):  # more than one slice holds: the operator spreads them over more
        cluster.pod("batch", f"job-{i}", f"10.7.{i // 250}.{i % 250 + 1}")
    op = operators("op-a", "--publish-period", "0.2")
    wait_for(converged(lab_apiserver, op), timeout=30, what="410 pods published")
    _, _, body = lab_apiserver.request("GET", SLICES)
    assert len(body["items"]) == slice_count(2 * MOST + 10, 0) > 1
    assert all(len(item["spec"]["endpoints"]) <= 2 * MOST for item in body["items"])
    for i in range(2 * MOST - 10):
        cluster.delete_pod("batch", f"job-{i}")
    wait_for(converged(lab_apiserver, op), timeout=30, what="the shrunk set published")
    _, _, body = lab_apiserver.request("GET", SLICES)
    assert [item["metadata"]["name"] for item in body["items"]] == ["pods-1-0"]  # the stale slices went
    assert op.metric('podmeter_slice_writes_total{op="delete"}') >= 1


def test_the_endpoint_cache_returns_to_empty_after_churn_and_gives_its_tables_back() -> None:
    cache = ClusterEndpoints()
    store: Store[PodSlice] = Store(POD_SLICES)
    for round_ in range(3):
        for n in range(40):  # 40 slices of 100 pods each come and go, every round with new IPs
            pods = {f"10.{round_}.{n}.{i}": f"p{round_}-{n}-{i}" for i in range(100)}
            store.apply(Upsert(POD_SLICES, _slice(f"pods-64-{n}", round_ * 100 + n, pods)), cache.changed)
        assert len(cache) == 4000
        for n in range(40):
            store.apply(Delete(POD_SLICES, f"pods-64-{n}"), cache.changed)
        assert len(cache) == 0 and not cache.slices and not store.objects
    assert cache._peak.peak < 1024  # rebuilt when emptied: the peak of a past round pins no memory
