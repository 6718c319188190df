"""Real Python client libraries list and watch against the lab API server: the official ``kubernetes``
client and lightkube (the one podmeter uses), with their own kubeconfig loading and auth."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab_server import LabServer


@pytest.fixture(scope="module")
def srv() -> Iterator[LabServer]:
    with LabServer(process=False, tls=True) as server:
        for name in ("a", "b"):
            server.request(
                "POST",
                "/api/v1/namespaces/default/pods",
                {
                    "metadata": {"name": name, "labels": {"app": name}},
                    "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeName": "node-a"},
                },
            )
        yield server


def later(delay: float, action: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay), action()), daemon=True)
    thread.start()
    return thread


def test_official_client_lists_and_watches(srv: LabServer) -> None:
    kubernetes = pytest.importorskip("kubernetes")
    api_client = kubernetes.config.new_client_from_config(config_file=str(srv.kubeconfig))
    v1 = kubernetes.client.CoreV1Api(api_client)
    pods = v1.list_namespaced_pod("default", label_selector="app=a")
    assert [p.metadata.name for p in pods.items] == ["a"]
    everything = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-a", limit=1)
    assert everything.metadata._continue and len(everything.items) == 1
    rv = everything.metadata.resource_version

    thread = later(
        0.3,
        lambda: srv.request(
            "PATCH",
            "/api/v1/namespaces/default/pods/b/status",
            {"status": {"podIP": "10.1.0.2"}},
            "application/merge-patch+json",
        ),
    )
    seen = []
    for event in kubernetes.watch.Watch().stream(
        v1.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=2, allow_watch_bookmarks=True
    ):
        seen.append((event["type"], event["object"].metadata.name, event["object"].status.pod_ip))
    thread.join()
    assert ("MODIFIED", "b", "10.1.0.2") in seen
    namespaces = kubernetes.client.CoreV1Api(api_client).list_namespace()
    assert "default" in [n.metadata.name for n in namespaces.items]
    leases = kubernetes.client.CoordinationV1Api(api_client).list_namespaced_lease("default")
    assert leases.items == []


def test_lightkube_lists_and_watches(srv: LabServer) -> None:
    lightkube = pytest.importorskip("lightkube")
    from lightkube.resources.core_v1 import Pod

    client = lightkube.Client(config=lightkube.KubeConfig.from_file(str(srv.kubeconfig)))
    names = [p.metadata.name for p in client.list(Pod, namespace="default", chunk_size=1)]
    assert names == ["a", "b"]
    thread = later(0.3, lambda: srv.request("DELETE", "/api/v1/namespaces/default/pods/a"))
    seen = []
    for event_type, obj in client.watch(Pod, namespace="default", fields={"spec.nodeName": "node-a"}, server_timeout=2):
        seen.append((event_type, obj.metadata.name))
        if event_type == "DELETED":
            break
    thread.join()
    assert seen[:2] == [("ADDED", "a"), ("ADDED", "b")]
    assert ("MODIFIED", "a") in seen and seen[-1] == ("DELETED", "a")
