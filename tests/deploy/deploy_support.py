"""Shared helpers of the deploy tests (no tests here): render kustomizations with the real kubectl, find objects.

``render("overlays/default")`` runs ``kubectl kustomize deploy/overlays/default`` and returns its objects;
``render_with(tmp_path, resources=[...], components=[...])`` renders an ad-hoc overlay (to compose
components the way docs/install.md tells users to).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
OVERLAYS = sorted(p.parent.relative_to(DEPLOY).as_posix() for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))

needs_kubectl = pytest.mark.skipif(not Path(KUBECTL).exists(), reason="kubectl (with kustomize) is not installed")

Obj = dict[str, Any]
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
