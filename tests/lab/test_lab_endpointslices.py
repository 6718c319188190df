"""The lab's EndpointSlice controller (podmeter.lab.endpointslices) against the lab API server over real
HTTP: slices follow Services' selectors and pods as kube-controller-manager's controller makes them, only
the differences are written, and churn leaves no slice or allocation behind. Plus properties of the pure
core: the slices reached step by step equal a recompute from scratch."""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lab_server import LabServer
from podmeter.lab.endpointslices import (
    CONTROLLER_NAME,
    MANAGED_BY,
    SERVICE_NAME,
    EndpointSliceController,
    actual,
    content_of,
    desired_slices,
    plan,
    wanted,
)
from podmeter.lab.kube import KubeClient
from waiting import wait_for

MERGE = "application/merge-patch+json"
_names = itertools.count()


@pytest.fixture(scope="module")
def srv() -> Iterator[LabServer]:
    with LabServer(process=False) as server:
        yield server


@pytest.fixture
def ns(srv: LabServer) -> str:
    name = f"es-{next(_names)}"
    assert srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})[0] == 201
    return name


def start(srv: LabServer, **options: Any) -> EndpointSliceController:
    controller = EndpointSliceController(KubeClient.from_kubeconfig(str(srv.kubeconfig)), **options)
    controller.start()
    return controller


@pytest.fixture
def ctl(srv: LabServer) -> Iterator[EndpointSliceController]:
    controller = start(srv)
    yield controller
    controller.stop()


def add_pod(srv: LabServer, ns: str, name: str, ip: str | None, *, labels: dict[str, str] | None = None,
            ready: bool = True, node: str = "node-a", port: int = 8080, phase: str = "Running") -> dict[str, Any]:
    body = {
        "metadata": {"name": name, "labels": labels if labels is not None else {"app": "web"}},
        "spec": {"nodeName": node, "containers": [
            {"name": "c", "image": "busybox", "ports": [{"name": "http", "containerPort": port}]}]},
    }
    status, _, pod = srv.request("POST", f"/api/v1/namespaces/{ns}/pods", body)
    assert status == 201, pod
    if ip is not None:
        set_status(srv, ns, name, ip=ip, ready=ready, phase=phase)
    return pod  # type: ignore[no-any-return]


def set_status(srv: LabServer, ns: str, name: str, *, ip: str, ready: bool = True, phase: str = "Running") -> None:
    status = {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}
    answer = srv.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status}, MERGE)
    assert answer[0] == 200, answer


def add_service(srv: LabServer, ns: str, name: str = "web", **spec: Any) -> dict[str, Any]:
    body = {"metadata": {"name": name, "labels": {"team": "blue"}},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
                     **spec}}
    status, _, svc = srv.request("POST", f"/api/v1/namespaces/{ns}/services", body)
    assert status == 201, svc
    return svc  # type: ignore[no-any-return]


