"""Bad input gets the right Status, the server stays up, and nothing is partly written (RV unchanged)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lab_server import LabServer

PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture(scope="module")
def srv() -> Iterator[LabServer]:
    with LabServer(process=False) as server:
        status, _, _ = server.request(
            "POST", PODS, {"metadata": {"name": "keep"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
        )
        assert status == 201
        yield server


def rv(srv: LabServer) -> str:
    value: str = srv.request("GET", "/api/v1/namespaces")[2]["metadata"]["resourceVersion"]
    return value


GOOD_SPEC = {"containers": [{"name": "c", "image": "busybox"}]}

CASES: list[tuple[str, str, str, Any, str, int, str]] = [
    # (id, method, path, body, content type, status, reason)
    ("malformed-json", "POST", PODS, b'{"metadata": {"name": "x"', "application/json", 400, "BadRequest"),
    ("not-an-object", "POST", PODS, b"[1, 2]", "application/json", 400, "BadRequest"),
    ("binary-garbage", "POST", PODS, b"\xff\xfe\x00garbage", "application/json", 400, "BadRequest"),
    (
        "wrong-kind",
        "POST",
        PODS,
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "wrong-group",
        "POST",
        PODS,
        {"apiVersion": "apps/v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": GOOD_SPEC},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "labels-not-a-map",
        "POST",
        PODS,
        {"metadata": {"name": "x", "labels": ["a"]}, "spec": GOOD_SPEC},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "label-value-number",
        "POST",
        PODS,
        {"metadata": {"name": "x", "labels": {"a": 1}}, "spec": GOOD_SPEC},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "containers-not-a-list",
        "POST",
        PODS,
        {"metadata": {"name": "x"}, "spec": {"containers": "c"}},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "invalid-name",
        "POST",
        PODS,
        {"metadata": {"name": "Bad_Name!"}, "spec": GOOD_SPEC},
        "application/json",
        422,
        "Invalid",
    ),
    (
        "too-long-name",
        "POST",
        PODS,
        {"metadata": {"name": "a" * 254}, "spec": GOOD_SPEC},
        "application/json",
        422,
        "Invalid",
    ),
    ("no-name", "POST", PODS, {"metadata": {}, "spec": GOOD_SPEC}, "application/json", 422, "Invalid"),
    ("no-containers", "POST", PODS, {"metadata": {"name": "x"}, "spec": {}}, "application/json", 422, "Invalid"),
    (
        "invalid-label-key",
        "POST",
        PODS,
        {"metadata": {"name": "x", "labels": {"-bad": "v"}}, "spec": GOOD_SPEC},
        "application/json",
        422,
        "Invalid",
    ),
    (
        "annotations-too-big",
        "POST",
        PODS,
        {"metadata": {"name": "x", "annotations": {"a": "x" * 300_000}}, "spec": GOOD_SPEC},
        "application/json",
        422,
        "Invalid",
    ),
    (
        "namespace-mismatch",
        "POST",
        PODS,
        {"metadata": {"name": "x", "namespace": "other"}, "spec": GOOD_SPEC},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "missing-namespace",
        "POST",
        "/api/v1/namespaces/nowhere/pods",
        {"metadata": {"name": "x"}, "spec": GOOD_SPEC},
        "application/json",
        404,
        "NotFound",
    ),
    (
        "strict-unknown-field",
        "POST",
        PODS + "?fieldValidation=Strict",
        {"metadata": {"name": "x"}, "spec": {**GOOD_SPEC, "bogus": True}},
        "application/json",
        400,
        "BadRequest",
    ),
    (
        "oversized-body",
        "POST",
        PODS,
        b'{"metadata":{"name":"x"},"pad":"' + b"x" * (3 * 1024 * 1024) + b'"}',
        "application/json",
        413,
        "RequestEntityTooLarge",
    ),
    ("yaml-body", "POST", PODS, b"metadata: {name: x}", "application/yaml", 415, "UnsupportedMediaType"),
    ("patch-bad-type", "PATCH", PODS + "/keep", {"metadata": {}}, "text/plain", 415, "UnsupportedMediaType"),
    ("patch-malformed", "PATCH", PODS + "/keep", b"{", "application/merge-patch+json", 400, "BadRequest"),
    ("json-patch-not-a-list", "PATCH", PODS + "/keep", {"op": "add"}, "application/json-patch+json", 400, "BadRequest"),
    (
        "json-patch-missing-path",
        "PATCH",
        PODS + "/keep",
        [{"op": "remove", "path": "/metadata/nope"}],
        "application/json-patch+json",
        400,
        "BadRequest",
    ),
    (
        "json-patch-test-fails",
        "PATCH",
        PODS + "/keep",
        [{"op": "test", "path": "/metadata/name", "value": "x"}],
        "application/json-patch+json",
        422,
        "Invalid",
    ),
    (
        "patch-renames",
        "PATCH",
        PODS + "/keep",
        {"metadata": {"name": "other"}},
        "application/merge-patch+json",
        400,
        "BadRequest",
    ),
    (
        "patch-spec-immutable",
        "PATCH",
        PODS + "/keep",
        {"spec": {"dnsPolicy": "None"}},
        "application/merge-patch+json",
        422,
        "Invalid",
    ),
    ("patch-missing", "PATCH", PODS + "/nope", {"metadata": {}}, "application/merge-patch+json", 404, "NotFound"),
    (
        "bad-status-ip",
        "PATCH",
        PODS + "/keep/status",
        {"status": {"podIPs": [{"ip": "1.2.3.4"}, {"ip": "1.2.3.4"}]}},
        "application/merge-patch+json",
        422,
        "Invalid",
    ),
    ("unknown-subresource", "GET", PODS + "/keep/exec", None, "application/json", 404, "NotFound"),
    ("unknown-resource", "GET", "/api/v1/configmaps", None, "application/json", 404, "NotFound"),
    ("bad-label-selector", "GET", PODS + "?labelSelector=a%20in%20b", None, "application/json", 400, "BadRequest"),
    ("bad-rv", "GET", PODS + "?resourceVersion=abc", None, "application/json", 400, "BadRequest"),
    ("bad-limit", "GET", PODS + "?limit=ten", None, "application/json", 400, "BadRequest"),
    (
        "bad-field-validation",
        "POST",
        PODS + "?fieldValidation=Maybe",
        {"metadata": {"name": "x"}},
        "application/json",
        400,
        "BadRequest",
    ),
    ("put-collection", "PUT", PODS, {"metadata": {"name": "x"}}, "application/json", 405, "MethodNotAllowed"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(srv: LabServer, case: tuple[str, str, str, Any, str, int, str]) -> None:
    _, method, path, body, ctype, want_status, want_reason = case
    before = rv(srv)
    status, headers, answer = srv.request(method, path, body, ctype)
    assert status == want_status, answer
    assert headers["Content-Type"].startswith("application/json")
    assert answer["kind"] == "Status" and answer["status"] == "Failure"
    assert (answer["reason"], answer["code"]) == (want_reason, want_status)
    assert answer["message"]
    assert rv(srv) == before  # no partial write: not even a resourceVersion was used
    names = [p["metadata"]["name"] for p in srv.request("GET", PODS)[2]["items"]]
    assert names == ["keep"]


def test_invalid_causes_name_fields(srv: LabServer) -> None:
    status, _, body = srv.request(
        "POST", PODS, {"metadata": {"name": "x", "labels": {"k": "bad value"}}, "spec": {"containers": [{"name": "c"}]}}
    )
    assert status == 422
    fields = [c["field"] for c in body["details"]["causes"]]
    assert fields == ["metadata.labels", "spec.containers[0].image"]
    assert body["message"].startswith('Pod "x" is invalid: [metadata.labels: Invalid value: "bad value"')


def test_warn_mode_drops_unknown_fields_with_a_warning(srv: LabServer) -> None:
    status, headers, body = srv.request(
        "POST", PODS, {"metadata": {"name": "warned"}, "spec": {**GOOD_SPEC, "bogus": 1}}
    )
    assert status == 201
    assert headers["Warning"] == '299 - "unknown field \\"spec.bogus\\""'
    assert "bogus" not in body["spec"]
    assert srv.request("DELETE", PODS + "/warned")[0] == 200


def test_server_survives_a_burst_of_garbage(srv: LabServer) -> None:
    for i in range(50):
        srv.request("POST", PODS, bytes([i % 256]) * (i + 1))
    status, _, body = srv.request("GET", PODS)
    assert status == 200 and [p["metadata"]["name"] for p in body["items"]] == ["keep"]
