"""Shared helpers of the deploy tests (no tests here): render kustomizations with the real kubectl, find objects.

``render("overlays/default")`` runs ``kubectl kustomize deploy/overlays/default`` and returns its objects;
``render_with(tmp_path, resources=[...], components=[...])`` renders an ad-hoc overlay (to compose
components the way docs/install.md tells users to).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
OVERLAYS = sorted(p.parent.relative_to(DEPLOY).as_posix() for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))

needs_kubectl = pytest.mark.skipif(not Path(KUBECTL).exists(), reason="kubectl (with kustomize) is not installed")

Obj = dict[str, Any]


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


def env_map(cont: Obj) -> dict[str, Obj]:
    """Container env by name: each entry as in the manifest (``value`` or ``valueFrom``)."""
    return {e["name"]: e for e in cont.get("env", [])}
