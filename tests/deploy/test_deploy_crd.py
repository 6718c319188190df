"""The MetricsConfiguration CRD: its schema admits exactly the specs the agent accepts.

The API server's admission of a custom resource is emulated step by step, with real validators:
strict field validation (what ``kubectl apply`` asks for: unknown fields are refused), pruning of nulls
in non-nullable fields, defaulting, the OpenAPI schema (``jsonschema``) and the CEL rules
(``x-kubernetes-validations``, evaluated with ``cel-python``). The same examples go through
:func:`podmeter.model.configuration.decode_configuration`; both must agree on every one.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy_support import DEPLOY, Obj, find, needs_kubectl, render
from podmeter.model.configuration import Interest, decode_configuration
from podmeter.model.records import DecodeError

pytestmark = needs_kubectl

Schema = dict[str, Any]


def crd() -> Obj:
    return find(render("overlays/default"), "CustomResourceDefinition", "metricsconfigurations.podmeter.io")


def version_schema() -> Schema:
    (version,) = crd()["spec"]["versions"]
    schema: Schema = version["schema"]["openAPIV3Schema"]
    return schema


# --- the emulated admission -------------------------------------------------------------------------------


class Rejected(Exception):
    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def _is_object_with_fields(schema: Schema) -> bool:
    return schema.get("type") == "object" and "properties" in schema and not schema.get(
        "x-kubernetes-preserve-unknown-fields")


def unknown_fields(value: Any, schema: Schema, path: str) -> list[str]:
    """Strict field validation: every field must be declared (``metadata`` is the server's own)."""
    out: list[str] = []
    if path == ".metadata":
        return out
    if isinstance(value, dict) and _is_object_with_fields(schema):
        for key, item in value.items():
            if key not in schema["properties"]:
                out.append(f'unknown field "{path.lstrip(".")}.{key}"'.replace('"".', '"'))
            else:
                out += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            out += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return out


def prune_and_default(value: Any, schema: Schema) -> Any:
    """Drop unknown fields and nulls of non-nullable fields, then apply defaults (apiextensions order)."""
    if isinstance(value, dict) and _is_object_with_fields(schema):
        out = {}
        for key, item in value.items():
            sub = schema["properties"].get(key)
            if sub is None or (item is None and not sub.get("nullable")):
                continue
            out[key] = prune_and_default(item, sub)
        for key, sub in schema["properties"].items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
        return out
    if isinstance(value, list) and "items" in schema:
        return [prune_and_default(item, schema["items"]) for item in value]
    return value


def to_json_schema(schema: Any) -> Any:
    """OpenAPI v3 (structural) -> JSON Schema: drop the x-kubernetes-* extensions, turn ``nullable`` into a type."""
    if isinstance(schema, list):
        return [to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: to_json_schema(v) for k, v in schema.items()
           if not k.startswith("x-kubernetes-") and k not in ("nullable", "properties")}
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
    if schema.get("nullable") and "type" in schema:
        out["type"] = [schema["type"], "null"]
    if isinstance(schema.get("pattern"), str):  # RE2 (the API server): "$" is the end of the text, Python's \Z
        out["pattern"] = re.sub(r"(?<!\\)\$$", r"\\Z", schema["pattern"])
    return out


_cel = celpy.Environment()


def cel_errors(value: Any, schema: Schema, path: str) -> list[str]:
    out: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _cel.program(_cel.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            out.append(f"{path.lstrip('.')}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key in schema["properties"]:
                out += cel_errors(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            out += cel_errors(item, schema["items"], f"{path}[{index}]")
    return out


def admit(obj: Obj, schema: Schema | None = None) -> Obj:
    """What the API server stores for ``obj`` (a create with fieldValidation=Strict), or Rejected."""
    schema = schema or version_schema()
    reasons = unknown_fields(obj, schema, "")
    stored = prune_and_default(obj, schema)
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    reasons += [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(stored)]
    if not reasons:  # the server runs CEL rules only on values that passed the schema
        reasons += cel_errors(stored, schema, "")
    if reasons:
        raise Rejected(reasons)
    return stored


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
        _cel.compile(rule)


def test_the_status_the_operator_writes_is_admitted() -> None:
    obj = config({"namespaces": {"include": ["a"]}})
    obj["status"] = {"conditions": [{
        "type": "Accepted", "status": "False", "reason": "Invalid", "message": "$.spec.namespaces: ...",
        "observedGeneration": 3, "lastTransitionTime": "2026-01-02T03:04:05Z"}]}
    assert admit(obj)["status"] == obj["status"]
