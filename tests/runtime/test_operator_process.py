"""``podmeter operator`` end to end: real processes, the lab API server over HTTP, a real etcd.

The reported reproduction (450 short Job pods), two operators on one etcd with a SIGKILLed leader, the
MetricsConfiguration status, and missed deletes across a compaction gap (relist) with the reflector.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from etcd_server import EtcdServer, etcd
from lab_server import LabServer
from operator_support import LEASE_S, OperatorProcess
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.adapters.kube.backoff import Backoff
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.kube.reflector import ReflectorSettings
from podmeter.model.identity import IdentityKey
from podmeter.runtime.operator import Operator, ReflectorPodSource
from podmeter.runtime.operator_process import metrics_registry
from podmeter.runtime.settings import OperatorSettings
from waiting import wait_for

__all__ = ["etcd"]

APPS = ("report", "backup", "etl")
MC_PATH = "/apis/podmeter.io/v1alpha1/metricsconfigurations"


def job_pod(i: int) -> dict[str, Any]:
    app = APPS[i % len(APPS)]
    labels = {"app": app, "job-name": f"{app}-{i}", "controller-uid": f"00000000-0000-4000-8000-{i:012d}",
              "batch.kubernetes.io/job-name": f"{app}-{i}",
              "batch.kubernetes.io/controller-uid": f"00000000-0000-4000-8000-{i:012d}"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{app}-{i}", "labels": labels},
            "spec": {"nodeName": "node-a", "restartPolicy": "Never",
                     "containers": [{"name": "job", "image": "busybox"}]}}


def ok(server: LabServer, method: str, path: str, body: Any = None,
       content_type: str = "application/json") -> Any:
    status, _, answer = server.request(method, path, body, content_type)
    assert 200 <= status < 300, f"{method} {path}: {status} {answer}"
    return answer


def namespace(server: LabServer, name: str) -> None:
    ok(server, "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def test_450_job_pods_two_operators_on_etcd_leader_killed(
    lab_apiserver: LabServer, etcd: EtcdServer, operators: Callable[..., OperatorProcess]
) -> None:
    namespace(lab_apiserver, "batch")
    backend = ["--identity-backend", "etcd", "--etcd-endpoints", etcd.endpoint, "--etcd-lease-ttl", "3"]
    a = operators("op-a", *backend)
    wait_for(lambda: a.metric("podmeter_leader") == 1, what="op-a leads")
    b = operators("op-b", *backend)
    peak: set[str] = set()
    for i in range(450):  # the reported reproduction: short Job pods, at most 30 alive
        ok(lab_apiserver, "POST", "/api/v1/namespaces/batch/pods", job_pod(i))
        if i >= 30:
            ok(lab_apiserver, "DELETE", f"/api/v1/namespaces/batch/pods/{APPS[(i - 30) % 3]}-{i - 30}")
        if i % 90 == 0:
            peak |= a.label_sets()
    wait_for(lambda: a.label_sets() == b.label_sets() == set(APPS), what="both operators see 3 label sets")
    ids_a = {d["labels"]["app"]: d["id"] for d in a.debug()["identities"]}
    ids_b = {d["labels"]["app"]: d["id"] for d in b.debug()["identities"]}
    assert ids_a == ids_b and len(set(ids_a.values())) == 3  # one ID per label set, across operators
    assert a.metric("podmeter_identity_acquired_total") == 3  # not one per Job pod
    assert peak <= set(APPS)

    a.stop(signal.SIGKILL)  # the leader dies without handing over
    killed = time.monotonic()
    wait_for(lambda: b.metric("podmeter_leader") == 1, timeout=LEASE_S + 3, what="op-b takes over")
    assert time.monotonic() - killed <= LEASE_S + 1.5
    for i in range(420, 450):
        ok(lab_apiserver, "DELETE", f"/api/v1/namespaces/batch/pods/{APPS[i % 3]}-{i}")
    wait_for(lambda: b.debug()["identities"] == [] and b.debug().get("store") == {}, timeout=15,
             what="every identity released, and op-a's references expired and collected",
             describe=lambda: (b.debug(), b.log.read_text()[-3000:]))
    assert b.metric("podmeter_identities") == 0
    assert b.metric("podmeter_identity_gc_released_total") == 0  # no event was lost


def test_configuration_status_invalid_then_accepted(
    lab_apiserver: LabServer, operators: Callable[..., OperatorProcess]
) -> None:
    obj = {"apiVersion": "podmeter.io/v1alpha1", "kind": "MetricsConfiguration",
           "metadata": {"name": "default"}, "spec": {"namespaces": {"include": ["shop", "-bad-"]}}}
    ok(lab_apiserver, "POST", MC_PATH, obj)
    op = operators("op-a")

    def condition() -> dict[str, Any]:
        status = ok(lab_apiserver, "GET", f"{MC_PATH}/default").get("status") or {}
        return dict((status.get("conditions") or [{}])[0])

    wait_for(lambda: condition().get("reason") == "Invalid", what="Invalid condition")
    assert condition()["status"] == "False" and "'-bad-' is not a valid namespace name" in condition()["message"]
    assert op.metric("podmeter_configuration_valid") == 0
    ok(lab_apiserver, "PATCH", f"{MC_PATH}/default", {"spec": {"namespaces": {"include": ["shop"]}}},
       "application/merge-patch+json")
    wait_for(lambda: condition().get("reason") == "Valid", what="Accepted condition")
    assert condition()["status"] == "True" and condition()["observedGeneration"] == 2
    assert op.metric("podmeter_configuration_valid") == 1


async def test_missed_deletes_across_compaction_are_released_by_relist(lab_apiserver: LabServer) -> None:
    namespace(lab_apiserver, "batch")
    settings = ReflectorSettings(watch_timeout=(30.0, 31.0), request_timeout=5.0,
                                 backoff=Backoff(initial=0.05, cap=0.2))
    source = ReflectorPodSource(load_connection(str(lab_apiserver.kubeconfig)), settings)
    backend = MemoryIdentityBackend()
    op = Operator(source, backend, settings=OperatorSettings(sweep_period=0.5))
    task = asyncio.create_task(op.run())

    async def until(predicate: Callable[[], bool], what: str) -> None:
        for _ in range(300):
            if predicate():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    try:
        for i in range(6):
            pod = job_pod(i)
            pod["metadata"]["labels"]["app"] = f"app{i}"
            ok(lab_apiserver, "POST", "/api/v1/namespaces/batch/pods", pod)
        await until(lambda: len(backend.held()) == 6, "6 identities")
        lab_apiserver.admin.stall()  # the operator's stream goes silent: it misses the deletes
        for i in range(4):
            ok(lab_apiserver, "DELETE", f"/api/v1/namespaces/batch/pods/{APPS[i % 3]}-{i}")
        lab_apiserver.admin.compact()  # and their history is gone
        lab_apiserver.admin.unstall()
        lab_apiserver.admin.close_watches()  # re-watch from the old RV -> 410 -> relist
        expected = {IdentityKey("batch", ("app", "app4")), IdentityKey("batch", ("app", "app5"))}
        await until(lambda: set(backend.held()) == expected, "the relist's deletes")
        assert source.reflector is not None and source.reflector.stats.relists.get("expired", 0) >= 1
        await asyncio.sleep(0.6)  # a sweep runs: nothing is left for it to repair
        gc_released = metrics_registry(op).get_sample_value("podmeter_identity_gc_released_total")
        assert gc_released == 0 and op.last_sweep is not None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_no_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "podmeter", "operator", "--kubeconfig", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "does not exist" in out.stderr  # errors go to the log (stderr)


@pytest.mark.parametrize(("args", "message"), [
    (["--lease-duration", "5", "--renew-deadline", "6"], "--retry-period < --renew-deadline < --lease-duration"),
    (["--identity-range", "9-x"], "expected FIRST-LAST"),
    (["--listen", "nowhere"], "expected HOST:PORT"),
    (["--exclude-labels", "app,*"], "matches everything"),
])
def test_bad_options_are_clear_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from podmeter.cli.main import main

    assert main(["operator", *args]) == 2
    assert message in capsys.readouterr().err  # the operator logs its errors (stderr, JSON with --log-format json)


def test_label_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from podmeter.cli.main import build_parser
    from podmeter.cli.operator import settings_from
    from podmeter.runtime.operator_process import label_filter

    monkeypatch.setenv("PODMETER_EXCLUDE_LABELS", "example.com/*, run-id")
    monkeypatch.setenv("PODMETER_INCLUDE_LABELS", "job-name")
    f = label_filter(settings_from(build_parser().parse_args(["operator"])).identities)
    assert f.excludes("example.com/x") and f.excludes("run-id") and f.excludes("controller-uid")
    assert not f.excludes("job-name")


def test_etcd_backend_class_is_what_the_cli_builds() -> None:
    from podmeter.cli.main import build_parser
    from podmeter.cli.operator import settings_from
    from podmeter.runtime.operator_process import make_backend

    args = build_parser().parse_args(["operator", "--identity-backend", "etcd", "--identity-range", "300-400",
                                      "--etcd-endpoints", "http://127.0.0.1:1,http://127.0.0.1:2"])
    backend = make_backend(settings_from(args).identities)
    assert isinstance(backend, EtcdIdentityBackend)
    assert (backend._first, backend._last, backend._endpoints) == (300, 400, [("127.0.0.1", 1), ("127.0.0.1", 2)])


def test_sigterm_hands_the_lease_over_at_once(
    lab_apiserver: LabServer, operators: Callable[..., OperatorProcess]
) -> None:
    a = operators("op-a")
    wait_for(lambda: a.metric("podmeter_leader") == 1, what="op-a leads")
    b = operators("op-b")
    time.sleep(0.5)
    assert b.metric("podmeter_leader") == 0
    a.stop(signal.SIGTERM)
    assert a.proc.returncode == 0, a.log.read_text()
    stopped = time.monotonic()
    wait_for(lambda: b.metric("podmeter_leader") == 1, timeout=LEASE_S, what="op-b takes over")
    assert time.monotonic() - stopped < LEASE_S / 2  # no waiting for the lease to run out


async def test_ready_after_the_first_list_even_of_an_empty_cluster(lab_apiserver: LabServer) -> None:
    source = ReflectorPodSource(load_connection(str(lab_apiserver.kubeconfig)))
    op = Operator(source, MemoryIdentityBackend(), settings=OperatorSettings(sweep_period=60))
    task = asyncio.create_task(op.run())
    try:
        await asyncio.wait_for(op.ready.wait(), 5)  # long before the first sweep tick
        assert source.reflector is not None and source.reflector.synced.is_set()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