def slices(srv: LabServer, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = srv.request("GET", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices")[2][
        "items"]
    return items


def managed_slices(srv: LabServer, ns: str) -> list[dict[str, Any]]:
    return [s for s in slices(srv, ns) if s["metadata"].get("labels", {}).get(MANAGED_BY) == CONTROLLER_NAME]


def items(srv: LabServer, path: str) -> list[dict[str, Any]]:
    listed: list[dict[str, Any]] = srv.request("GET", path)[2]["items"]
    return listed


def converged(srv: LabServer, ns: str) -> bool:
    want = wanted(items(srv, f"/api/v1/namespaces/{ns}/services"), items(srv, f"/api/v1/namespaces/{ns}/pods"))
    return actual(slices(srv, ns)) == want


def wait_converged(srv: LabServer, ns: str, timeout: float = 15.0) -> None:
    wait_for(lambda: converged(srv, ns), timeout, f"the slices of {ns} to match their services and pods",
             lambda: (actual(slices(srv, ns)), wanted(items(srv, f"/api/v1/namespaces/{ns}/services"),
                                                     items(srv, f"/api/v1/namespaces/{ns}/pods"))))


def endpoint_names(slice_: dict[str, Any]) -> list[str]:
    return [e.get("targetRef", {}).get("name", "?") for e in slice_["endpoints"] or []]


def one_slice(srv: LabServer, ns: str, predicate: Any = None) -> dict[str, Any]:
    """Wait until the namespace has exactly one managed slice (matching ``predicate``); return it."""
    found: list[dict[str, Any]] = []

    def check() -> bool:
        found[:] = managed_slices(srv, ns)
        return len(found) == 1 and (predicate is None or predicate(found[0]))

    wait_for(check, 10, "one managed slice", lambda: found)
    return found[0]


# --- the controller over HTTP ---------------------------------------------------------------------------------


def test_three_pods_and_a_service_make_one_slice(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    pods = [add_pod(srv, ns, f"web-{i}", f"10.244.0.{i + 2}") for i in range(3)]
    add_pod(srv, ns, "other", "10.244.0.9", labels={"app": "db"})
    svc = add_service(srv, ns)
    eps = one_slice(srv, ns, lambda s: len(s["endpoints"] or []) == 3)
    meta = eps["metadata"]
    assert meta["name"].startswith("web-") and len(meta["name"]) == len("web-") + 5
    assert meta["generateName"] == "web-"
    assert meta["labels"] == {"team": "blue", SERVICE_NAME: "web", MANAGED_BY: CONTROLLER_NAME}
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Service", "name": "web",
                                        "uid": svc["metadata"]["uid"], "controller": True,
                                        "blockOwnerDeletion": True}]
    assert eps["addressType"] == "IPv4"
    assert eps["ports"] == [{"name": "http", "protocol": "TCP", "port": 8080}]  # targetPort "http" resolved
    assert eps["endpoints"] == [
        {"addresses": [f"10.244.0.{i + 2}"], "conditions": {"ready": True, "serving": True, "terminating": False},
         "targetRef": {"kind": "Pod", "namespace": ns, "name": f"web-{i}", "uid": pods[i]["metadata"]["uid"]},
         "nodeName": "node-a"}
        for i in range(3)
    ]
    assert ctl.wait_idle(10)
    assert ctl.stats.created == 1 and ctl.stats.deleted == 0


