"""Run a real agent (in-process, on its own event loop thread) against a lab API server over HTTP.

``AgentHarness(server)`` starts :class:`podmeter.runtime.agent.Agent` with the in-memory datapath (or a
given one, with the links it counts on) and short watch timeouts; ``filter()`` reads the datapath from the
agent's own loop, so the test never races the writer. ``Cluster(server)`` creates namespaces and pods the
way a kubelet and a user would: create (bound to a node), then write ``status.podIP(s)`` and phase through
the status subresource.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from lab_server import LabServer
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.adapters.kube.backoff import Backoff
from podmeter.adapters.kube.connection import load_connection
from podmeter.adapters.kube.reflector import ReflectorSettings
from podmeter.adapters.kube.resources import ResourceKind
from podmeter.model.datapath import Datapath
from podmeter.runtime.agent import Agent
from podmeter.runtime.datapaths import PodLinks
from podmeter.runtime.settings import AgentSettings
from waiting import wait_for

T = TypeVar("T")
OBSERVE = "podmeter.io/observe"


def fast_reflector(kind: ResourceKind) -> ReflectorSettings:
    return ReflectorSettings(page_size=50, watch_timeout=(20.0, 30.0), inactivity_grace=5.0,
                             request_timeout=5.0, backoff=Backoff(initial=0.2, cap=2.0))


class AgentHarness:
    def __init__(self, server: LabServer, node: str = "node-a", datapath: Datapath | None = None,
                 resync_interval: float = 3600.0, series_grace: float = 30.0,
                 reflector: Callable[[ResourceKind], ReflectorSettings] = fast_reflector,
                 links: PodLinks | None = None) -> None:
        self.datapath = datapath or MemoryDatapath(1024)
        settings = AgentSettings(node_name=node, resync_interval=resync_interval, retry_interval=0.2,
                                 reflector=reflector, series_grace=series_grace)
        self.agent = Agent(settings, load_connection(str(server.kubeconfig)), self.datapath, links=links)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> AgentHarness:
        self.thread.start()
        self.call(self.agent.start)
        wait_for(lambda: self.on_loop(self.agent.ready.is_set), what="agent ready")
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.agent.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()

    def call(self, coro_fn: Callable[[], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(30)

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        result: T = asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)
        return result

    def filter(self) -> set[str]:
        return self.on_loop(self.datapath.contents)

    def state(self) -> dict[str, Any]:
        return self.on_loop(self.agent.debug_state)

    def wait_filter(self, expected: set[str], timeout: float = 10.0) -> None:
        wait_for(lambda: self.filter() == expected, timeout, f"filter == {sorted(expected)}",
                 lambda: f"filter is {sorted(self.filter())}")


class Cluster:
    """Drives the lab API server like users and a kubelet would."""

    def __init__(self, server: LabServer) -> None:
        self.server = server

    def _ok(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        status, _, answer = self.server.request(method, path, body, content_type)
        assert 200 <= status < 300, f"{method} {path}: {status} {answer}"
        return answer

    def namespace(self, name: str, observe: bool = False) -> None:
        meta: dict[str, Any] = {"name": name}
        if observe:
            meta["annotations"] = {OBSERVE: "true"}
        self._ok("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": meta})

    def annotate_namespace(self, name: str, observe: bool | None) -> None:
        value = None if observe is None else ("true" if observe else "false")
        self._ok("PATCH", f"/api/v1/namespaces/{name}", {"metadata": {"annotations": {OBSERVE: value}}},
                 "application/merge-patch+json")

    def pod(self, ns: str, name: str, ip: str | None, node: str = "node-a", observe: bool = False,
            phase: str = "Running", host_network: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "labels": {"app": name}}
        if observe:
            meta["annotations"] = {OBSERVE: "true"}
        spec = {"nodeName": node, "hostNetwork": host_network, "containers": [{"name": "c", "image": "busybox"}]}
        created: dict[str, Any] = self._ok("POST", f"/api/v1/namespaces/{ns}/pods",
                                          {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
        if ip is not None:
            self.set_status(ns, name, ip, phase)
        return created

    def set_status(self, ns: str, name: str, ip: str, phase: str = "Running") -> None:
        status = {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}]}
        self._ok("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status},
                 "application/merge-patch+json")

    def annotate_pod(self, ns: str, name: str, observe: bool | None) -> None:
        value = None if observe is None else ("true" if observe else "false")
        self._ok("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}", {"metadata": {"annotations": {OBSERVE: value}}},
                 "application/merge-patch+json")

    def delete_pod(self, ns: str, name: str) -> None:
        self._ok("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}")

    def configuration(self, spec: dict[str, Any]) -> int:
        """Create or replace the ``default`` MetricsConfiguration; returns the HTTP status."""
        path = "/apis/podmeter.io/v1alpha1/metricsconfigurations"
        body = {"apiVersion": "podmeter.io/v1alpha1", "kind": "MetricsConfiguration",
                "metadata": {"name": "default"}, "spec": spec}
        status, _, _ = self.server.request("GET", f"{path}/default")
        if status == 404:
            status, _, _ = self.server.request("POST", path, body)
        else:
            status, _, _ = self.server.request("PATCH", f"{path}/default", {"spec": spec},
                                                    "application/merge-patch+json")
        return status
