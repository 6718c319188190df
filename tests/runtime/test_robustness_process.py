"""The robustness findings of ``test_robustness.py`` once more, through the whole agent and operator over real
HTTP against the lab API server (the reflectors, the wire decoders, the writer), each failing on the code
before its fix:

* a namespace with 257 labels (observed through its annotation) and a pod with 300 labels and 65 owner
  references (observed through its own): both decode, are observed, their IPs are desired and in the
  datapath, also for a fresh agent that only lists them (the result does not depend on history: I1, I2);
* the operator gives that pod an identity made of the labels its filter keeps (I4);
* an API server that does not serve MetricsConfigurations (its CRD not installed: a plain-text 404, as a real
  kube-apiserver answers): the agent is ready within seconds, observes annotated pods, says so in one
  warning, and takes the configuration into account once the CRD is there (F18, docs/agent.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from agent_harness import OBSERVE, AgentHarness, Cluster
from api_proxy import ApiProxy
from lab_server import LabServer, lab_apiserver
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.adapters.kube.backoff import Backoff
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.kube.reflector import ReflectorSettings
from podmeter.model.identity import IdentityKey
from podmeter.runtime.agent import Agent
from podmeter.runtime.operator import Operator, ReflectorPodSource
from podmeter.runtime.settings import OperatorSettings

__all__ = ["lab_apiserver"]

CROWDED_LABELS = 300  # 299 labels of its own and pod-template-hash, which the identity filter drops
OWNER_REFERENCES = 65


# --- objects with many labels and owner references ------------------------------------------------------


def crowded_namespace(cluster: Cluster, name: str) -> None:
    """257 labels (one more than the decoder used to take) and the observe annotation."""
    meta = {"name": name, "labels": {f"team.example.com/l{i}": "v" for i in range(257)},
            "annotations": {OBSERVE: "true"}}
    cluster._ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": meta})


def crowded_labels() -> dict[str, str]:
    labels = {f"app.example.com/k{i}": str(i) for i in range(CROWDED_LABELS - 1)}
    return labels | {"pod-template-hash": "5d9f7"}


def crowded_pod(cluster: Cluster, ns: str, name: str, ip: str) -> None:
    """300 labels and 65 owner references, the last one its controller; observed by its own annotation."""
    owners = [{"apiVersion": "v1", "kind": "ConfigMap", "name": f"o{i}", "uid": f"00000000-0000-4000-8000-{i:012d}"}
              for i in range(OWNER_REFERENCES - 1)]
    owners.append({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{name}-5d9f7", "controller": True,
                   "uid": "00000000-0000-4000-8000-999999999999"})
    meta = {"name": name, "labels": crowded_labels(), "annotations": {OBSERVE: "true"}, "ownerReferences": owners}
    spec = {"nodeName": "node-a", "containers": [{"name": "c", "image": "busybox"}]}
    cluster._ok("POST", f"/api/v1/namespaces/{ns}/pods",
                {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    cluster.set_status(ns, name, ip)


def assert_observed(harness: AgentHarness, expected: dict[str, str]) -> None:
    """``expected``: IP -> namespace/name; desired and in the datapath, nothing skipped as undecodable."""
    harness.wait_filter(set(expected))
    state = harness.state()
    assert state["filter"]["desired"] == {ip: [key] for ip, key in expected.items()}
    assert {name: r["decode_errors"] for name, r in state["reflectors"].items()} == dict.fromkeys(
        state["reflectors"], 0)


def test_a_namespace_with_257_labels_and_a_pod_with_300_labels_and_65_owners_are_observed(
        lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    crowded_namespace(cluster, "big")
    cluster.namespace("plain")  # not observed: only the pod's own annotation counts here
    expected = {"10.4.0.1": "big/web", "10.4.0.2": "plain/crowded"}
    with AgentHarness(lab_apiserver) as harness:  # the pods arrive as watch events
        cluster.pod("big", "web", "10.4.0.1")
        crowded_pod(cluster, "plain", "crowded", "10.4.0.2")
        assert_observed(harness, expected)
    with AgentHarness(lab_apiserver) as fresh:  # a fresh agent on the same server: everything from its list
        assert_observed(fresh, expected)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_pod_with_300_labels_and_65_owners_gets_an_identity_of_its_kept_labels(
        lab_apiserver: LabServer) -> None:
    cluster = Cluster(lab_apiserver)
    cluster.namespace("plain")
    crowded_pod(cluster, "plain", "crowded", "10.4.0.2")
    kept = {k: v for k, v in crowded_labels().items() if k != "pod-template-hash"}
    expected = IdentityKey("plain", tuple(x for k in sorted(kept) for x in (k, kept[k])))
    settings = ReflectorSettings(request_timeout=5.0, backoff=Backoff(initial=0.05, cap=0.2))
    for _ in ("the first operator", "a fresh one"):  # from the list; a fresh operator gives the same answer
        source = ReflectorPodSource(load_connection(str(lab_apiserver.kubeconfig)), settings)
        backend = MemoryIdentityBackend()
        op = Operator(source, backend, settings=OperatorSettings(sweep_period=60))
        task = asyncio.create_task(op.run())
        try:
            await until(lambda backend=backend: bool(backend.held()), "an identity")  # type: ignore[misc]
            assert list(backend.held()) == [expected] and len(expected.labels) == 2 * (CROWDED_LABELS - 1)
            assert source.reflector is not None and source.reflector.stats.decode_errors == 0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# --- an API server without podmeter's CRDs -------------------------------------------------------------


class WithoutCrds:
    """What a real kube-apiserver answers for podmeter's custom resources in ``missing`` when their CRD is
    not installed (404, ``text/plain``, ``404 page not found``), as an ``api_proxy.ApiProxy`` answer;
    ``install(plural)`` makes one served again. The lab API server itself always serves them."""

    def __init__(self, missing: set[str]) -> None:
        self.missing = set(missing)

    def install(self, plural: str) -> None:
        self.missing.discard(plural)

    def __call__(self, request: web.Request) -> web.Response | None:
        if not any(request.path.startswith(f"/apis/podmeter.io/v1alpha1/{plural}") for plural in self.missing):
            return None
        return web.Response(status=404, body=b"404 page not found\n",
                            headers={"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"})


@pytest.fixture
def without_metrics_configurations(lab_apiserver: LabServer, tmp_path: Path) -> Iterator[ApiProxy]:
    with ApiProxy(lab_apiserver, WithoutCrds({"metricsconfigurations"}), tmp_path, "kubeconfig-without-crds") as proxy:
        yield proxy


def agent_through(proxy: ApiProxy, harness: AgentHarness) -> AgentHarness:
    """The harness's agent, talking to the API server through ``proxy``."""
    harness.agent = Agent(harness.agent.settings, load_connection(str(proxy.kubeconfig)), harness.datapath)
    return harness


