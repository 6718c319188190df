"""The operator's tasks are supervised: one that dies is logged with its traceback, counted
(``podmeter_task_failures_total{task}``), turns ``/healthz`` to 503 and ends the operator with its error,
so ``podmeter operator`` exits non-zero and Kubernetes restarts it (an operator whose pod reflector had
died used to stay ready while applying nothing)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import pytest

from etcd_server import EtcdServer, etcd
from lab_server import LabServer, lab_apiserver
from podmeter.adapters.http import serve
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.kube.reflector import Reflector
from podmeter.adapters.kube.resources import PODS
from podmeter.model.deltas import Replace
from podmeter.model.records import Pod
from podmeter.model.store import Change
from podmeter.runtime.operator import Operator, ReflectorPodSource
from podmeter.runtime.operator_process import http_app, metrics_registry
from podmeter.runtime.settings import OperatorSettings

__all__ = ["etcd", "lab_apiserver"]


class DyingSource:
    """A pod source that lists (an empty cluster), then fails when ``die`` is set."""

    reflector = None

    def __init__(self) -> None:
        self.die = asyncio.Event()

    async def events(self) -> AsyncIterator[Change[Pod] | None]:
        yield None
        await self.die.wait()
        raise RuntimeError("planted: the pod watch broke")

    def pods(self) -> Iterable[Pod]:
        return []


async def status(port: int, path: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}{path}") as r:
        return r.status


async def test_a_dead_pod_source_is_logged_counted_turns_healthz_503_and_ends_run(
        caplog: pytest.LogCaptureFixture) -> None:
    source = DyingSource()
    op = Operator(source, MemoryIdentityBackend(), settings=OperatorSettings(sweep_period=60))
    runner, port = await serve(http_app(op), "127.0.0.1:0")
    try:
        task = asyncio.create_task(op.run())
        await asyncio.wait_for(op.ready.wait(), 5)
        assert (await status(port, "/healthz"), await status(port, "/readyz")) == (200, 200)
        source.die.set()
        with pytest.raises(RuntimeError, match="planted"):
            await asyncio.wait_for(task, 5)
        assert await status(port, "/healthz") == 503
        assert metrics_registry(op).get_sample_value("podmeter_task_failures_total", {"task": "reflector-pods"}) == 1
        assert metrics_registry(op).get_sample_value("process_start_time_seconds")  # what the restart alert reads
        died = [r for r in caplog.records if r.levelno == logging.ERROR and "task reflector-pods died" in r.message]
        assert died and died[0].exc_info is not None  # with its traceback
    finally:
        await runner.cleanup()


async def test_the_pod_reflector_dying_ends_the_sources_events(
        lab_apiserver: LabServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real source: its reflector task lists, then dies; events() must raise instead of waiting."""

    async def list_then_die(self: Reflector[Pod]) -> None:
        await self.sink(Replace(PODS.collection, []))
        await asyncio.sleep(0.1)
        raise RuntimeError("planted in the reflector")

    monkeypatch.setattr(Reflector, "run", list_then_die)
    source = ReflectorPodSource(load_connection(str(lab_apiserver.kubeconfig)))
    op = Operator(source, MemoryIdentityBackend(), settings=OperatorSettings(sweep_period=60))
    with pytest.raises(RuntimeError, match="planted in the reflector"):
        await asyncio.wait_for(op.run(), 5)
    assert op.ready.is_set() and not op.supervisor.healthy
    assert dict(op.supervisor.failures) == {"reflector-pods": 1}


async def test_a_task_that_returns_is_a_failure_too() -> None:
    """The election (or any task) ending without an error is as wrong as dying: it is counted once."""
    op = Operator(DyingSource(), MemoryIdentityBackend(), settings=OperatorSettings(sweep_period=60))

    async def housekeeping_ends() -> None:
        await asyncio.sleep(0.05)

    op._housekeeping = housekeeping_ends  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="task housekeeping ended"):
        await asyncio.wait_for(op.run(), 5)
    assert dict(op.supervisor.failures) == {"housekeeping": 1}


async def test_the_etcd_lease_keepalive_is_supervised(etcd: EtcdServer) -> None:
    """Without its keepalive the operator's references expire unseen (F15): its death stops the operator."""
    backend = EtcdIdentityBackend([etcd.endpoint], lease_ttl=3, owner="op-keepalive")

    async def keepalive_dies() -> None:
        await asyncio.sleep(0.1)
        raise RuntimeError("planted in the keepalive")

    backend._keep_lease = keepalive_dies  # type: ignore[method-assign]
    op = Operator(DyingSource(), backend, settings=OperatorSettings(sweep_period=60))
    with pytest.raises(RuntimeError, match="planted in the keepalive"):
        await asyncio.wait_for(op.run(), 10)
    assert dict(op.supervisor.failures) == {"etcd-lease-op-keepalive": 1}


def test_the_operator_process_exits_non_zero_when_its_pod_reflector_dies(lab_apiserver: LabServer) -> None:
    script = (
        "import sys, runpy\n"
        "from podmeter.adapters.kube import reflector as r\n"
        "async def boom(self):\n"
        "    raise RuntimeError('planted')\n"
        "r.Reflector.run = boom\n"
        "sys.argv = ['podmeter'] + sys.argv[1:]\n"
        "runpy.run_module('podmeter', run_name='__main__')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, "operator", "--kubeconfig", str(lab_apiserver.kubeconfig),
                             "--listen", "127.0.0.1:0", "--lease-namespace", "default", "--no-publish-endpoints"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out: Any = b""
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 1, out
    assert b"task reflector-pods died: RuntimeError: planted" in out and b"Traceback" in out
