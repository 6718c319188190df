"""The lab API server on the wire, compared with the real server's recorded answers (tests/data/wire/)."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab_server import LabServer

WIRE = Path(__file__).resolve().parents[1] / "data" / "wire"


def recorded(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((WIRE / name).read_text())
    return data


@pytest.fixture(scope="module")
def srv() -> Iterator[LabServer]:
    with LabServer(process=False, args=["--too-large-rv-wait", "0.3"]) as server:
        yield server


def pod(name: str, node: str | None = "node-a", labels: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox:1.36"}]}
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": spec,
    }


def make_ns(srv: LabServer, name: str) -> None:
    status, _, body = srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    assert status == 201, body


def create_pod(srv: LabServer, ns: str, name: str, **kw: Any) -> dict[str, Any]:
    status, _, body = srv.request("POST", f"/api/v1/namespaces/{ns}/pods", pod(name, **kw))
    assert status == 201, body
    assert isinstance(body, dict)
    return body


def shape(value: Any) -> Any:
    """Structure without values: the keys (recursively) and the types."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


# --- create, get, errors ---------------------------------------------------------------------------------


def test_create_namespace_matches_recording(srv: LabServer) -> None:
    status, headers, body = srv.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "wire-ns"}},
    )
    want = recorded("create-namespace.json")
    assert status == want["status"] == 201
    assert headers["Content-Type"].startswith("application/json")
    assert set(want["headers"]) <= {k.lower() for k in headers}  # audit-id, cache-control, content-type
    assert list(body) == list(want["body"])
    assert list(body["metadata"]) == list(want["body"]["metadata"])
    assert body["metadata"]["labels"] == {"kubernetes.io/metadata.name": "wire-ns"}
    assert body["spec"] == want["body"]["spec"] and body["status"] == {"phase": "Active"}


def test_create_pod_fills_real_defaults(srv: LabServer) -> None:
    make_ns(srv, "defaults")
    body = create_pod(srv, "defaults", "web-1")
    want = recorded("create-pod-bound.json")["body"]
    assert list(body) == list(want)
    assert list(body["metadata"]) == list(want["metadata"])
    for key in (
        "restartPolicy",
        "terminationGracePeriodSeconds",
        "dnsPolicy",
        "serviceAccountName",
        "schedulerName",
        "tolerations",
        "priority",
        "enableServiceLinks",
        "preemptionPolicy",
        "nodeName",
    ):
        assert body["spec"][key] == want["spec"][key], key
    assert set(body["spec"]) == set(want["spec"])
    assert body["spec"]["containers"][0].keys() == want["spec"]["containers"][0].keys()
    assert body["status"] == want["status"] == {"phase": "Pending", "qosClass": "BestEffort"}
    assert body["metadata"]["generation"] == 1 and body["metadata"]["uid"]


def test_errors_match_recordings(srv: LabServer) -> None:
    make_ns(srv, "wire64946")
    create_pod(srv, "wire64946", "web-1")
    cases = [
        (
            "error-404-get-missing.json",
            "GET",
            "/api/v1/namespaces/wire64946/pods/nope",
            None,
            "application/json",
        ),
        (
            "error-409-already-exists.json",
            "POST",
            "/api/v1/namespaces/wire64946/pods",
            pod("web-1"),
            "application/json",
        ),
        (
            "error-400-bad-field-selector.json",
            "GET",
            "/api/v1/pods?fieldSelector=spec.bogus%3Dx",
            None,
            "application/json",
        ),
        (
            "error-422-send-initial-events-without-match.json",
            "GET",
            "/api/v1/namespaces/wire64946/pods?watch=1&sendInitialEvents=true&timeoutSeconds=2",
            None,
            "application/json",
        ),
        (
            "error-422-invalid-name.json",
            "POST",
            "/api/v1/namespaces/wire64946/pods",
            recorded("error-422-invalid-name.json")["request"]["body"],
            "application/json",
        ),
        (
            "error-422-invalid-pod-ip-status.json",
            "PATCH",
            "/api/v1/namespaces/wire64946/pods/web-1/status",
            recorded("error-422-invalid-pod-ip-status.json")["request"]["body"],
            "application/merge-patch+json",
        ),
    ]
    for name, method, path, body, ctype in cases:
        want = recorded(name)
        status, _, got = srv.request(method, path, body, ctype)
        assert status == want["status"], (name, got)
        expected = {**want["body"]}
        if "details" in expected and expected["details"].get("name") == "web-2":  # the recording's pod name
            expected = json.loads(json.dumps(expected).replace("web-2", "web-1"))
        assert got == expected, name


