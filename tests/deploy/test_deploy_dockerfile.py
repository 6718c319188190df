"""The Dockerfile, checked without a Docker engine: stages, users, paths, the build context, the BPF
build step itself (run here with the same shell command, on a copy of what the context would hold), and
the rule that the image holds the product only: the build stage's removal of the lab, run on a copy of src/.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy_support import ROOT, container, find, needs_kubectl, render

EM_BPF = 247


@dataclass
class Stage:
    name: str
    image: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): instructions with continuation lines joined, comments dropped."""
    logical: list[str] = []
    current = ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "a continuation line runs off the end of the file"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for entry in logical:
        keyword, _, rest = entry.strip().partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, image))
        elif keyword == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def dockerfile() -> list[Stage]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())[1]


def stage(name: str) -> Stage:
    return next(s for s in dockerfile() if s.name == name)


def apt_packages(stage: Stage) -> set[str]:
    packages: set[str] = set()
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;", run):
            words = shlex.split(command)
            if "apt-get" in words and "install" in words:
                packages |= {w for w in words[words.index("install") + 1:] if not w.startswith("-")}
    return packages


def test_three_stages_and_a_slim_runtime_without_a_compiler() -> None:
    stages = dockerfile()
    assert [s.name for s in stages] == ["bpf", "build", "runtime"]
    assert "clang" in apt_packages(stage("bpf")) and "libbpf-dev" in apt_packages(stage("bpf"))
    runtime = stage("runtime")
    assert "slim" in runtime.image
    assert apt_packages(runtime) == {"libbpf1"}  # libbpf.so.1, loaded by the ctypes layer; nothing else
    assert not any(re.search(r"\b(clang|gcc|llvm)\b", run) for run in runtime.all("RUN"))


def test_the_python_of_the_image_satisfies_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = tuple(int(x) for x in project["requires-python"].removeprefix(">=").split("."))
    for name in ("build", "runtime"):
        found = re.match(r"python:(\d+)\.(\d+)", stage(name).image)
        assert found, stage(name).image
        assert (int(found.group(1)), int(found.group(2))) >= minimum
    assert stage("build").image == stage("runtime").image  # the virtualenv's interpreter path must exist


def test_the_runtime_user_and_entrypoint_match_the_manifests() -> None:
    runtime = stage("runtime")
    (user,) = runtime.all("USER")
    uid = int(user.split(":")[0])
    assert uid != 0
    (entrypoint,) = runtime.all("ENTRYPOINT")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert json.loads(entrypoint) == ["podmeter"] and "podmeter" in scripts
    # the virtualenv the build stage made is what the runtime runs
    assert any(arg.split() == ["--from=build", "/opt/podmeter", "/opt/podmeter"] for arg in runtime.all("COPY"))
    assert any("/opt/podmeter/bin" in env for env in runtime.all("ENV"))


@needs_kubectl
def test_exposed_ports_and_users_agree_with_the_deployments() -> None:
    objects = render("overlays/default")
    runtime = stage("runtime")
    exposed = {int(p) for line in runtime.all("EXPOSE") for p in line.split()}
    listens = set()
    for kind, name in (("DaemonSet", "podmeter-agent"), ("Deployment", "podmeter-operator")):
        env = {e["name"]: e.get("value") for e in container(find(objects, kind, name))["env"]}
        listens.add(int(env["PODMETER_LISTEN"].rpartition(":")[2]))
    assert exposed == listens
    (user,) = runtime.all("USER")
    operator = find(objects, "Deployment", "podmeter-operator")["spec"]["template"]["spec"]["securityContext"]
    assert operator["runAsUser"] == int(user.split(":")[0])
    agent = container(find(objects, "DaemonSet", "podmeter-agent"))["securityContext"]
    assert agent["runAsUser"] == 0  # the image's user is overridden only where capabilities are needed


def test_the_bpf_object_lands_where_the_package_data_expects_it() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    copies = [arg.split() for arg in stage("build").all("COPY") if arg.startswith("--from=bpf")]
    assert copies == [["--from=bpf", "/src/out/", "src/podmeter/bpf/"]]
    assert "bpf/*.o" in package_data["podmeter"]
    assert any("bpf/podmeter.bpf.o" in run for run in stage("build").all("RUN"))  # the build checks it


# --- the image holds the product only: no lab, no plotting libraries -------------------------------------

# What the image must not hold or import: the lab, and the packages of the `lab` extra (yaml: lightkube
# brings pyyaml into the image, but no podmeter module left there may import it).
LAB_ONLY = ("podmeter.lab", "matplotlib", "rich", "yaml", "numpy", "PIL")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def _names_the_lab(path: Path) -> bool:
    return any(name == root or name.startswith(root + ".") for name in _imports(path) for root in LAB_ONLY)


def _install_commands(run: str) -> list[list[str]]:
    commands = [shlex.split(command) for command in run.split("&&")]
    return [words for words in commands if len(words) > 1 and words[0].endswith("pip") and words[1] == "install"]


