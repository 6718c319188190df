"""Decoders are total: for any object the API server would accept, a decoder returns a record or raises its
bad-input error (:class:`DecodeError`), never anything else, which would escape the reflector and stop the
agent. The objects are drawn from the shipped CRDs' own schemas (deploy/base), with strings that are known
to break naive parsers: other scripts' digits, thousands of digits, non-ASCII, control characters."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podmeter.model.configuration import decode_configuration
from podmeter.model.endpoint_slices import decode_slice, decode_slice_digest, identity_id
from podmeter.model.records import DecodeError, decode_namespace, decode_pod

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "base"

# Strings a parser might mistake for numbers, names or addresses.
TRICKY = st.sampled_from(["\u00b2", "\u0663", "\uff11", "1" * 5000, "0", "007", "-1", "4294967296", "4294967295",
                          "1e3", " 1", "10.0.0.1", "fd00::1", "::ffff:10.0.0.1", "fe80::1%eth0", "", "a/b", "\x1b[2K",
                          "\x00", "default", "web"])


def crd_schema(file: str) -> dict[str, Any]:
    crd = yaml.safe_load((DEPLOY / file).read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def strings(schema: dict[str, Any]) -> st.SearchStrategy[str]:
    longest = int(schema.get("maxLength", 64))
    drawn = st.one_of(TRICKY, st.text(max_size=min(longest, 64)))
    return drawn.filter(lambda s: len(s) <= longest)


def objects(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the API server accepts under ``schema`` (the subset of OpenAPI v3 the CRDs use; patterns and
    CEL rules are not applied, so the values are a superset of what the server lets through)."""
    kind = schema.get("type")
    if kind == "string":
        return strings(schema)
    if kind == "integer":
        return st.integers(int(schema.get("minimum", -(2**63))), int(schema.get("maximum", 2**63 - 1)))
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(objects(schema.get("items", {})), max_size=min(int(schema.get("maxItems", 4)), 4))
    if kind == "object":
        return dicts(schema)
    return st.none()


def dicts(schema: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = st.fixed_dictionaries({k: objects(v) for k, v in properties.items() if k in required},
                                  optional={k: objects(v) for k, v in properties.items() if k not in required})
    extra = schema.get("additionalProperties")
    if not isinstance(extra, dict):
        return fixed
    more = st.dictionaries(strings({}), objects(extra), max_size=3)
    return st.builds(lambda a, b: {**b, **a}, fixed, more)


def with_meta(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return {**obj, "metadata": {"name": name, "resourceVersion": "5"}}


def total(decode: Any, obj: Any) -> None:
    for form in (obj, json.dumps(obj).encode()):
        with contextlib.suppress(DecodeError):
            decode(form)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(dicts(crd_schema("crd-podslices.yaml")), strings({"maxLength": 63}))
def test_every_podslice_the_crd_admits_decodes_or_is_refused(obj: dict[str, Any], name: str) -> None:
    total(decode_slice, with_meta(obj, name))
    total(decode_slice_digest, with_meta(obj, name))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(dicts(crd_schema("crd-metricsconfigurations.yaml")))
def test_every_metricsconfiguration_the_crd_admits_decodes_or_is_refused(obj: dict[str, Any]) -> None:
    total(decode_configuration, with_meta(obj, "default"))


POD_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "metadata": {"type": "object", "properties": {
        "name": {"type": "string"}, "namespace": {"type": "string"}, "uid": {"type": "string"},
        "resourceVersion": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"type": "string"}, "name": {"type": "string"}, "controller": {"type": "boolean"}}}}}},
    "spec": {"type": "object", "properties": {"nodeName": {"type": "string"}, "hostNetwork": {"type": "boolean"}}},
    "status": {"type": "object", "properties": {
        "phase": {"type": "string"}, "podIP": {"type": "string"},
        "podIPs": {"type": "array", "items": {"type": "object", "properties": {"ip": {"type": "string"}}}}}}}}


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(dicts(POD_SCHEMA))
def test_every_pod_and_namespace_decodes_or_is_refused(obj: dict[str, Any]) -> None:
    total(decode_pod, obj)
    total(decode_namespace, obj)


@given(st.one_of(TRICKY, st.text(max_size=12)))
def test_an_identity_key_is_what_the_operator_writes_or_nothing(key: str) -> None:
    canonical = re.fullmatch(r"[1-9][0-9]{0,9}", key, re.ASCII) is not None and int(key) < 2**32
    assert identity_id(key) == (int(key) if canonical else None)
