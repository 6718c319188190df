"""Shared helpers of the deploy tests (no tests here): render kustomizations with the real kubectl, find objects,
parse a container's command line and environment with the real CLI, admit a MetricsConfiguration as the API
server would (its CRD's schema and CEL rules), and read the docs' YAML examples.

``render("overlays/default")`` runs ``kubectl kustomize deploy/overlays/default`` and returns its objects;
``render_with(tmp_path, resources=[...], components=[...])`` renders an ad-hoc overlay (to compose
components the way docs/install.md tells users to).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import celpy
import jsonschema
import pytest
import yaml

from podmeter.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCS = ROOT / "docs"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
OVERLAYS = sorted(p.parent.relative_to(DEPLOY).as_posix() for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))

needs_kubectl = pytest.mark.skipif(not Path(KUBECTL).exists(), reason="kubectl (with kustomize) is not installed")

Obj = dict[str, Any]
Schema = dict[str, Any]  # an OpenAPI v3 schema (the CRD's)
Grant = tuple[str, str, str, str, str]  # (scope: "cluster" or namespace, apiGroup, resource, verb, resourceName or "*")


def kustomize(directory: Path) -> list[Obj]:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed: {result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def _render_cached(relative: str) -> tuple[str, ...]:
    return tuple(yaml.safe_dump(obj) for obj in kustomize(DEPLOY / relative))


def render(relative: str) -> list[Obj]:
    """The objects ``kubectl kustomize deploy/<relative>`` prints (fresh copies: callers may mutate them)."""
    return [yaml.safe_load(text) for text in _render_cached(relative)]


def render_with(workdir: Path, resources: Sequence[str], components: Sequence[str] = ()) -> list[Obj]:
    """Render an overlay written into ``workdir`` that points at deploy/ paths (relative to deploy/)."""
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / r, workdir) for r in resources],
        "components": [os.path.relpath(DEPLOY / c, workdir) for c in components],
    }
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    return kustomize(workdir)


def find(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def container(workload: Obj, name: str | None = None) -> Obj:
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return dict(containers[0])
    return dict(next(c for c in containers if c["name"] == name))


def pod_containers(workload: Obj) -> list[Obj]:
    """Every container of the pod template, init containers first (the order the kubelet starts them in)."""
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def runtime_refusal(propagation: str | None, host_path: str, mountinfo: str) -> str | None:
    """Why the container runtime refuses to create a container that mounts the hostPath ``host_path`` with
    ``mountPropagation`` ``propagation``, on a node whose mounts are ``mountinfo`` (a /proc/PID/mountinfo
    text); None when it accepts. containerd's CRI rule (CRI-O's is the same), with its words: the mount that
    holds the path (the longest mount point above it) must be shared for ``Bidirectional``, shared or a
    slave for ``HostToContainer``; ``None`` (private, the default) asks nothing of it."""
    if propagation in (None, "None"):
        return None
    holding, optional = "", ""
    for line in mountinfo.splitlines():
        fields = line.split()
        point = fields[4]
        inside = host_path == point or host_path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(holding):
            holding, optional = point, " ".join(fields[6:fields.index("-", 6)])
    tags = optional.split()
    if propagation == "Bidirectional":
        if not any(t.startswith("shared:") for t in tags):
            return f"path {host_path!r} is mounted on {holding!r} but it is not a shared mount"
        return None
    assert propagation == "HostToContainer", propagation
    if not any(t.startswith(("shared:", "master:")) for t in tags):
        return f"path {host_path!r} is mounted on {holding!r} but it is not a shared or slave mount"
    return None


def env_map(cont: Obj) -> dict[str, Obj]:
    """Container env by name: each entry as in the manifest (``value`` or ``valueFrom``)."""
    return {e["name"]: e for e in cont.get("env", [])}


def grants(objects: list[Obj], namespace: str, account: str) -> set[Grant]:
    """Every (scope, group, resource, verb, name) the bindings give ``namespace/account``; wildcards kept as-is."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("Role", "ClusterRole")}
    out: set[Grant] = set()
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        subjects = binding.get("subjects", [])
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace") == namespace
                   for s in subjects):
            continue
        ref = binding["roleRef"]
        role_ns = None if ref["kind"] == "ClusterRole" else binding["metadata"]["namespace"]
        role = roles.get((ref["kind"], role_ns, ref["name"]))
        assert role is not None, f"{binding['metadata']['name']} refers to a missing {ref['kind']} {ref['name']}"
        scope = "cluster" if binding["kind"] == "ClusterRoleBinding" else binding["metadata"]["namespace"]
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or ["*"]:
                            out.add((scope, group, resource, verb, name))
    return out


def request_attributes(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str, str, str] | None:
    """(namespace or "", apiGroup, resource[/subresource], verb, name or "") of a resource request, the way
    the API server's authorizer sees it; None for non-resource paths (discovery, /version)."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None
    watch_path = rest[0] == "watch"
    if watch_path:
        rest = rest[1:]
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else ""), (rest[2] if len(rest) > 2 else "")
    if sub:
        resource = f"{resource}/{sub}"
    if method == "GET":
        watching = watch_path or query.get("watch") in ("true", "1")
        verb = "watch" if watching else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
        if verb == "delete" and not name:
            verb = "deletecollection"
    return namespace, group, resource, verb, name


def authorized(allowed: set[Grant], attributes: tuple[str, str, str, str, str]) -> bool:
    """RBAC's rule: some grant matches group, resource, verb, the name (or any) and the namespace (or all)."""
    namespace, group, resource, verb, name = attributes
    return any(g == group and r == resource and v == verb and (n == "*" or (name and n == name))
               and (scope == "cluster" or (namespace and scope == namespace))
               for scope, g, r, v, n in allowed)