def test_malformed_json_is_400_with_real_prefix(srv: LabServer) -> None:
    make_ns(srv, "malformed")
    status, _, body = srv.request("POST", "/api/v1/namespaces/malformed/pods", b"{not json")
    assert status == 400
    assert body["reason"] == "BadRequest" and body["code"] == 400
    assert body["message"].startswith(
        "the object provided is unrecognized (must be of type Pod): couldn't get version/kind; json parse error"
    )


def test_stale_update_is_409_conflict(srv: LabServer) -> None:
    make_ns(srv, "conflict")
    created = create_pod(srv, "conflict", "web-1")
    path = "/api/v1/namespaces/conflict/pods/web-1"
    first = {**created, "metadata": {**created["metadata"], "labels": {"app": "v2"}}}
    status, _, updated = srv.request("PUT", path, first)
    assert status == 200 and int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    status, _, body = srv.request("PUT", path, {**created, "metadata": {**created["metadata"], "labels": {"x": "y"}}})
    assert status == 409
    assert body == recorded("error-409-conflict-stale-update.json")["body"] | {"message": body["message"]}
    assert body["message"].startswith('Operation cannot be fulfilled on pods "web-1": the object has been modified')
    # A pod update without resourceVersion is refused (pods allow no unconditional update).
    no_rv = {**updated, "metadata": {k: v for k, v in updated["metadata"].items() if k != "resourceVersion"}}
    status, _, body = srv.request("PUT", path, no_rv)
    assert status == 422 and body["details"]["causes"][0]["field"] == "metadata.resourceVersion"


