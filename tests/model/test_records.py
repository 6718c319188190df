"""Slim records: decoded from real API server JSON, malformed input rejected with a named field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factories import pod_json
from podmeter.model.configuration import decode_configuration
from podmeter.model.records import DecodeError, decode_namespace, decode_pod

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

WIRE = Path(__file__).parents[1] / "data" / "wire"


def _dumps(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_decodes_a_real_api_server_pod() -> None:
    body = json.loads((WIRE / "create-pod-bound.json").read_text())["body"]
    pod = decode_pod(_dumps(body))
    assert (pod.namespace, pod.name) == (body["metadata"]["namespace"], "web-1")
    assert pod.uid == body["metadata"]["uid"]
    assert pod.node_name == body["spec"]["nodeName"]
    assert pod.phase == "Pending"
    assert pod.ips == ()
    assert pod.label_dict() == {"app": "web-1"}


def test_decodes_every_pod_of_a_real_list() -> None:
    body = json.loads((WIRE / "list-chunked-page1.json").read_text())["body"]
    pods = [decode_pod(_dumps(item)) for item in body["items"]]
    assert len(pods) == len(body["items"]) > 0
    assert len({p.uid for p in pods}) == len(pods)


def test_pod_ips_prefer_pod_ips_and_fall_back_to_pod_ip() -> None:
    dual = pod_json("a", ips=("10.0.0.1", "FD00:0:0::1"))
    assert decode_pod(_dumps(dual)).ips == ("10.0.0.1", "fd00::1")
    single = pod_json("b")
    single["status"]["podIP"] = "10.0.0.2"
    assert decode_pod(_dumps(single)).ips == ("10.0.0.2",)


def test_ipv4_mapped_ipv6_is_the_ipv4_address() -> None:
    assert decode_pod(_dumps(pod_json("a", ips=("::ffff:10.1.2.3",)))).ips == ("10.1.2.3",)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p["status"].update(podIP="999.0.0.1", podIPs=None), "$.status.podIP"),
        (lambda p: p["status"].update(podIPs=[{"ip": "not-an-ip"}]), "$.status.podIPs"),
        (lambda p: p["metadata"].update(name=7), "$.metadata.name"),
        (lambda p: p["metadata"].pop("uid"), "$.metadata"),
        (lambda p: p["metadata"].update(uid=""), "$.metadata.uid"),
        (lambda p: p["spec"].update(hostNetwork="yes"), "$.spec.hostNetwork"),
        (lambda p: p["metadata"].update(labels={"app": "x" * 1000}), "$.metadata.labels"),
        (lambda p: p["metadata"].update(annotations={"podmeter.io/observe": "t" * (1 << 20)}),
         "$.metadata.annotations"),
    ],
)
def test_malformed_pod_raises_one_typed_error_naming_the_field(mutate: object, field: str) -> None:
    raw = pod_json("bad", "team")
    mutate(raw)  # type: ignore[operator]
    with pytest.raises(DecodeError) as info:
        decode_pod(_dumps(raw))
    assert info.value.field.startswith(field)
    assert info.value.kind == "Pod"
    if field != "$.metadata.name":
        assert info.value.name == "team/bad"


def test_a_huge_foreign_annotation_is_skipped_not_stored() -> None:
    raw = pod_json("a", ips=("10.0.0.1",), observe=True)
    raw["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "x" * (1 << 20)
    pod = decode_pod(_dumps(raw))
    assert pod.observe is True
    assert all(len(s) < 100 for s in (*pod.labels, pod.name, pod.uid))


def test_not_json_at_all() -> None:
    with pytest.raises(DecodeError, match="malformed JSON"):
        decode_pod(b"{nope")


def test_namespace_record() -> None:
    body = json.loads((WIRE / "create-namespace.json").read_text())["body"]
    ns = decode_namespace(_dumps(body))
    assert ns.name == body["metadata"]["name"]
    assert ns.phase == "Active"
    assert not ns.observe


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"namespaces": {"include": ["a"], "exclude": ["b"]}}, "both be non-empty"),
        ({"namespaces": {"include": ["Not_Valid"]}}, "not a valid namespace name"),
        ({"namespaces": {"exclude": ["x" * 64]}}, "not a valid namespace name"),
        ({"namespaces": {"include": ["shop\n"]}}, "not a valid namespace name"),
        ({"namespaces": {"include": "a"}}, "Expected `array"),
        ({"annotations": "yes"}, "Expected `bool`"),
        ({"namespace": {"include": ["a"]}}, "unknown field"),
    ],
)
def test_invalid_configuration_is_rejected_with_a_reason(spec: dict[str, object], message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode_configuration(_dumps({"metadata": {"name": "default"}, "spec": spec}))


def test_valid_configuration() -> None:
    spec = {"namespaces": {"exclude": ["kube-system"]}, "annotations": False}
    config = decode_configuration(_dumps({"metadata": {"name": "default", "generation": 3}, "spec": spec}))
    assert config.generation == 3
    assert config.interest.exclude == frozenset({"kube-system"})
    assert config.interest.annotations is False
