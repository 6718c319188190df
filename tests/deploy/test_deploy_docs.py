"""The deployment docs agree with the code and the manifests: every option is in the configuration reference
with its variable and default, every overlay and component is named in the install guide, the examples
in the docs render (overlays) or are admitted (MetricsConfigurations), and every link resolves."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy_support import (
    DEPLOY,
    DOCS,
    OVERLAYS,
    ROOT,
    admit,
    container,
    env_map,
    find,
    kustomize,
    needs_kubectl,
    yaml_blocks,
)
from podmeter.cli.main import build_parser
from podmeter.model.configuration import decode_configuration

MINE = ("install.md", "configuration.md", "observing.md", "troubleshooting.md", "upgrade.md", "comparison.md")
DOCUMENTED_COMMANDS = ("agent", "operator", "doctor", "inspect", "bpffs")  # what runs on a cluster (the lab has lab.md)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def rows_by_command(text: str) -> dict[str, list[str]]:
    """Table rows of configuration.md, grouped by the `podmeter X` heading or paragraph above them."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        found = re.match(r"^(?:## )?`podmeter (\w+)", line)
        if found:
            current = found.group(1)
            out.setdefault(current, [])
        elif line.startswith("|") and current is not None:
            out[current].append(line)
    return out


def shown(default: Any) -> str | None:
    if default is None or default is False or default in ([], ""):
        return None
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


@pytest.mark.parametrize("command", DOCUMENTED_COMMANDS)
def test_the_configuration_reference_has_every_option(command: str) -> None:
    rows = rows_by_command((DOCS / "configuration.md").read_text()).get(command)
    assert rows, f"no table for podmeter {command}"
    for action in subcommands()[command]._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        option = longs[0]
        variable = "PODMETER_" + option[2:].upper().replace("-", "_")
        row = next((r for r in rows if re.search(rf"`{re.escape(option)}[ `]", r)), None)
        assert row is not None, f"podmeter {command} {option} is not documented"
        assert f"`{variable}`" in row, f"{option}: {variable} missing"
        default = shown(action.default)
        if default is not None and not action.required:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip("|"))]
            assert default in cells[2], f"{option}: the default is {default}, the row says {cells[2]}"


def test_the_install_guide_names_every_overlay_and_component() -> None:
    text = (DOCS / "install.md").read_text()
    components = [p.parent.relative_to(DEPLOY).as_posix() for p in (DEPLOY / "components").glob("*/kustomization.yaml")]
    for path in [*OVERLAYS, *components, "base"]:
        assert f"deploy/{path}" in text, path


@needs_kubectl
def test_the_own_overlay_example_of_the_install_guide_renders_and_validates(tmp_path: Path) -> None:
    (block,) = [b for b in yaml_blocks((DOCS / "install.md").read_text()) if "my-cluster/kustomization.yaml" in b]
    overlay = tmp_path / "my-cluster"
    overlay.mkdir()
    (tmp_path / "podmeter").symlink_to(ROOT)  # the layout the example assumes: ../podmeter is this repository
    (overlay / "kustomization.yaml").write_text(block)
    objects = kustomize(overlay)
    for obj in objects:
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, "1.32", strict=True)
    agent = container(find(objects, "DaemonSet", "podmeter-agent"))
    assert env_map(agent)["PODMETER_FILTER_MAP_SIZE"]["value"] == "131072"
    assert agent["image"] == "registry.example.com/podmeter:0.1.0"
    operator = container(find(objects, "Deployment", "podmeter-operator"))
    assert env_map(operator)["PODMETER_IDENTITY_BACKEND"]["value"] == "etcd"
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config["data"]["endpoints"].count("http://") == 3
    assert env_map(operator)["PODMETER_ETCD_ENDPOINTS"]["valueFrom"]["configMapKeyRef"]["name"] == \
        config["metadata"]["name"]
    assert find(objects, "ServiceMonitor", "podmeter")


@needs_kubectl
def test_metricsconfiguration_examples_in_the_docs_are_admitted_and_accepted() -> None:
    found = 0
    for name in MINE:
        for block in yaml_blocks((DOCS / name).read_text()):
            for obj in yaml.safe_load_all(block):
                if isinstance(obj, dict) and obj.get("kind") == "MetricsConfiguration":
                    found += 1
                    admit(obj)
                    decode_configuration(obj)
    assert found >= 2


EVERY_PAGE = sorted([*DOCS.glob("*.md"), *ROOT.glob("*.md"),
                     *(ROOT / d / "README.md" for d in ("bench", "deploy", "tests"))])


@pytest.mark.parametrize("page", EVERY_PAGE, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    """Every relative link of every page names a file of the repository (relative to the page), and none
    points outside it."""
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        resolved = (page.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
        assert resolved.exists(), f"{page.name}: {target}"
