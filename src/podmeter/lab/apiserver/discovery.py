"""Discovery documents (``/version``, ``/api``, ``/api/v1``, ``/apis``, group versions) as kubectl reads them.

Shapes follow discovery-*.json. Only the legacy (unaggregated) format is served: kubectl asks for the
aggregated ``apidiscovery.k8s.io`` form first and falls back when the answer is plain ``application/json``.
"""

from __future__ import annotations

from typing import Any

from podmeter.lab.apiserver.resources import ALL, ResourceType

VERSION = {
    "major": "1",
    "minor": "36",
    "emulationMajor": "1",
    "emulationMinor": "36",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "35",
    "gitVersion": "v1.36.2-podmeter-lab",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-11-29T00:00:00Z",
    "goVersion": "go1.26.6",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def _groups() -> dict[str, list[ResourceType]]:
    out: dict[str, list[ResourceType]] = {}
    for r in ALL:
        if r.group:
            out.setdefault(r.group, []).append(r)
    return out


def _group(name: str, version: str) -> dict[str, Any]:
    gv = {"groupVersion": f"{name}/{version}", "version": version}
    return {"name": name, "versions": [gv], "preferredVersion": gv}


def api_group_list() -> dict[str, Any]:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(name, rs[0].version) for name, rs in _groups().items()],
    }


def api_group(name: str) -> dict[str, Any] | None:
    rs = _groups().get(name)
    if not rs:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name, rs[0].version)}


def _entries(r: ResourceType) -> list[dict[str, Any]]:
    main: dict[str, Any] = {
        "name": r.plural,
        "singularName": r.singular,
        "namespaced": r.namespaced,
        "kind": r.kind,
        "verbs": list(r.verbs),
    }
    if r.short_names:
        main["shortNames"] = list(r.short_names)
    if r.categories:
        main["categories"] = list(r.categories)
    out = [main]
    if r.kind == "Pod":
        out.append(
            {"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding", "verbs": ["create"]}
        )
    if r.has_status:
        out.append(
            {
                "name": f"{r.plural}/status",
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": ["get", "patch", "update"],
            }
        )
    return out


def resource_list(group: str, version: str) -> dict[str, Any] | None:
    rs = [r for r in ALL if r.group == group and r.version == version]
    if not rs:
        return None
    head: dict[str, Any] = {"kind": "APIResourceList", "groupVersion": version}
    if group:  # the core list has no apiVersion (discovery-api-v1.json), the groups' have (coordination-v1)
        head = {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{group}/{version}"}
    return {**head, "resources": [e for r in rs for e in _entries(r)]}


# --- OpenAPI v3 --------------------------------------------------------------------------------------------
# kubectl reads /openapi/v3 to learn whether the server validates fields itself (a ``fieldValidation`` query
# parameter on the PATCH operation of the kind); if so it sends ``fieldValidation=Strict`` and does no
# client-side schema validation. These documents carry only that: paths and operations, no schemas.


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def openapi_root() -> dict[str, Any]:
    gvs = sorted({(r.group, r.version) for r in ALL})
    return {
        "paths": {
            _gv_path(g, v): {"serverRelativeURL": f"/openapi/v3/{_gv_path(g, v)}?hash=podmeter-lab"} for g, v in gvs
        }
    }


def _operation(r: ResourceType, action: str, params: list[str]) -> dict[str, Any]:
    return {
        "operationId": f"{action}{r.kind}",
        "parameters": [{"name": p, "in": "query", "schema": {"type": "string", "uniqueItems": True}} for p in params],
        "responses": {"200": {"description": "OK"}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": r.group, "version": r.version, "kind": r.kind},
    }


def openapi_gv(group: str, version: str) -> dict[str, Any] | None:
    rs = [r for r in ALL if r.group == group and r.version == version]
    if not rs:
        return None
    write = ["dryRun", "fieldManager", "fieldValidation"]
    paths: dict[str, Any] = {}
    for r in rs:
        base = "/" + _gv_path(group, version) + ("/namespaces/{namespace}" if r.namespaced else "")
        paths[f"{base}/{r.plural}"] = {
            "get": _operation(r, "list", ["labelSelector", "fieldSelector"]),
            "post": _operation(r, "post", write),
        }
        paths[f"{base}/{r.plural}/{{name}}"] = {
            "get": _operation(r, "get", []),
            "put": _operation(r, "put", write),
            "patch": _operation(r, "patch", [*write, "force"]),
            "delete": _operation(r, "delete", ["dryRun"]),
        }
        if r.has_status:
            paths[f"{base}/{r.plural}/{{name}}/status"] = {"patch": _operation(r, "patch", write)}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (podmeter lab)", "version": "v1.36.2"},
        "paths": paths,
        "components": {"schemas": {}},
    }
