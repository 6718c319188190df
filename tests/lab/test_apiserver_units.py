"""Unit tests of the lab API server's pure parts: selectors, patches, validation, store history, podgen."""

from __future__ import annotations

import json

import pytest

from podmeter.lab.apiserver import patching, validation
from podmeter.lab.apiserver.errors import ApiError
from podmeter.lab.apiserver.resources import PODS
from podmeter.lab.apiserver.selectors import parse_field_selector, parse_label_selector
from podmeter.lab.apiserver.store import ADDED, DELETED, MODIFIED, Store
from podmeter.lab.podgen import realistic_pod

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("", {}, True),
        ("app=web", {"app": "web"}, True),
        ("app==web", {"app": "db"}, False),
        ("app!=web", {}, True),
        ("app in (web, db)", {"app": "db"}, True),
        ("app notin (web,db)", {"app": "db"}, False),
        ("app notin (web)", {}, True),
        ("app", {"app": ""}, True),
        ("!app", {"app": "x"}, False),
        ("tier,app in (a),env!=prod", {"tier": "1", "app": "a", "env": "dev"}, True),
        ("gen>3", {"gen": "4"}, True),
        ("gen<3", {"gen": "x"}, False),
        ("example.com/team=a", {"example.com/team": "a"}, True),
    ],
)
def test_label_selector(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert parse_label_selector(selector).matches(labels) is expected


@pytest.mark.parametrize("bad", ["app in (", "=x", "app=a b", "-app", "app in ()", "gen>x"])
def test_label_selector_errors(bad: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_label_selector(bad)
    assert info.value.code == 400


def test_field_selector() -> None:
    sel = parse_field_selector("spec.nodeName=node-a,status.phase!=Failed", PODS.field_keys)
    assert sel.matches({"spec.nodeName": "node-a", "status.phase": "Running"})
    assert not sel.matches({"spec.nodeName": "node-a", "status.phase": "Failed"})
    assert parse_field_selector("metadata.name==a\\,b", PODS.field_keys).matches({"metadata.name": "a,b"})
    with pytest.raises(ApiError, match=r"field label not supported: spec\.bogus"):
        parse_field_selector("spec.bogus=x", PODS.field_keys)


def test_merge_patch_rfc7386() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}
    patch = {"a": "z", "c": {"f": None}, "l": [3]}
    assert patching.merge_patch(target, patch) == {"a": "z", "c": {"d": "e"}, "l": [3]}
    assert target == {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}  # not mutated


def test_json_patch_rfc6902() -> None:
    doc = {"metadata": {"labels": {"a": "1"}}, "list": [1, 2, 3]}
    ops = [
        {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
        {"op": "remove", "path": "/list/0"},
        {"op": "add", "path": "/list/-", "value": 9},
        {"op": "replace", "path": "/metadata/labels/a", "value": "x"},
        {"op": "copy", "from": "/list/0", "path": "/first"},
        {"op": "move", "from": "/first", "path": "/moved"},
        {"op": "test", "path": "/moved", "value": 2},
    ]
    assert patching.json_patch(doc, ops) == {
        "metadata": {"labels": {"a": "x", "b/c": "2"}},
        "list": [2, 3, 9],
        "moved": 2,
    }
    with pytest.raises(patching.PatchError) as info:
        patching.json_patch(doc, [{"op": "test", "path": "/list/0", "value": 7}])
    assert info.value.code == 422
    with pytest.raises(patching.PatchError):
        patching.json_patch(doc, [{"op": "remove", "path": "/nope"}])


def test_strategic_merge_patch_lists_and_directives() -> None:
    pod = {
        "spec": {
            "containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}],
            "tolerations": [{"key": "x"}],
        },
        "metadata": {"finalizers": ["f1"], "labels": {"k": "v", "drop": "me"}},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    patch = {
        "spec": {
            "containers": [{"name": "b", "image": "2"}, {"name": "c", "image": "3"}, {"name": "a", "$patch": "delete"}],
            "tolerations": [{"key": "y"}],
            "$setElementOrder/containers": [{"name": "b"}, {"name": "c"}],
        },
        "metadata": {"finalizers": ["f2"], "labels": {"drop": None}, "$deleteFromPrimitiveList/finalizers": ["f1"]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}]},
    }
    out = patching.strategic_merge_patch(pod, patch)
    assert out["spec"]["containers"] == [{"name": "b", "image": "2"}, {"name": "c", "image": "3"}]
    assert out["spec"]["tolerations"] == [{"key": "y"}]  # no merge key: replaced
    assert out["metadata"] == {"finalizers": ["f2"], "labels": {"k": "v"}}
    assert out["status"]["conditions"] == [
        {"type": "Ready", "status": "True"},
        {"type": "Initialized", "status": "True"},
    ]
    replaced = patching.strategic_merge_patch(pod, {"metadata": {"labels": {"$patch": "replace", "n": "1"}}})
    assert replaced["metadata"]["labels"] == {"n": "1"}


def test_pod_ip_validation() -> None:
    assert validation.validate_pod_ips({"podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]}) == []
    causes = validation.validate_pod_ips({"podIPs": [{"ip": "999.1.2.3"}]})
    assert [(c.field, c.reason) for c in causes] == [("status.podIPs[0]", "FieldValueInvalid")]
    causes = validation.validate_pod_ips({"podIPs": [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]})
    assert [c.field for c in causes] == ["status.podIPs"]
    assert validation.validate_pod_ips({"podIPs": [{"ip": "010.0.0.1"}]})  # leading zeros: invalid


def test_store_history_floor_and_snapshot() -> None:
    store = Store(history=3, start_rv=10)
    a = realistic_pod(1)
    store.commit(PODS, ADDED, a)  # rv 11
    b = realistic_pod(2)
    store.commit(PODS, ADDED, b)  # rv 12
    a["metadata"]["labels"] = {"changed": "yes"}
    store.commit(PODS, MODIFIED, a)  # rv 13
    assert store.floor == 10
    snap = store.snapshot(PODS, 11)
    assert [s.rv for s in snap.values()] == [11]
    store.commit(PODS, DELETED, b)  # rv 14: the oldest event (11) leaves the window
    assert store.floor == 11 and [e.rv for e in store.history] == [12, 13, 14]
    assert {s.rv for s in store.snapshot(PODS, 12).values()} == {11, 12}
    with pytest.raises(ApiError) as info:
        store.snapshot(PODS, 10)
    assert info.value.code == 410
    assert store.compact() == 14 and not store.history


def test_realistic_pod_shape_and_size() -> None:
    pod = realistic_pod(42, node="node-x", ip="10.9.9.9")
    size = len(json.dumps(pod, separators=(",", ":")))
    assert 6 * 1024 <= size <= 8 * 1024
    assert pod["spec"]["nodeName"] == "node-x" and pod["status"]["podIPs"] == [{"ip": "10.9.9.9"}]
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
    assert len(pod["metadata"]["managedFields"]) == 2
    assert realistic_pod(42) == realistic_pod(42)  # deterministic
    assert realistic_pod(1)["metadata"]["uid"] != realistic_pod(2)["metadata"]["uid"]
    pending = realistic_pod(3, node=None, phase="Pending")
    assert "nodeName" not in pending["spec"] and "podIP" not in pending["status"]


def test_memory_is_bounded_under_churn() -> None:
    """Live objects + a fixed history window: churn through 12x the window, sizes stay put."""
    import tracemalloc

    store = Store(history=200)
    sizes = []
    tracemalloc.start()
    for round_ in range(12):
        if round_ == 4:
            warm = tracemalloc.get_traced_memory()[0]
        for i in range(100):
            pod = realistic_pod(round_ * 100 + i, node=None, phase="Pending")
            store.commit(PODS, ADDED, pod)
            store.commit(PODS, DELETED, pod)
        sizes.append((len(store.history), sum(len(t) for t in store.objects.values())))
    grown = tracemalloc.get_traced_memory()[0] - warm
    tracemalloc.stop()
    assert set(sizes) == {(200, 0)}
    assert grown < 256 * 1024