def test_pod_changes_update_the_same_slice(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    for i in range(3):
        add_pod(srv, ns, f"web-{i}", f"10.244.1.{i + 2}")
    add_service(srv, ns)
    name = one_slice(srv, ns, lambda s: len(s["endpoints"] or []) == 3)["metadata"]["name"]
    assert srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/web-1?gracePeriodSeconds=0")[0] == 200
    eps = one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-0", "web-2"])
    assert eps["metadata"]["name"] == name and eps["metadata"]["generation"] == 2
    set_status(srv, ns, "web-0", ip="10.244.1.2", ready=False)
    eps = one_slice(srv, ns, lambda s: s["endpoints"][0]["conditions"]["ready"] is False)
    assert eps["endpoints"][0]["conditions"] == {"ready": False, "serving": False, "terminating": False}
    set_status(srv, ns, "web-2", ip="10.244.1.4", phase="Succeeded")  # finished pods leave
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-0"])
    add_pod(srv, ns, "web-3", None)  # no IP yet: not an endpoint
    add_pod(srv, ns, "web-4", "10.244.1.9")
    eps = one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-0", "web-4"])
    assert eps["metadata"]["name"] == name
    wait_converged(srv, ns)


def test_a_terminating_pod_stays_as_not_ready() -> None:
    with LabServer(process=False, args=["--graceful-pod-deletion"]) as srv:
        ns = "term"
        srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        controller = start(srv)
        try:
            add_pod(srv, ns, "web-0", "10.244.2.2")
            add_service(srv, ns)
            one_slice(srv, ns, lambda s: len(s["endpoints"] or []) == 1)
            assert srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/web-0")[0] == 200  # graceful: Terminating
            eps = one_slice(srv, ns, lambda s: s["endpoints"] and s["endpoints"][0]["conditions"]["terminating"])
            assert eps["endpoints"][0]["conditions"] == {"ready": False, "serving": True, "terminating": True}
            srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/web-0?gracePeriodSeconds=0")
            eps = one_slice(srv, ns, lambda s: not s["endpoints"])
            assert (eps["endpoints"], eps["ports"]) == (None, None)  # the placeholder
        finally:
            controller.stop()


def test_the_slice_follows_selector_and_port_changes(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    add_pod(srv, ns, "a-0", "10.244.3.2", labels={"app": "a"})
    add_pod(srv, ns, "b-0", "10.244.3.3", labels={"app": "b"}, port=9090)
    add_service(srv, ns, selector={"app": "a"})
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["a-0"])
    srv.request("PATCH", f"/api/v1/namespaces/{ns}/services/web", {"spec": {"selector": {"app": "b"}}}, MERGE)
    eps = one_slice(srv, ns, lambda s: endpoint_names(s) == ["b-0"])
    assert eps["ports"] == [{"name": "http", "protocol": "TCP", "port": 9090}]
    srv.request("PATCH", f"/api/v1/namespaces/{ns}/services/web",
                {"spec": {"ports": [{"name": "metrics", "port": 81, "targetPort": 7070, "appProtocol": "http"}]}},
                MERGE)
    eps = one_slice(srv, ns, lambda s: s["ports"][0]["name"] == "metrics")
    assert eps["ports"] == [{"name": "metrics", "protocol": "TCP", "port": 7070, "appProtocol": "http"}]
    srv.request("PATCH", f"/api/v1/namespaces/{ns}/services/web", {"metadata": {"labels": {"team": "red"}}}, MERGE)
    one_slice(srv, ns, lambda s: s["metadata"]["labels"].get("team") == "red")
    wait_converged(srv, ns)


def test_pods_with_different_ports_get_different_slices(srv: LabServer, ns: str,
                                                        ctl: EndpointSliceController) -> None:
    add_pod(srv, ns, "p-8080", "10.244.4.2")
    add_pod(srv, ns, "p-9090", "10.244.4.3", port=9090)
    body = {"metadata": {"name": "bare", "labels": {"app": "web"}},
            "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "busybox"}]}}
    srv.request("POST", f"/api/v1/namespaces/{ns}/pods", body)
    set_status(srv, ns, "bare", ip="10.244.4.4")
    add_service(srv, ns)
    wait_for(lambda: len(managed_slices(srv, ns)) == 3, 10, "three slices")
    by_ports = {str(s["ports"]): endpoint_names(s) for s in managed_slices(srv, ns)}
    assert by_ports == {
        str([{"name": "http", "protocol": "TCP", "port": 8080}]): ["p-8080"],
        str([{"name": "http", "protocol": "TCP", "port": 9090}]): ["p-9090"],
        "None": ["bare"],  # no container port of that name: an endpoint without ports
    }
    wait_converged(srv, ns)


def test_services_without_a_selector_are_left_alone(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    add_pod(srv, ns, "web-0", "10.244.5.2")
    add_service(srv, ns, name="manual", selector=None)
    own = {"metadata": {"name": "manual-1", "labels": {SERVICE_NAME: "manual"}}, "addressType": "IPv4",
           "endpoints": [{"addresses": ["192.0.2.7"]}], "ports": [{"port": 5432}]}
    assert srv.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", own)[0] == 201
    add_service(srv, ns)
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-0"])
    srv.request("PATCH", f"/api/v1/namespaces/{ns}/services/web", {"spec": {"selector": None}}, MERGE)
    wait_for(lambda: not managed_slices(srv, ns), 10, "the managed slice of a service that lost its selector to go")
    assert [s["metadata"]["name"] for s in slices(srv, ns)] == ["manual-1"]  # never touched
    assert ctl.wait_idle(10)


def test_deleting_the_service_deletes_its_slices(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    add_pod(srv, ns, "web-0", "10.244.6.2")
    old = add_service(srv, ns)
    first = one_slice(srv, ns)
    assert srv.request("DELETE", f"/api/v1/namespaces/{ns}/services/web")[0] == 200
    wait_for(lambda: not managed_slices(srv, ns), 10, "the slices of a deleted service to go")
    new = add_service(srv, ns)  # same name, another uid: a new slice, owned by the new one
    second = one_slice(srv, ns)
    assert second["metadata"]["name"] != first["metadata"]["name"]
    assert second["metadata"]["ownerReferences"][0]["uid"] == new["metadata"]["uid"] != old["metadata"]["uid"]


def test_deleted_or_tampered_slices_are_restored(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    add_pod(srv, ns, "web-0", "10.244.7.2")
    add_service(srv, ns)
    eps = one_slice(srv, ns)
    path = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/{eps['metadata']['name']}"
    srv.request("PATCH", path, {"endpoints": [{"addresses": ["10.9.9.9"]}]}, MERGE)
    restored = one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-0"])
    assert restored["metadata"]["name"] == eps["metadata"]["name"]
    srv.request("DELETE", path)
    recreated = one_slice(srv, ns, lambda s: s["metadata"]["name"] != eps["metadata"]["name"])
    assert endpoint_names(recreated) == ["web-0"]
    # a copy the controller did not make, but labelled as its own: it is one too many, and goes
    extra = {k: v for k, v in recreated.items() if k != "metadata"}
    extra["metadata"] = {"name": "web-extra", "labels": recreated["metadata"]["labels"],
                         "ownerReferences": recreated["metadata"]["ownerReferences"]}
    srv.request("POST", f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", extra)
    wait_for(lambda: len(managed_slices(srv, ns)) == 1, 10, "the duplicate to go")
    wait_converged(srv, ns)


def test_only_differences_are_written(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    for i in range(3):
        add_pod(srv, ns, f"web-{i}", f"10.244.8.{i + 2}")
    add_service(srv, ns)
    one_slice(srv, ns, lambda s: len(s["endpoints"] or []) == 3)
    assert ctl.wait_idle(10)
    writes = (ctl.stats.created, ctl.stats.updated, ctl.stats.deleted)
    passes = ctl.stats.passes
    for i in range(3):  # changes the controller sees but that change no endpoint
        srv.request("PATCH", f"/api/v1/namespaces/{ns}/pods/web-{i}", {"metadata": {"annotations": {"x": "1"}}},
                    MERGE)
    wait_for(lambda: ctl.stats.passes > passes, 10, "a pass")
    assert ctl.wait_idle(10)
    assert (ctl.stats.created, ctl.stats.updated, ctl.stats.deleted) == writes


def test_placeholder_headless_label_and_zones(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    srv.request("POST", "/api/v1/nodes", {"metadata": {"name": "zoned", "labels": {
        "topology.kubernetes.io/zone": "zone-a"}}})
    try:
        add_service(srv, ns, clusterIP="None")
        eps = one_slice(srv, ns)
        assert (eps["addressType"], eps["endpoints"], eps["ports"]) == ("IPv4", None, None)
        assert eps["metadata"]["labels"]["service.kubernetes.io/headless"] == ""
        add_pod(srv, ns, "web-0", "10.244.9.2", node="zoned")
        eps = one_slice(srv, ns, lambda s: bool(s["endpoints"]))
        assert eps["endpoints"][0]["zone"] == "zone-a" and eps["endpoints"][0]["nodeName"] == "zoned"
    finally:
        srv.request("DELETE", "/api/v1/nodes/zoned")


def test_at_most_max_endpoints_per_slice(srv: LabServer, ns: str) -> None:
    controller = start(srv, max_endpoints_per_slice=2)
    try:
        for i in range(5):
            add_pod(srv, ns, f"web-{i}", f"10.244.10.{i + 2}")
        add_service(srv, ns)
        wait_for(lambda: sorted(len(s["endpoints"] or []) for s in managed_slices(srv, ns)) == [1, 2, 2], 10,
                 "three slices of at most two endpoints")
        assert sorted(n for s in managed_slices(srv, ns) for n in endpoint_names(s)) == [f"web-{i}" for i in range(5)]
    finally:
        controller.stop()


def test_pods_of_other_namespaces_are_not_selected(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    other = f"{ns}-other"
    srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": other}})
    add_pod(srv, other, "web-elsewhere", "10.244.11.2")
    add_pod(srv, ns, "web-here", "10.244.11.3")
    add_service(srv, ns)
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-here"])
    assert managed_slices(srv, other) == []


def test_stop_is_prompt_and_the_controller_restarts_level_triggered(srv: LabServer, ns: str) -> None:
    watches = srv.admin.stats()["openWatches"]
    controller = start(srv)
    add_pod(srv, ns, "web-0", "10.244.12.2")
    add_service(srv, ns)
    one_slice(srv, ns)
    started = time.monotonic()
    controller.stop()
    assert time.monotonic() - started < 2.0
    wait_for(lambda: srv.admin.stats()["openWatches"] == watches, 5, "the controller's watches to close")
    add_pod(srv, ns, "web-1", "10.244.12.3")  # while nobody watches
    srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/web-0?gracePeriodSeconds=0")
    again = start(srv)
    try:
        one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-1"])
    finally:
        again.stop()


def test_the_controller_survives_the_servers_faults(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    add_pod(srv, ns, "web-0", "10.244.13.2")
    add_service(srv, ns)
    one_slice(srv, ns)
    relists = ctl.stats.relists
    srv.admin.compact()
    srv.admin.close_watches()  # every watch resumes from an RV the server has forgotten: 410, relist
    add_pod(srv, ns, "web-1", "10.244.13.3")
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-0", "web-1"])
    wait_for(lambda: ctl.stats.relists > relists, 10, "an informer to relist")  # those behind the new floor
    srv.admin.fail(3, code=503, verb="patch")  # the controller's writes are retried like a client library's
    srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/web-0?gracePeriodSeconds=0")
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-1"])
    srv.admin.fail(4, code=503, verb="watch")  # watches refused: back off, relist
    srv.admin.close_watches()
    add_pod(srv, ns, "web-2", "10.244.13.4")
    one_slice(srv, ns, lambda s: endpoint_names(s) == ["web-1", "web-2"])
    wait_converged(srv, ns)


def test_churn_converges_and_leaks_nothing(srv: LabServer, ns: str, ctl: EndpointSliceController) -> None:
    baseline = srv.admin.stats()["serviceAllocations"]
    rng = random.Random(27)
    apps = ["a", "b", "c"]
    pods: dict[str, str] = {}
    services: set[str] = set()
    for step in range(150):
        op = rng.random()
        if op < 0.35 or not pods:
            name = f"p{step}"
            add_pod(srv, ns, name, f"10.245.{step // 250}.{step % 250 + 1}", labels={"app": rng.choice(apps)},
                    ready=rng.random() < 0.8, port=rng.choice([8080, 9090]))
            pods[name] = name
        elif op < 0.5:
            name = rng.choice(sorted(pods))
            srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}?gracePeriodSeconds=0")
            del pods[name]
        elif op < 0.6:
            name = rng.choice(sorted(pods))
            srv.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}", {"metadata": {"labels": {
                "app": rng.choice(apps)}}}, MERGE)
        elif op < 0.75:
            name = f"s-{rng.choice(apps)}-{rng.randrange(3)}"
            if name in services:
                srv.request("DELETE", f"/api/v1/namespaces/{ns}/services/{name}")
                services.discard(name)
            else:
                add_service(srv, ns, name=name, selector={"app": rng.choice(apps)},
                            type=rng.choice(["ClusterIP", "NodePort"]))
                services.add(name)
        elif op < 0.85 and services:
            name = rng.choice(sorted(services))
            srv.request("PATCH", f"/api/v1/namespaces/{ns}/services/{name}",
                        {"spec": {"selector": {"app": rng.choice(apps)}}}, MERGE)
        else:
            name = rng.choice(sorted(pods))
            set_status(srv, ns, name, ip=f"10.246.{step // 250}.{step % 250 + 1}", ready=rng.random() < 0.5)
    wait_converged(srv, ns, timeout=30)
    assert ctl.wait_idle(15)
    assert ctl.stats.errors == 0
    for name in services:
        srv.request("DELETE", f"/api/v1/namespaces/{ns}/services/{name}")
    wait_for(lambda: not managed_slices(srv, ns), 15, "no slice left")
    assert srv.admin.stats()["serviceAllocations"] == baseline  # every ClusterIP and NodePort released


# --- a property over real HTTP -----------------------------------------------------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pod"), st.integers(0, 5), st.sampled_from(["a", "b"]), st.booleans(),
                  st.sampled_from([8080, 9090])),
        st.tuples(st.just("unpod"), st.integers(0, 5)),
        st.tuples(st.just("svc"), st.integers(0, 2), st.sampled_from(["a", "b", None])),
        st.tuples(st.just("unsvc"), st.integers(0, 2)),
    ),
    max_size=14,
)


@pytest.fixture(scope="module")
def shared_ctl(srv: LabServer) -> Iterator[EndpointSliceController]:
    controller = start(srv)
    yield controller
    controller.stop()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_http_slices_equal_a_recompute_after_any_changes(srv: LabServer, shared_ctl: EndpointSliceController,
                                                         ops: list[tuple[Any, ...]]) -> None:
    ns = f"prop-{uuid.uuid4().hex[:8]}"
    srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    pods: set[int] = set()
    services: set[int] = set()
    for op in ops:
        if op[0] == "pod":
            _, i, app, ready, port = op
            if i in pods:
                srv.request("PATCH", f"/api/v1/namespaces/{ns}/pods/p{i}", {"metadata": {"labels": {"app": app}}},
                            MERGE)
                set_status(srv, ns, f"p{i}", ip=f"10.247.0.{i + 1}", ready=ready)
            else:
                add_pod(srv, ns, f"p{i}", f"10.247.0.{i + 1}", labels={"app": app}, ready=ready, port=port)
                pods.add(i)
        elif op[0] == "unpod" and op[1] in pods:
            srv.request("DELETE", f"/api/v1/namespaces/{ns}/pods/p{op[1]}?gracePeriodSeconds=0")
            pods.discard(op[1])
        elif op[0] == "svc":
            _, i, app = op
            selector = {"app": app} if app else None
            if i in services:
                srv.request("PATCH", f"/api/v1/namespaces/{ns}/services/s{i}", {"spec": {"selector": selector}},
                            MERGE)
            else:
                add_service(srv, ns, name=f"s{i}", selector=selector)
                services.add(i)
        elif op[0] == "unsvc" and op[1] in services:
            srv.request("DELETE", f"/api/v1/namespaces/{ns}/services/s{op[1]}")
            services.discard(op[1])
    wait_converged(srv, ns)
    srv.request("DELETE", f"/api/v1/namespaces/{ns}")  # services, pods and slices go with it
    wait_for(lambda: not slices(srv, ns), 10, "nothing left in a deleted namespace")


# --- the pure core: step by step equals from scratch -------------------------------------------------------


class FakeSlices:
    """An in-memory slice store applying :func:`plan`'s actions as the API server would."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.writes = 0

    def apply(self, action: Any) -> None:
        self.rv += 1
        self.writes += 1
        if action.verb == "create":
            name = f"{action.body['metadata']['generateName']}{self.rv:05d}"
            meta = {**action.body["metadata"], "name": name, "resourceVersion": str(self.rv)}
            self.items[f"{action.namespace}/{name}"] = {**{k: v for k, v in action.body.items()
                                                           if k not in ("metadata", "kind", "apiVersion")},
                                                        "metadata": meta}
        elif action.verb == "update":
            current = self.items[f"{action.namespace}/{action.name}"]
            labels = {k: v for k, v in action.body["metadata"]["labels"].items() if v is not None}
            current["metadata"] = {**current["metadata"], "labels": labels, "resourceVersion": str(self.rv),
                                   "ownerReferences": action.body["metadata"]["ownerReferences"]}
            current["endpoints"], current["ports"] = action.body["endpoints"], action.body["ports"]
        else:
            del self.items[f"{action.namespace}/{action.name}"]

    def of(self, ns: str, service: str) -> list[dict[str, Any]]:
        return [s for s in self.items.values() if s["metadata"]["namespace"] == ns
                and s["metadata"]["labels"][SERVICE_NAME] == service]


def reconcile(store: FakeSlices, services: dict[str, dict[str, Any]], pods: list[dict[str, Any]],
              max_per_slice: int) -> int:
    """One controller pass over every service name that exists or has slices; the writes it made."""
    before = store.writes
    names = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in services.values()}
    names |= {(s["metadata"]["namespace"], s["metadata"]["labels"][SERVICE_NAME]) for s in store.items.values()}
    for ns, name in sorted(names):
        svc = services.get(f"{ns}/{name}")
        desired = desired_slices(svc, pods, None, max_per_slice) if svc is not None else []
        for action in plan(ns, name, svc, desired, store.of(ns, name)):
            store.apply(action)
    return store.writes - before


def pure_pod(i: int, app: str, ready: bool, port: int, family: str) -> dict[str, Any]:
    ips = [{"ip": f"10.0.0.{i + 1}"}] + ([{"ip": f"fd00::{i + 1}"}] if family == "dual" else [])
    return {"metadata": {"name": f"p{i}", "namespace": "n", "uid": f"uid-{i}", "labels": {"app": app}},
            "spec": {"nodeName": "node-a", "containers": [{"ports": [{"name": "http", "containerPort": port,
                                                                      "protocol": "TCP"}]}]},
            "status": {"phase": "Running", "podIPs": ips,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def pure_service(i: int, app: str | None, generation: int, dual: bool) -> dict[str, Any]:
    return {"metadata": {"name": f"s{i}", "namespace": "n", "uid": f"svc-{i}-{generation}"},
            "spec": {"selector": {"app": app} if app else None, "clusterIP": "10.96.0.10",
                     "ipFamilies": ["IPv4", "IPv6"] if dual else ["IPv4"],
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}


PURE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pod"), st.integers(0, 7), st.sampled_from(["a", "b"]), st.booleans(),
                  st.sampled_from([8080, 9090]), st.sampled_from(["v4", "dual"])),
        st.tuples(st.just("unpod"), st.integers(0, 7)),
        st.tuples(st.just("svc"), st.integers(0, 2), st.sampled_from(["a", "b", None]), st.booleans()),
        st.tuples(st.just("unsvc"), st.integers(0, 2)),
        st.tuples(st.just("tamper"), st.integers(0, 20)),
    ),
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(ops=PURE_OPS, max_per_slice=st.sampled_from([1, 2, 100]), lag=st.integers(0, 3))
def test_slices_reached_step_by_step_equal_a_recompute(ops: list[tuple[Any, ...]], max_per_slice: int,
                                                       lag: int) -> None:
    store = FakeSlices()
    pods: dict[int, dict[str, Any]] = {}
    services: dict[str, dict[str, Any]] = {}
    generation = itertools.count()
    for step, op in enumerate(ops):
        if op[0] == "pod":
            pods[op[1]] = pure_pod(*op[1:])
        elif op[0] == "unpod":
            pods.pop(op[1], None)
        elif op[0] == "svc":
            _, i, app, dual = op
            old = services.get(f"n/s{i}")
            svc = pure_service(i, app, next(generation), dual)
            if old is not None:
                svc["metadata"]["uid"] = old["metadata"]["uid"]
                svc["spec"]["ipFamilies"] = old["spec"]["ipFamilies"]  # ipFamilies stay (the server's rule)
            services[f"n/s{i}"] = svc
        elif op[0] == "unsvc":
            services.pop(f"n/s{op[1]}", None)
        elif store.items:  # someone edits or deletes a managed slice
            key = sorted(store.items)[op[1] % len(store.items)]
            if op[1] % 2:
                del store.items[key]
            else:
                store.items[key]["endpoints"] = [{"addresses": ["10.9.9.9"], "conditions": {}}]
        if lag == 0 or step % (lag + 1) == 0:  # the controller runs after some changes, not after each
            reconcile(store, services, list(pods.values()), max_per_slice)
    reconcile(store, services, list(pods.values()), max_per_slice)
    assert actual(store.items.values()) == wanted(services.values(), pods.values(), None, max_per_slice)
    assert reconcile(store, services, list(pods.values()), max_per_slice) == 0  # level: nothing more to do
    for svc in services.values():
        for s in store.of("n", svc["metadata"]["name"]):
            assert s["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
            assert len(s.get("endpoints") or []) <= max_per_slice
    services.clear()
    reconcile(store, services, list(pods.values()), max_per_slice)
    assert store.items == {}  # no service, no slice


def test_desired_slices_per_family_and_port_group() -> None:
    svc = pure_service(0, "a", 0, dual=True)
    pods = [pure_pod(0, "a", True, 8080, "dual"), pure_pod(1, "a", False, 9090, "v4"), pure_pod(2, "b", True, 8080,
                                                                                               "v4")]
    got = desired_slices(svc, pods)
    assert [(s["addressType"], [e["addresses"][0] for e in s["endpoints"]], s["ports"][0]["port"]) for s in got] == [
        ("IPv4", ["10.0.0.1"], 8080), ("IPv4", ["10.0.0.2"], 9090), ("IPv6", ["fd00::1"], 8080)]
    assert got[1]["endpoints"][0]["conditions"] == {"ready": False, "serving": False, "terminating": False}
    svc["spec"]["publishNotReadyAddresses"] = True
    assert desired_slices(svc, pods)[1]["endpoints"][0]["conditions"]["ready"] is True
    svc["spec"]["selector"] = None
    assert desired_slices(svc, pods) == []
    external = pure_service(1, "a", 0, dual=False)
    external["spec"]["type"] = "ExternalName"
    assert desired_slices(external, pods) == []
    lonely = pure_service(2, "z", 0, dual=True)
    assert [content_of(s) for s in desired_slices(lonely, pods)] == [
        content_of({"addressType": "IPv4", "endpoints": None, "ports": None})]  # one placeholder, primary family