def test_noop_update_keeps_rv(srv: LabServer) -> None:
    make_ns(srv, "noop")
    created = create_pod(srv, "noop", "web-1")
    status, _, same = srv.request("PUT", "/api/v1/namespaces/noop/pods/web-1", created)
    assert status == 200 and same["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


# --- list ------------------------------------------------------------------------------------------------


def test_list_chunking_like_recording(srv: LabServer) -> None:
    make_ns(srv, "chunks")
    for i in range(1, 6):
        create_pod(srv, "chunks", f"web-{i}")
    status, _, page1 = srv.request("GET", "/api/v1/namespaces/chunks/pods?limit=2")
    want1 = recorded("list-chunked-page1.json")["body"]
    assert status == 200 and list(page1) == list(want1) and list(page1["metadata"]) == list(want1["metadata"])
    assert [list(i) for i in page1["items"]] == [["metadata", "spec", "status"]] * 2
    assert page1["metadata"]["remainingItemCount"] == 3
    token = json.loads(base64.urlsafe_b64decode(page1["metadata"]["continue"] + "=="))
    assert token == {
        "v": "meta.k8s.io/v1",
        "rv": int(page1["metadata"]["resourceVersion"]),
        "start": "chunks/web-2\u0000",
    }
    # A change between pages does not leak into the snapshot the pages are read from.
    srv.request("DELETE", "/api/v1/namespaces/chunks/pods/web-4")
    _, _, page2 = srv.request("GET", f"/api/v1/namespaces/chunks/pods?limit=2&continue={page1['metadata']['continue']}")
    assert page2["metadata"]["resourceVersion"] == page1["metadata"]["resourceVersion"]
    assert [p["metadata"]["name"] for p in page2["items"]] == ["web-3", "web-4"]
    assert page2["metadata"]["remainingItemCount"] == 1
    _, _, page3 = srv.request("GET", f"/api/v1/namespaces/chunks/pods?limit=2&continue={page2['metadata']['continue']}")
    assert [p["metadata"]["name"] for p in page3["items"]] == ["web-5"]
    assert "continue" not in page3["metadata"]
    status, _, bad = srv.request("GET", "/api/v1/namespaces/chunks/pods?limit=2&continue=garbage!")
    assert status == 400 and bad["reason"] == "BadRequest"


def test_label_and_field_selectors(srv: LabServer) -> None:
    make_ns(srv, "sel")
    create_pod(srv, "sel", "a", labels={"app": "web", "tier": "fe"})
    create_pod(srv, "sel", "b", labels={"app": "db"}, node="node-b")
    create_pod(srv, "sel", "c", labels={"app": "web", "tier": "be"}, node=None)

    def names(query: str) -> list[str]:
        status, _, body = srv.request("GET", f"/api/v1/namespaces/sel/pods?{query}")
        assert status == 200, body
        return [p["metadata"]["name"] for p in body["items"]]

    assert names("labelSelector=app%3Dweb") == ["a", "c"]
    assert names("labelSelector=app%20in%20(web,db),tier!%3Dbe") == ["a", "b"]
    assert names("labelSelector=!tier") == ["b"]
    assert names("labelSelector=tier,app%3D%3Dweb") == ["a", "c"]
    assert names("labelSelector=app%20notin%20(web)") == ["b"]
    assert names("fieldSelector=spec.nodeName%3Dnode-a") == ["a"]
    assert names("fieldSelector=spec.nodeName%3D") == ["c"]
    assert names("fieldSelector=spec.nodeName!%3Dnode-a,status.phase%3DPending") == ["b", "c"]
    assert names("fieldSelector=metadata.name%3Db") == ["b"]
    status, _, body = srv.request("GET", "/api/v1/namespaces?fieldSelector=spec.nodeName%3Dx")
    assert status == 400 and body["message"] == "field label not supported: spec.nodeName"
    status, _, body = srv.request("GET", "/api/v1/pods?labelSelector=app%20in%20(")
    assert status == 400 and body["reason"] == "BadRequest"


def test_list_resource_version_semantics(srv: LabServer) -> None:
    make_ns(srv, "rvsem")
    a = create_pod(srv, "rvsem", "a")
    rv_a = int(a["metadata"]["resourceVersion"])
    create_pod(srv, "rvsem", "b")
    _, _, now = srv.request("GET", "/api/v1/namespaces/rvsem/pods")
    assert [p["metadata"]["name"] for p in now["items"]] == ["a", "b"]
    for rv in ("0", str(rv_a)):
        _, _, body = srv.request("GET", f"/api/v1/namespaces/rvsem/pods?resourceVersion={rv}")
        assert len(body["items"]) == 2  # not older than rv: the current state
    _, _, exact = srv.request("GET", f"/api/v1/namespaces/rvsem/pods?resourceVersion={rv_a}&resourceVersionMatch=Exact")
    assert [p["metadata"]["name"] for p in exact["items"]] == ["a"]
    assert exact["metadata"]["resourceVersion"] == str(rv_a)
    started = time.monotonic()
    status, headers, body = srv.request(
        "GET", "/api/v1/namespaces/rvsem/pods?resourceVersion=99999999&resourceVersionMatch=NotOlderThan"
    )
    want = recorded("list-too-large-rv-504.json")
    assert status == 504 and time.monotonic() - started >= 0.25
    assert headers["Retry-After"] == "1"
    assert shape(body) == shape(want["body"]) and body["details"] == want["body"]["details"]
    status, _, body = srv.request("GET", "/api/v1/pods?resourceVersionMatch=Exact")
    assert status == 422 and body["details"]["kind"] == "ListOptions"


# --- watch -----------------------------------------------------------------------------------------------


def test_watch_unset_rv_synthetic_added_in_key_order_then_end_bookmark(srv: LabServer) -> None:
    make_ns(srv, "synth")
    for name in ("web-2", "late", "web-1"):
        create_pod(srv, "synth", name)
    srv.request(
        "PATCH",
        "/api/v1/namespaces/synth/pods/late",
        {"metadata": {"labels": {"x": "y"}}},
        "application/merge-patch+json",
    )
    with srv.watch("/api/v1/namespaces/synth/pods?watch=1&allowWatchBookmarks=true&timeoutSeconds=1") as w:
        events = w.events()
    want = recorded("watch-rv-unset-synthetic-added.json")["body"]
    assert [e["type"] for e in events] == ["ADDED"] * 3 + ["BOOKMARK"]  # as recorded: no second one at 1-2 s
    assert [e["object"]["metadata"]["name"] for e in events[:3]] == ["late", "web-1", "web-2"]
    rvs = [int(e["object"]["metadata"]["resourceVersion"]) for e in events[:3]]
    assert rvs != sorted(rvs)  # key order, not RV order
    end = events[3]["object"]
    assert shape(end) == shape(want[-1]["object"])
    assert end["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert end["spec"] == {"containers": None} and end["status"] == {}


def test_send_initial_events_with_match(srv: LabServer) -> None:
    make_ns(srv, "sie")
    create_pod(srv, "sie", "a")
    path = (
        "/api/v1/namespaces/sie/pods?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
        "&allowWatchBookmarks=true&timeoutSeconds=1"
    )
    with srv.watch(path) as w:
        events = w.events()
    assert [e["type"] for e in events][:2] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_watch_from_rv_like_recording(srv: LabServer) -> None:
    """Status change, grace-0 delete (MODIFIED then DELETED), late binding, and a bookmark before timeout."""
    make_ns(srv, "fromrv")
    for name in ("web-2", "web-3"):
        create_pod(srv, "fromrv", name)
    _, _, listed = srv.request("GET", "/api/v1/namespaces/fromrv/pods")
    rv = listed["metadata"]["resourceVersion"]
    with (
        srv.watch(
            f"/api/v1/namespaces/fromrv/pods?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=3"
        ) as w,
        srv.watch(
            f"/api/v1/pods?watch=1&fieldSelector=spec.nodeName%3Dnode-a&resourceVersion={rv}&timeoutSeconds=2"
        ) as nw,
    ):
        srv.request(
            "PATCH",
            "/api/v1/namespaces/fromrv/pods/web-2/status",
            {"status": {"phase": "Running", "podIP": "10.244.0.11", "podIPs": [{"ip": "10.244.0.11"}]}},
            "application/merge-patch+json",
        )
        srv.request("DELETE", "/api/v1/namespaces/fromrv/pods/web-3", {"gracePeriodSeconds": 0})
        create_pod(srv, "fromrv", "late", node=None)
        srv.request(
            "PATCH",
            "/api/v1/namespaces/fromrv/pods/late",
            {"spec": {"nodeName": "node-a"}},
            "application/strategic-merge-patch+json",
        )
        events, node_events = w.events(), nw.events()
    want = [
        (e["type"], e["object"]["metadata"].get("name"))
        for e in recorded("watch-from-rv-with-bookmarks-timeout.json")["body"]
        if e["object"]["metadata"].get("name") != "web-4"
    ]
    got = [(e["type"], e["object"]["metadata"].get("name")) for e in events]
    assert got == want
    assert "deletionTimestamp" in events[1]["object"]["metadata"]
    assert events[2]["object"]["metadata"]["deletionGracePeriodSeconds"] == 0
    assert (
        int(events[2]["object"]["metadata"]["resourceVersion"])
        == int(events[1]["object"]["metadata"]["resourceVersion"]) + 1
    )
    assert events[-1]["object"]["metadata"]["resourceVersion"] == events[-2]["object"]["metadata"]["resourceVersion"]
    want_node = [
        (e["type"], e["object"]["metadata"]["name"])
        for e in recorded("watch-node-filtered-from-rv.json")["body"]
        if e["object"]["metadata"]["name"] != "web-4"
    ]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in node_events] == want_node
    late = node_events[-1]["object"]
    assert late["metadata"]["resourceVersion"] == events[-2]["object"]["metadata"]["resourceVersion"]  # binding RV


def test_object_leaving_selector_arrives_as_deleted(srv: LabServer) -> None:
    make_ns(srv, "leave")
    create_pod(srv, "leave", "a", labels={"app": "web"})
    with srv.watch("/api/v1/namespaces/leave/pods?watch=1&labelSelector=app%3Dweb&timeoutSeconds=1") as w:
        assert w.next()["type"] == "ADDED"
        srv.request(
            "PATCH",
            "/api/v1/namespaces/leave/pods/a",
            {"metadata": {"labels": {"app": "db"}}},
            "application/merge-patch+json",
        )
        gone = w.next()
        srv.request(
            "PATCH",
            "/api/v1/namespaces/leave/pods/a",
            {"metadata": {"labels": {"app": "web"}}},
            "application/merge-patch+json",
        )
        back = w.next()
    assert gone["type"] == "DELETED" and gone["object"]["metadata"]["labels"] == {"app": "web"}
    assert back["type"] == "ADDED" and back["object"]["metadata"]["labels"] == {"app": "web"}
    assert int(back["object"]["metadata"]["resourceVersion"]) > int(gone["object"]["metadata"]["resourceVersion"])


def test_namespace_deletion_sequence(srv: LabServer) -> None:
    make_ns(srv, "doomed")
    create_pod(srv, "doomed", "a")
    _, _, listed = srv.request("GET", "/api/v1/namespaces")
    rv = listed["metadata"]["resourceVersion"]
    with (
        srv.watch(
            f"/api/v1/namespaces?watch=1&fieldSelector=metadata.name%3Ddoomed&resourceVersion={rv}&timeoutSeconds=1"
        ) as nsw,
        srv.watch(f"/api/v1/namespaces/doomed/pods?watch=1&resourceVersion={rv}&timeoutSeconds=1") as pw,
    ):
        status, _, body = srv.request("DELETE", "/api/v1/namespaces/doomed")
        ns_events, pod_events = nsw.events(), pw.events()
    assert status == 200 and body["status"] == {"phase": "Terminating"} and body["metadata"]["deletionTimestamp"]
    assert [e["type"] for e in ns_events] == ["MODIFIED", "DELETED"]
    assert ns_events[0]["object"]["status"]["phase"] == "Terminating"
    assert [e["type"] for e in pod_events] == ["DELETED"]
    assert srv.request("GET", "/api/v1/namespaces/doomed/pods/a")[0] == 404
    assert srv.request("GET", "/api/v1/namespaces/doomed")[0] == 404
    status, _, body = srv.request("DELETE", "/api/v1/namespaces/default")
    assert status == 403 and body["reason"] == "Forbidden"


def test_watch_from_a_future_rv_is_504(srv: LabServer) -> None:
    with srv.watch("/api/v1/pods?watch=1&resourceVersion=99999999&timeoutSeconds=5") as w:
        assert w.status == 504
        body = w.next()
    assert body["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"


def test_watch_timeout_without_bookmarks_sends_nothing(srv: LabServer) -> None:
    make_ns(srv, "quiet")
    _, _, listed = srv.request("GET", "/api/v1/namespaces/quiet/pods")
    started = time.monotonic()
    with srv.watch(
        f"/api/v1/namespaces/quiet/pods?watch=1&resourceVersion={listed['metadata']['resourceVersion']}"
        "&timeoutSeconds=1"
    ) as w:
        assert w.status == 200
        assert w.events() == []
    assert 0.9 <= time.monotonic() - started < 3


def test_periodic_bookmarks_carry_current_rv() -> None:
    with LabServer(process=False, args=["--bookmark-interval", "0.3"]) as srv:
        _, _, listed = srv.request("GET", "/api/v1/namespaces/default/pods")
        with srv.watch(
            "/api/v1/namespaces/default/pods?watch=1&allowWatchBookmarks=true&timeoutSeconds=1"
            f"&resourceVersion={listed['metadata']['resourceVersion']}"
        ) as w:
            first = w.next()
            srv.request("POST", "/api/v1/namespaces", {"metadata": {"name": "other"}})
            events = [first, *w.events()]
        assert {e["type"] for e in events} == {"BOOKMARK"}
        assert len(events) >= 3
        assert int(events[-1]["object"]["metadata"]["resourceVersion"]) > int(listed["metadata"]["resourceVersion"])


def test_history_window_answers_410_error_event() -> None:
    with LabServer(process=False, args=["--history", "5"]) as srv:
        _, _, listed = srv.request("GET", "/api/v1/namespaces/default/pods")
        old = int(listed["metadata"]["resourceVersion"])
        for i in range(8):
            create_pod(srv, "default", f"p{i}")
        with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={old}&timeoutSeconds=5") as w:
            assert w.status == 200
            events = w.events()
        assert len(events) == 1 and events[0]["type"] == "ERROR"
        status = events[0]["object"]
        want = recorded("watch-compacted-rv-410-from-etcd.json")["body"][0]["object"]
        assert shape(status) == shape(want)
        assert (status["reason"], status["code"]) == ("Expired", 410)
        assert status["message"].startswith(f"too old resource version: {old} (")
        # Still inside the window: served from history.
        _, _, now = srv.request("GET", "/api/v1/namespaces/default/pods")
        recent = int(now["metadata"]["resourceVersion"]) - 2
        with srv.watch(f"/api/v1/namespaces/default/pods?watch=1&resourceVersion={recent}&timeoutSeconds=1") as w:
            assert [e["type"] for e in w.events()] == ["ADDED", "ADDED"]


def test_watch_count_and_no_token(srv: LabServer) -> None:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(srv.url + "/api/v1/namespaces")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    body = json.loads(info.value.read())
    assert info.value.code == 401
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }


def test_discovery_shapes(srv: LabServer) -> None:
    for name, path in (("discovery-api.json", "/api"), ("discovery-version.json", "/version")):
        _, _, body = srv.request("GET", path)
        assert list(body) == list(recorded(name)["body"]), name
    _, _, v1 = srv.request("GET", "/api/v1")
    want = {r["name"]: r for r in recorded("discovery-api-v1.json")["body"]["resources"]}
    for entry in v1["resources"]:
        assert entry == want[entry["name"]] | {"storageVersionHash": entry.get("storageVersionHash")} or (
            {k: v for k, v in entry.items()}
            == {k: v for k, v in want[entry["name"]].items() if k != "storageVersionHash"}
        ), entry["name"]
    _, _, coord = srv.request("GET", "/apis/coordination.k8s.io/v1")
    lease = recorded("discovery-coordination-v1.json")["body"]["resources"][0]
    assert coord["resources"][0] == {k: v for k, v in lease.items() if k != "storageVersionHash"}
    _, _, groups = srv.request("GET", "/apis")
    assert {g["name"] for g in groups["groups"]} == {
        "coordination.k8s.io", "discovery.k8s.io", "podmeter.io", "apiextensions.k8s.io"
    }
    assert "discovery.k8s.io" in {g["name"] for g in recorded("discovery-apis.json")["body"]["groups"]}
    assert {"services", "services/status"} <= {e["name"] for e in v1["resources"]}  # compared above
    _, _, discovery_v1 = srv.request("GET", "/apis/discovery.k8s.io/v1")
    assert discovery_v1["resources"] == [
        {
            "name": "endpointslices",
            "singularName": "endpointslice",
            "namespaced": True,
            "kind": "EndpointSlice",
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        }
    ]


def test_delete_collection_by_selector(srv: LabServer) -> None:
    make_ns(srv, "dc")
    create_pod(srv, "dc", "a", labels={"job": "x"})
    create_pod(srv, "dc", "b", labels={"job": "x"}, node=None)
    create_pod(srv, "dc", "c", labels={"job": "y"})
    status, _, body = srv.request("DELETE", "/api/v1/namespaces/dc/pods?labelSelector=job%3Dx")
    assert status == 200 and body["kind"] == "PodList"
    assert [p["metadata"]["name"] for p in body["items"]] == ["a", "b"]
    assert "kind" not in body["items"][0]
    _, _, left = srv.request("GET", "/api/v1/namespaces/dc/pods")
    assert [p["metadata"]["name"] for p in left["items"]] == ["c"]
    assert srv.request("DELETE", "/api/v1/namespaces")[0] == 405  # namespaces have no deletecollection


def test_binding_subresource_binds_once(srv: LabServer) -> None:
    make_ns(srv, "bind")
    create_pod(srv, "bind", "p", node=None)
    with srv.watch("/api/v1/pods?watch=1&fieldSelector=spec.nodeName%3Dnode-z&timeoutSeconds=1") as w:
        status, _, body = srv.request(
            "POST",
            "/api/v1/namespaces/bind/pods/p/binding",
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": "p"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "node-z"},
            },
        )
        events = w.events()
    assert status == 201 and body["status"] == "Success"
    assert [e["type"] for e in events] == ["ADDED"]
    conditions = events[0]["object"]["status"]["conditions"]
    assert [(c["type"], c["status"]) for c in conditions] == [("PodScheduled", "True")]
    status, _, body = srv.request("POST", "/api/v1/namespaces/bind/pods/p/binding", {"target": {"name": "n2"}})
    assert status == 409 and body["reason"] == "Conflict"
