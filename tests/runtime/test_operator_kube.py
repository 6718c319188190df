"""The operator against the lab API server over real HTTP: Lease election, configuration status (also with
no MetricsConfiguration at all)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig

from lab_server import LabServer, lab_apiserver
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.kube.lease import KubeLeaseStore
from podmeter.adapters.kube.status import KubeConfigApi
from podmeter.model.lease import LeaseConflict, LeaseRecord
from podmeter.runtime.leadership import LeaderElector
from podmeter.runtime.operator import ConfigurationStatus, Operator, ReflectorPodSource
from podmeter.runtime.operator_process import metrics_registry
from podmeter.runtime.settings import OperatorSettings

__all__ = ["lab_apiserver"]

LEASE, RENEW, RETRY = 2.0, 1.2, 0.1


@pytest.fixture
async def client(lab_apiserver: LabServer) -> AsyncIterator[AsyncClient]:
    c = AsyncClient(config=KubeConfig.from_file(str(lab_apiserver.kubeconfig)))
    yield c
    await c.close()


def elector(client: AsyncClient, name: str) -> LeaderElector:
    store = KubeLeaseStore(client, "default", "podmeter-operator")
    return LeaderElector(store, name, lease_duration=LEASE, renew_deadline=RENEW, retry_period=RETRY)


async def test_lease_store_optimistic_concurrency(client: AsyncClient) -> None:
    store = KubeLeaseStore(client, "default", "lock")
    assert await store.get() is None
    first = await store.create(LeaseRecord("a", 15))
    with pytest.raises(LeaseConflict):
        await store.create(LeaseRecord("b", 15))
    got = await store.get()
    assert got is not None and (got.holder, got.duration_s) == ("a", 15)
    second = await store.update(LeaseRecord("a", 15, transitions=1, resource_version=first.resource_version))
    assert second.resource_version != first.resource_version
    with pytest.raises(LeaseConflict):  # a stale resourceVersion loses
        await store.update(LeaseRecord("b", 15, resource_version=first.resource_version))


async def test_leader_killed_other_takes_over_within_lease_duration(
    client: AsyncClient, lab_apiserver: LabServer
) -> None:
    a, b = elector(client, "a"), elector(client, "b")
    for _ in range(5):
        await a.step()
        await b.step()
        assert not (a.is_leader and b.is_leader)
        await asyncio.sleep(RETRY)
    assert a.is_leader and not b.is_leader
    died = time.monotonic()  # a stops renewing: killed
    while not await b.step():
        assert time.monotonic() - died < LEASE + 3 * RETRY + 0.5
        await asyncio.sleep(RETRY)
    status, _, body = lab_apiserver.request(
        "GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/podmeter-operator"
    )
    assert status == 200
    assert (body["spec"]["holderIdentity"], body["spec"]["leaseTransitions"]) == ("b", 1)


def lease_spec(server: LabServer) -> dict[str, Any]:
    status, _, body = server.request("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/podmeter-operator")
    assert status == 200, body
    spec: dict[str, Any] = body["spec"]
    return spec


async def lead_until_stopped(candidate: LeaderElector) -> asyncio.Task[None]:
    """Run ``candidate``'s campaign until it leads; cancelling the task is the clean exit of SIGTERM."""
    task = asyncio.create_task(candidate.run())
    deadline = time.monotonic() + LEASE + 2
    while not candidate.is_leader:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(RETRY / 2)
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_every_takeover_counts_in_lease_transitions_also_after_a_release(
    client: AsyncClient, lab_apiserver: LabServer
) -> None:
    """Rolling updates: each leader empties the Lease on its way out and the other replica takes it at
    once. ``leaseTransitions`` counts each of those takeovers, as client-go's does (it stayed 0)."""
    a, b = elector(client, "a"), elector(client, "b")
    task = await lead_until_stopped(a)
    assert (lease_spec(lab_apiserver)["holderIdentity"], lease_spec(lab_apiserver)["leaseTransitions"]) == ("a", 0)
    for handover, (old, new) in enumerate([(a, b), (b, a), (a, b)], start=1):
        await stop(task)  # SIGTERM: the leader releases the Lease
        released = lease_spec(lab_apiserver)
        assert (released["holderIdentity"], released["leaseTransitions"]) == ("", handover - 1)
        assert not old.is_leader
        task = await lead_until_stopped(new)  # at once: no lease duration to wait out
        spec = lease_spec(lab_apiserver)
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == (new.identity, handover)
    for _ in range(3):  # renewals are not transitions
        await asyncio.sleep(RETRY)
    assert lease_spec(lab_apiserver)["leaseTransitions"] == 3
    await stop(task)


