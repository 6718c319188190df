"""The MetricsConfiguration CRD: its schema admits exactly the specs the agent accepts.

The API server's admission of a custom resource is emulated step by step (``admit``, in deploy_support.py),
with real validators: strict field validation (what ``kubectl apply`` asks for: unknown fields are refused),
pruning of nulls in non-nullable fields, defaulting, the OpenAPI schema (``jsonschema``) and the CEL rules
(``x-kubernetes-validations``, evaluated with ``cel-python``). The same examples go through
:func:`podmeter.model.configuration.decode_configuration`; both must agree on every one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy_support import CEL, DEPLOY, Obj, Rejected, Schema, admit, crd, needs_kubectl, version_schema
from podmeter.model.configuration import Interest, decode_configuration
from podmeter.model.records import DecodeError

pytestmark = needs_kubectl


def decodes(obj: Obj) -> Interest | None:
    try:
        return decode_configuration(obj).interest
    except DecodeError:
        return None


def config(spec: Any = None, *, has_spec: bool = True) -> Obj:
    obj: Obj = {"apiVersion": "podmeter.io/v1alpha1", "kind": "MetricsConfiguration", "metadata": {"name": "default"}}
    if has_spec:
        obj["spec"] = spec
    return obj


# --- the examples ----------------------------------------------------------------------------------------

LONG = "a" * 63
VALID = {
    "no spec": config(has_spec=False),
    "empty spec": config({}),
    "include": config({"namespaces": {"include": ["shop", "a", "a-b-1", "0x", LONG]}}),
    "exclude": config({"namespaces": {"exclude": ["kube-system"]}}),
    "empty include, exclude": config({"namespaces": {"include": [], "exclude": ["x"]}}),
    "include, empty exclude": config({"namespaces": {"include": ["x"], "exclude": []}}),
    "both empty": config({"namespaces": {"include": [], "exclude": []}}),
    "empty namespaces": config({"namespaces": {}}),
    "annotations off": config({"annotations": False}),
    "annotations on, include": config({"annotations": True, "namespaces": {"include": ["x"]}}),
    "duplicates": config({"namespaces": {"include": ["a", "a"]}}),
    "null include": config({"namespaces": {"include": None, "exclude": ["x"]}}),
    "null namespaces": config({"namespaces": None}),
    "null spec": config(None),
    "10,000 names": config({"namespaces": {"include": [f"ns-{i}" for i in range(10_000)]}}),
}
INVALID = {
    "both non-empty": config({"namespaces": {"include": ["a"], "exclude": ["b"]}}),
    "upper case": config({"namespaces": {"include": ["Shop"]}}),
    "leading dash": config({"namespaces": {"include": ["-a"]}}),
    "trailing dash": config({"namespaces": {"exclude": ["a-"]}}),
    "underscore": config({"namespaces": {"include": ["a_b"]}}),
    "dot (a subdomain, not a label)": config({"namespaces": {"include": ["a.b"]}}),
    "trailing newline": config({"namespaces": {"include": ["shop\n"]}}),
    "empty name": config({"namespaces": {"include": [""]}}),
    "64 characters": config({"namespaces": {"include": ["a" * 64]}}),
    "254 characters": config({"namespaces": {"exclude": ["a" * 254]}}),
    "include is a string": config({"namespaces": {"include": "shop"}}),
    "a number as a name": config({"namespaces": {"include": [1]}}),
    "a null name": config({"namespaces": {"include": [None]}}),
    "annotations is a string": config({"annotations": "true"}),
    "annotations is a number": config({"annotations": 1}),
    "namespaces is a list": config({"namespaces": ["a"]}),
    "spec is a string": config("observe everything"),
    "unknown spec field": config({"observe": True}),
    "unknown namespaces field": config({"namespaces": {"includes": ["a"]}}),
    "10,001 names": config({"namespaces": {"include": [f"ns-{i}" for i in range(10_001)]}}),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_specs_are_admitted_and_accepted_by_the_agent(name: str) -> None:
    obj = VALID[name]
    stored = admit(obj)
    assert decodes(obj) is not None, "decode_configuration rejects what the CRD admits"
    assert decodes(stored) == decodes(obj), "the agent reads the stored object as it would read the original"


@pytest.mark.parametrize("name", INVALID)
def test_invalid_specs_are_rejected_by_both(name: str) -> None:
    obj = INVALID[name]
    assert decodes(obj) is None, "decode_configuration accepts what the test calls invalid"
    with pytest.raises(Rejected):
        admit(obj)


def test_the_admission_rejects_the_mixed_mode_with_the_agents_reason() -> None:
    obj = INVALID["both non-empty"]
    with pytest.raises(Rejected) as rejected:
        admit(obj)
    with pytest.raises(DecodeError) as decoded:
        decode_configuration(obj)
    (reason,) = rejected.value.reasons
    assert reason == "spec.namespaces: include and exclude cannot both be non-empty; use one mode"
    assert reason.partition(": ")[2] in str(decoded.value)


def test_a_null_annotations_field_is_stored_as_the_default() -> None:
    """The one input the two treat differently, by construction: the API server drops a null in a
    non-nullable field and applies the default, so the agent never receives the null it would refuse."""
    obj = config({"annotations": None, "namespaces": {"include": ["x"]}})
    assert decodes(obj) is None
    stored = admit(obj)
    assert stored["spec"]["annotations"] is True
    assert decodes(stored) == Interest(frozenset({"x"}), frozenset(), True)


def test_unknown_fields_and_defaults_are_emulated() -> None:
    """Controls for the emulation itself: a field outside the schema is named; a default is filled in."""
    with pytest.raises(Rejected) as rejected:
        admit(config({"namespaces": {"include": ["a"], "includes": ["b"]}}))
    assert rejected.value.reasons == ['unknown field "spec.namespaces.includes"']
    assert admit(config({}))["spec"] == {"annotations": True}


def test_the_crd_refuses_a_name_podmeter_would_ignore() -> None:
    """podmeter reads only the object named default: the root CEL rule on metadata.name refuses the others,
    so no configuration can exist that is silently ignored."""
    obj = config({"namespaces": {"include": ["shop"]}})
    obj["metadata"]["name"] = "shop-only"
    with pytest.raises(Rejected) as rejected:
        admit(obj)
    (reason,) = rejected.value.reasons
    assert "podmeter reads only the MetricsConfiguration named default" in reason
    assert decodes(obj) is not None  # the spec itself is fine: the name alone is refused
    assert admit(config({"namespaces": {"include": ["shop"]}}))["metadata"]["name"] == "default"
    (rule,) = version_schema()["x-kubernetes-validations"]
    assert rule["rule"] == "self.metadata.name == 'default'"


# --- the examples shipped in deploy/examples ---------------------------------------------------------------


EXAMPLES = sorted((DEPLOY / "examples").glob("metricsconfiguration-*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_shipped_examples_are_admitted_and_accepted(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert obj["metadata"]["name"] == "default"
    admit(obj)
    assert decodes(obj) is not None


# --- the CRD object itself --------------------------------------------------------------------------------


def structural_problems(schema: Schema, path: str = "", in_junctor: bool = False) -> list[str]:
    """The rules of a structural schema that matter here (see the apiextensions documentation)."""
    out: list[str] = []
    if not in_junctor and "type" not in schema and not schema.get("x-kubernetes-int-or-string") \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.append(f"{path or '/'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        out.append(f"{path}: properties and additionalProperties together")
    if path == "/properties/metadata" and set(schema) - {"type"}:
        out.append(f"{path}: only the type of metadata may be given")
    for key in ("allOf", "anyOf", "oneOf", "not"):
        if key in schema:
            for i, sub in enumerate(schema[key] if isinstance(schema[key], list) else [schema[key]]):
                out += structural_problems(sub, f"{path}/{key}/{i}", in_junctor=True)
    for key, sub in schema.get("properties", {}).items():
        out += structural_problems(sub, f"{path}/properties/{key}", in_junctor)
    if "items" in schema:
        out += structural_problems(schema["items"], f"{path}/items", in_junctor)
    return out


def test_the_crd_is_what_design_md_names() -> None:
    obj = crd()
    kubernetes_validate.validate(obj, "1.32", strict=True)
    spec = obj["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["plural"], spec["names"]["kind"]) == (
        "podmeter.io", "Cluster", "metricsconfigurations", "MetricsConfiguration")
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}  # the operator writes status through the subresource
    assert structural_problems(version_schema()) == []


def test_every_cel_rule_compiles() -> None:
    rules = []

    def walk(schema: Schema) -> None:
        rules.extend(r["rule"] for r in schema.get("x-kubernetes-validations", []))
        for sub in schema.get("properties", {}).values():
            walk(sub)
        if "items" in schema:
            walk(schema["items"])

    walk(version_schema())
    assert rules
    for rule in rules:
        CEL.compile(rule)


def test_the_status_the_operator_writes_is_admitted() -> None:
    obj = config({"namespaces": {"include": ["a"]}})
    obj["status"] = {"conditions": [{
        "type": "Accepted", "status": "False", "reason": "Invalid", "message": "$.spec.namespaces: ...",
        "observedGeneration": 3, "lastTransitionTime": "2026-01-02T03:04:05Z"}]}
    assert admit(obj)["status"] == obj["status"]