STASH = Path("/var/tmp/podmeter-deploy-stash")  # outside every emptyDir path of the manifests


def container_filesystem(workload: Obj, cont: Obj | None = None) -> list[str]:
    """argv prefix that gives a process the file system view of the workload's container (``cont``, default
    its only one), as far as it matters here: with ``readOnlyRootFilesystem`` a private mount namespace whose
    root mount is read-only, and a tmpfs at the mount path of each ``emptyDir`` volume. (hostPath volumes
    are translated by the callers.)"""
    spec = workload["spec"]["template"]["spec"]
    cont = container(workload) if cont is None else cont
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    steps = []
    if cont.get("securityContext", {}).get("readOnlyRootFilesystem"):
        steps.append("mount -o remount,bind,ro /")
    for mount in cont.get("volumeMounts", []):
        if "emptyDir" in volumes[mount["name"]]:
            size = volumes[mount["name"]]["emptyDir"].get("sizeLimit", "64Mi").replace("Mi", "m")
            steps.extend(_tmpfs_keeping_the_project(mount["mountPath"], size))
    script = " && ".join([*steps, 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]


def _tmpfs_keeping_the_project(path: str, size: str) -> list[str]:
    """Mount a tmpfs at ``path``; if this checkout (its venv, its sources) lives below it, as a CI clone in
    /tmp does, bind it back on top so the process under test still finds its interpreter."""
    mount = [f"mount -t tmpfs -o size={shlex.quote(size)} tmpfs {shlex.quote(path)}"]
    if not ROOT.is_relative_to(path):
        return mount
    STASH.mkdir(parents=True, exist_ok=True)
    project, stash = shlex.quote(str(ROOT)), shlex.quote(str(STASH))
    return [f"mount --bind {project} {stash}", *mount, f"mkdir -p {project}", f"mount --bind {stash} {project}"]


def service_account_dir() -> Path:
    """A directory for the files a pod gets mounted (its kubeconfig here): outside /tmp, which the containers
    get as an emptyDir, and readable by unprivileged users."""
    path = Path(tempfile.mkdtemp(prefix="podmeter-deploy-", dir="/var/tmp"))
    path.chmod(0o755)
    return path


def yaml_blocks(text: str) -> list[str]:
    """The ```yaml blocks of a Markdown text."""
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.S)


# --- flags and env as the container gets them, against the real CLI ----------------------------------------

FIELD_VALUES = {"spec.nodeName": "node-a", "metadata.namespace": "podmeter", "metadata.name": "podmeter-operator-x",
                "status.podIP": "10.0.0.5", "status.hostIP": "10.0.0.1"}


def resolved_env(objects: list[Obj], cont: Obj) -> dict[str, str]:
    """The container's environment as the kubelet would set it (downward API and ConfigMap keys resolved)."""
    maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    out: dict[str, str] = {}
    for entry in cont.get("env", []):
        source = entry.get("valueFrom")
        if source is None:
            out[entry["name"]] = str(entry["value"])
        elif "fieldRef" in source:
            out[entry["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in maps, f"{entry['name']}: ConfigMap {ref['name']} is not rendered"
            out[entry["name"]] = maps[ref["name"]][ref["key"]]
        else:
            raise AssertionError(f"unexpected env source {source}")
    return out


def parse_as_the_container(objects: list[Obj], cont: Obj) -> tuple[Any, dict[str, str]]:
    """The container's command line parsed by the real CLI in its environment: (arguments, environment); fails
    on a PODMETER_ variable that matches no option (it would be silently ignored)."""
    env = resolved_env(objects, cont)
    argv = list(cont.get("command", [])[1:]) + list(cont["args"])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PODMETER_") and k != "KUBECONFIG"}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        parser = build_parser()
        sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
        known = {"PODMETER_" + o[2:].upper().replace("-", "_")
                 for a in sub._actions for o in a.option_strings if o.startswith("--")}
        unknown = {k for k in env if k.startswith("PODMETER_")} - known
        assert not unknown, f"{argv[0]}: env vars that match no option (silently ignored): {sorted(unknown)}"
        return parser.parse_args(argv), env


# --- the API server's admission of a MetricsConfiguration, emulated (test_deploy_crd.py) --------------------


def crd() -> Obj:
    return find(render("overlays/default"), "CustomResourceDefinition", "metricsconfigurations.podmeter.io")


def version_schema() -> Schema:
    (version,) = crd()["spec"]["versions"]
    schema: Schema = version["schema"]["openAPIV3Schema"]
    return schema


class Rejected(Exception):
    """What the emulated API server refused, with its ``reasons``."""

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


CEL = celpy.Environment()


def cel_errors(value: Any, schema: Schema, path: str) -> list[str]:
    out: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = CEL.program(CEL.compile(rule["rule"]))
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
    stored: Obj = prune_and_default(obj, schema)
    validator = jsonschema.Draft202012Validator(to_json_schema(schema))
    reasons += [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(stored)]
    if not reasons:  # the server runs CEL rules only on values that passed the schema
        reasons += cel_errors(stored, schema, "")
    if reasons:
        raise Rejected(reasons)
    return stored