MC_PATH = "/apis/podmeter.io/v1alpha1/metricsconfigurations"


def create_config(server: LabServer, spec: dict[str, Any]) -> None:
    obj = {"apiVersion": "podmeter.io/v1alpha1", "kind": "MetricsConfiguration",
           "metadata": {"name": "default"}, "spec": spec}
    status, _, body = server.request("POST", MC_PATH, obj)
    assert status == 201, body


def read_condition(server: LabServer) -> dict[str, Any]:
    status, _, body = server.request("GET", f"{MC_PATH}/default")
    assert status == 200
    conditions = body["status"]["conditions"]
    assert [c["type"] for c in conditions] == ["Accepted"]
    return dict(conditions[0])


async def test_invalid_configuration_status_says_why(client: AsyncClient, lab_apiserver: LabServer) -> None:
    create_config(lab_apiserver, {"namespaces": {"include": ["prod"], "exclude": ["kube-system"]}})
    status = ConfigurationStatus(KubeConfigApi(client))
    await status.reconcile()
    cond = read_condition(lab_apiserver)
    assert (cond["status"], cond["reason"]) == ("False", "Invalid")
    assert "include and exclude cannot both be non-empty" in cond["message"]
    assert cond["lastTransitionTime"]


async def test_valid_configuration_is_accepted_and_fixed_one_too(
    client: AsyncClient, lab_apiserver: LabServer
) -> None:
    create_config(lab_apiserver, {"namespaces": {"include": ["Bad Name"]}})
    status = ConfigurationStatus(KubeConfigApi(client))
    await status.reconcile()
    assert read_condition(lab_apiserver)["status"] == "False"
    code, _, _ = lab_apiserver.request(
        "PATCH", f"{MC_PATH}/default", {"spec": {"namespaces": {"include": ["prod"]}}},
        content_type="application/merge-patch+json",
    )
    assert code == 200
    await status.reconcile()
    cond = read_condition(lab_apiserver)
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("True", "Valid", 2)
    writes = status.writes
    await status.reconcile()
    assert status.writes == writes  # steady: no rewrite


async def test_no_metrics_configuration_at_all_reads_as_valid(client: AsyncClient, lab_apiserver: LabServer) -> None:
    """Annotations alone are a valid setup: an operator that found no ``default`` MetricsConfiguration
    exports podmeter_configuration_valid 1 (PodmeterConfigurationInvalid must not fire), writes no status,
    and goes back to 1 when an invalid object it reported as 0 is deleted."""
    source = ReflectorPodSource(load_connection(str(lab_apiserver.kubeconfig)))
    op = Operator(source, MemoryIdentityBackend(), config=KubeConfigApi(client),
                  settings=OperatorSettings(sweep_period=60, config_period=0.05))

    async def until(predicate: Callable[[], bool], what: str) -> None:
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"operator: {what}")

    def valid() -> float | None:
        return metrics_registry(op).get_sample_value("podmeter_configuration_valid")

    task = asyncio.create_task(op.run())
    try:
        # Several checks of the absent object (each a GET answered 404), not merely the initial value.
        checks = lambda: lab_apiserver.admin.count("get", "podmeter.io/metricsconfigurations")  # noqa: E731
        await until(lambda: checks() >= 3, "no config checks")
        assert op.config is not None and op.config.valid is None and op.config.writes == 0
        assert valid() == 1
        create_config(lab_apiserver, {"namespaces": {"include": ["-bad-"]}})
        await until(lambda: valid() == 0, "the invalid object was not reported")
        status, _, _ = lab_apiserver.request("DELETE", f"{MC_PATH}/default")
        assert status == 200
        await until(lambda: valid() == 1, "no MetricsConfiguration again, yet not valid")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