def test_without_the_metrics_configuration_crd_the_agent_is_ready_observes_and_picks_the_crd_up_later(
        lab_apiserver: LabServer, without_metrics_configurations: ApiProxy,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy = without_metrics_configurations
    cluster = Cluster(lab_apiserver)
    cluster.namespace("shop")
    cluster.namespace("prod")  # observed only once a MetricsConfiguration includes it
    caplog.set_level(logging.WARNING, logger="podmeter")
    started = time.monotonic()
    with agent_through(proxy, AgentHarness(lab_apiserver)) as harness:
        assert time.monotonic() - started < 5, "ready within seconds, without the CRD"
        cluster.pod("shop", "web", "10.6.0.1", observe=True)
        cluster.pod("prod", "api", "10.6.0.2")
        harness.wait_filter({"10.6.0.1"})
        assert proxy.answered >= 1
        assert harness.state()["reflectors"]["metricsconfigurations"]["failures"].get("http_404", 0) >= 1
        said = [r.getMessage() for r in caplog.records if "not served by the API server" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("metricsconfigurations:"), said
        assert harness.state()["configuration"] is None
        assert harness.agent.supervisor.healthy
        crds = proxy.answer
        assert isinstance(crds, WithoutCrds)
        crds.install("metricsconfigurations")  # the CRD is installed, then its object created
        assert cluster.configuration({"namespaces": {"include": ["prod"]}}) == 201
        harness.wait_filter({"10.6.0.1", "10.6.0.2"})  # with an include list the annotation still counts
        assert harness.state()["configuration"]["include"] == ["prod"]
    assert len([r for r in caplog.records if "not served by the API server" in r.getMessage()]) == 1
