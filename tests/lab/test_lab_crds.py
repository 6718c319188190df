"""The CRDs ``podmeter lab --kubeconfig`` installs: package data of ``podmeter.lab`` (``lab/crds``), so a wheel
install has them, and byte-for-byte the manifests of ``deploy/base`` (the ones a cluster install applies), so
the two cannot drift apart. ``deploy/base`` is the source: after changing a CRD there, copy it with
``cp deploy/base/crd-*.yaml src/podmeter/lab/crds/``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from podmeter.lab.external import crd_files

ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = ROOT / "deploy" / "base"
SHIPPED = ROOT / "src" / "podmeter" / "lab" / "crds"


def test_the_shipped_crds_are_byte_identical_to_deploy_base() -> None:
    deployed = {p.name: p.read_bytes() for p in DEPLOYED.glob("crd-*.yaml")}
    shipped = {p.name: p.read_bytes() for p in SHIPPED.glob("*.yaml")}
    assert sorted(deployed) == ["crd-metricsconfigurations.yaml", "crd-podslices.yaml"]
    assert sorted(shipped) == sorted(deployed), "copy them: cp deploy/base/crd-*.yaml src/podmeter/lab/crds/"
    differ = [name for name in deployed if shipped[name] != deployed[name]]
    assert differ == [], f"{differ} differ from deploy/base: cp deploy/base/crd-*.yaml src/podmeter/lab/crds/"


def test_the_lab_loads_them_as_package_resources() -> None:
    loaded = {f.name: yaml.safe_load(f.read_text()) for f in crd_files()}
    assert {name: crd["metadata"]["name"] for name, crd in loaded.items()} == {
        "crd-metricsconfigurations.yaml": "metricsconfigurations.podmeter.io",
        "crd-podslices.yaml": "podslices.podmeter.io"}
    assert all(crd["kind"] == "CustomResourceDefinition" for crd in loaded.values())


def test_a_wheel_holds_them(tmp_path: Path) -> None:
    # Built from a copy of the sources: a build in the checkout would leave build/ and *.egg-info there.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "wheels"), str(source)], check=True, capture_output=True,
                   timeout=120)
    [wheel] = (tmp_path / "wheels").glob("podmeter-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        held = {name.removeprefix("podmeter/lab/crds/"): archive.read(name) for name in archive.namelist()
                if name.startswith("podmeter/lab/crds/")}
    assert held == {p.name: p.read_bytes() for p in DEPLOYED.glob("crd-*.yaml")}