def test_the_build_stage_installs_the_package_without_extras() -> None:
    runs = stage("build").all("RUN")
    installs = [words for run in runs for words in _install_commands(run)]
    assert installs == [["/opt/podmeter/bin/pip", "install", "."]]  # not .[lab]: the lab extra stays out
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lab = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() for r in project["optional-dependencies"]["lab"]}
    product = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    assert {"matplotlib", "rich"} <= lab and not lab & product
    # and the build checks its result: neither the lab nor the plotting libraries are importable
    (install,) = [run for run in runs if _install_commands(run)]
    assert all(name in install for name in ("podmeter.lab", "matplotlib", "rich", "numpy", "PIL"))


def test_the_build_stage_removes_the_lab_before_the_install(tmp_path: Path) -> None:
    runs = stage("build").all("RUN")
    removals = [run for run in runs if shlex.split(run)[0] == "rm"]
    assert len(removals) == 1
    (install,) = [run for run in runs if _install_commands(run)]
    assert runs.index(removals[0]) < runs.index(install)
    # run it on a copy of what COPY src/ src/ brings in
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    result = subprocess.run(["sh", "-c", removals[0]], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    package = tmp_path / "src" / "podmeter"
    assert not (package / "lab").exists()
    # every module that imports the lab (or its packages) is gone, and nothing else
    lab_users = {p.relative_to(ROOT / "src") for p in (ROOT / "src" / "podmeter").rglob("*.py")
                 if "lab" not in p.relative_to(ROOT / "src" / "podmeter").parts[:1] and _names_the_lab(p)}
    left = {p.relative_to(tmp_path / "src") for p in package.rglob("*.py")}
    assert not lab_users & left, f"import the lab but would be in the image: {sorted(map(str, lab_users & left))}"
    removed = {p.relative_to(ROOT / "src") for p in (ROOT / "src" / "podmeter").rglob("*.py")
               if "__pycache__" not in p.parts} - left
    assert {p for p in removed if p.parts[1] != "lab"} == lab_users
    # the commands that stay are the product's, and the dispatcher knows the removed ones as the lab's
    from podmeter.cli.main import COMMANDS, LAB_COMMANDS

    kept = {name for name in COMMANDS if (package / "cli" / f"{name}.py").exists()}
    assert kept == set(COMMANDS) - LAB_COMMANDS
    assert {"agent", "operator", "inspect", "doctor"} <= kept


# --- the build context (.dockerignore) ---------------------------------------------------------------------


def ignore_rules() -> list[tuple[bool, str]]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        rules.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return rules


def _matches(pattern: str, path: str) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    candidates = [pattern, pattern.removeprefix("**/")] if pattern.startswith("**/") else [pattern]
    return any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates)


def in_context(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path (or a parent of it) decides."""
    included = True
    for negate, pattern in ignore_rules():
        if _matches(pattern, path):
            included = negate
    return included


def test_the_build_context_holds_what_the_copies_need_and_nothing_built_on_the_host() -> None:
    for name in ("bpf/podmeter.bpf.c", "bpf/podmeter_parse.h", "pyproject.toml", "src/podmeter/cli/main.py",
                 "src/podmeter/__main__.py"):
        assert (ROOT / name).exists() and in_context(name), name
    for name in ("src/podmeter/bpf/podmeter.bpf.o", ".venv/bin/python", "tests/conftest.py", ".git/HEAD",
                 "src/podmeter/__pycache__/x.pyc", "docs/datapath.md"):
        assert not in_context(name), name
    for stage_ in dockerfile():
        for arg in stage_.all("COPY"):
            words = arg.split()
            if words[0].startswith("--from"):
                continue
            for source in words[:-1]:
                assert (ROOT / source).exists() and in_context(source.rstrip("/")), source


# --- the BPF build step, run for real ----------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed")
def test_the_bpf_stage_command_compiles_every_program(tmp_path: Path) -> None:
    (command,) = stage("bpf").all("RUN")[1:]
    shutil.copytree(ROOT / "bpf", tmp_path / "bpf")
    result = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sources = sorted(p.name.removesuffix(".c") for p in (ROOT / "bpf").glob("*.bpf.c"))
    built = sorted(p.name.removesuffix(".o") for p in (tmp_path / "out").glob("*.o"))
    assert built == sources and "podmeter.bpf" in built
    for obj in (tmp_path / "out").glob("*.o"):
        header = obj.read_bytes()[:20]
        assert header[:4] == b"\x7fELF"
        assert int.from_bytes(header[18:20], "little") == EM_BPF, obj.name


def test_the_bpf_stage_uses_the_makefile_flags() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = next(line.strip() for line in makefile.splitlines() if line.strip().startswith("clang "))
    flags = [w for w in recipe.split() if w.startswith("-") and w not in ("-c", "-o")]
    (command,) = stage("bpf").all("RUN")[1:]
    normalized = command.replace("$(uname -m)", "$(ARCH)").replace(";", " ").split()
    for flag in flags:
        assert flag in normalized, flag


@pytest.mark.skipif(shutil.which("apt-cache") is None or not any(Path("/var/lib/apt/lists").glob("*Packages*")),
                    reason="not a Debian system with package lists")
def test_the_runtime_packages_exist_in_debian() -> None:
    for package in apt_packages(stage("runtime")):
        result = subprocess.run(["apt-cache", "show", package], capture_output=True, text=True)
        assert result.returncode == 0 and f"Package: {package}" in result.stdout, package
