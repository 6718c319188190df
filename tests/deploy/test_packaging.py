"""Packaging: the product (agent, operator, inspect, doctor, demo) needs nothing of the lab, whose code and
third-party packages are the `lab` extra; every package the code imports is declared; the lab's commands
say what is missing instead of a traceback where the extra is not installed (or in the image).

All in this process: the modules under test are imported afresh with the lab and its packages hidden
(:func:`fresh_podmeter`), then the process's own modules are put back.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "podmeter"
PRODUCT_COMMANDS = ("agent", "operator", "observe", "inspect", "doctor", "demo", "bpffs")
LAB_CLI = ("podmeter.cli.lab", "podmeter.cli.apiserver", "podmeter.cli.node")
# What the product must never load: the lab, and the packages only the lab needs (matplotlib brings numpy
# and PIL). pyyaml is the lab's too, but also lightkube's (it reads kubeconfigs with it), so it is in the
# image and lightkube may load it; podmeter's own product modules may not.
LAB_ONLY = ("podmeter.lab", "matplotlib", "rich", "numpy", "PIL", "yaml")
ALLOWED_IMPORTERS: dict[str, tuple[str, ...]] = {"yaml": ("lightkube",)}
MESSAGE = "the lab needs the lab extra: pip install 'podmeter[lab]'"


def _under(name: str, roots: Sequence[str]) -> str | None:
    """The one of ``roots`` that ``name`` is or is a submodule of."""
    return next((root for root in roots if name == root or name.startswith(root + ".")), None)


def _importer() -> str:
    """The module whose import statement is running (the first frame outside importlib and this file)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith("importlib") and name != __name__:
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class Hide(importlib.abc.MetaPathFinder):
    """Makes the hidden modules unimportable (as if not installed) and records who asked for them: as a
    finder, every load of one; through :meth:`import_hook`, every import statement of a podmeter module
    that names one, even one already loaded (by an allowed importer)."""

    def __init__(self, hidden: Sequence[str], allowed: dict[str, tuple[str, ...]] | None = None) -> None:
        self.hidden = set(hidden)
        self.allowed = allowed or {}
        self.attempts: list[tuple[str, str]] = []  # (module, importer)

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        root = _under(fullname, sorted(self.hidden))
        if root is None:
            return None
        importer = _importer()
        if _under(importer, [root, *self.allowed.get(root, ())]):
            return None  # allowed, or the inside of an allowed one: the normal finders load it
        self.attempts.append((fullname, importer))
        raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by {__name__})", name=fullname)

    def import_hook(self, original: Callable[..., ModuleType]) -> Callable[..., ModuleType]:
        def hooked(name: str, globals: dict[str, object] | None = None, locals: object = None,
                   fromlist: Sequence[str] | None = (), level: int = 0) -> ModuleType:
            importer = str((globals or {}).get("__name__", ""))
            if _under(importer, ["podmeter"]):
                absolute = name
                if level:
                    absolute = importlib.util.resolve_name("." * level + name, str((globals or {})["__package__"]))
                for target in (absolute, *(f"{absolute}.{item}" for item in fromlist or ())):
                    root = _under(target, sorted(self.hidden))
                    if root and not _under(importer, [root]) and (target, importer) not in self.attempts:
                        self.attempts.append((target, importer))
            return original(name, globals, locals, fromlist, level)
        return hooked


@contextlib.contextmanager
def fresh_podmeter(hide: Hide) -> Iterator[Hide]:
    """podmeter imported anew while ``hide`` is first on sys.meta_path and the hidden modules are out of
    sys.modules; afterwards sys.modules holds this process's own podmeter (and hidden modules) again."""
    def ours(name: str) -> bool:
        return _under(name, ["podmeter", *hide.hidden]) is not None

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.meta_path.insert(0, hide)
    original_import = builtins.__import__
    builtins.__import__ = hide.import_hook(original_import)
    try:
        yield hide
    finally:
        builtins.__import__ = original_import
        sys.meta_path.remove(hide)
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def product_modules() -> list[str]:
    """Every module of the installed product: podmeter without the lab and its commands."""
    names = []
    for path in sorted(SRC.rglob("*.py")):
        parts = ("podmeter", *path.relative_to(SRC).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not _under(name, ["podmeter.lab", *LAB_CLI, "podmeter.__main__"]):
            names.append(name)
    return names


@pytest.mark.parametrize("command", PRODUCT_COMMANDS)
def test_a_product_command_imports_nothing_of_the_lab(command: str) -> None:
    with fresh_podmeter(Hide(LAB_ONLY, ALLOWED_IMPORTERS)) as hide:
        from podmeter.cli.main import build_parser

        parser = build_parser(command)
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert command in subcommands.choices
        loaded = sorted(n for n in sys.modules if _under(n, [m for m in LAB_ONLY if m not in ALLOWED_IMPORTERS]))
    assert hide.attempts == [] and loaded == []


def test_no_product_module_imports_the_lab_or_its_packages() -> None:
    # Also the modules a command's run() imports only when it runs (datapaths, backends, endpoints).
    with fresh_podmeter(Hide(LAB_ONLY, ALLOWED_IMPORTERS)) as hide:
        for name in product_modules():
            __import__(name)
    assert hide.attempts == []


def test_no_product_file_imports_the_lab_or_its_packages_even_in_a_function() -> None:
    # What runs only on a code path (a function's import) is seen here; lint-imports checks the same rule.
    files = [p for p in SRC.rglob("*.py") if not _is_lab_file(p)]
    named = {name: files for name, files in imports(files).items() if _under(name, LAB_ONLY)}
    assert named == {}


@pytest.mark.parametrize("command", ["lab", "apiserver", "node"])
@pytest.mark.parametrize("missing", [("matplotlib", "rich"), ("podmeter.lab", *LAB_CLI, "matplotlib", "rich")],
                         ids=["without-the-extra", "the-image"])
def test_a_lab_command_without_the_extra_says_so_in_one_line(
        command: str, missing: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with fresh_podmeter(Hide(missing)):
        from podmeter.cli.main import main

        status = main([command, "--help"])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err == f"podmeter {command}: {MESSAGE}\n"


def test_help_lists_the_lab_commands_as_needing_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    with fresh_podmeter(Hide(("podmeter.lab", *LAB_CLI, "matplotlib", "rich"))):
        from podmeter.cli.main import main

        with pytest.raises(SystemExit) as exit_:
            main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("lab", "apiserver", "node"):
        assert re.search(rf"^\s+{command}\s+\(lab\) needs the lab extra", out, re.MULTILINE), out
    for command in PRODUCT_COMMANDS:
        assert re.search(rf"^\s+{command}\s+\w", out, re.MULTILINE), out


def test_with_the_extra_a_lab_command_is_the_real_one() -> None:
    from podmeter.cli.main import build_parser, lab_missing

    assert lab_missing() is None  # `make test` installs .[dev,lab]
    args = build_parser("lab").parse_args(["lab", "short"])
    assert args.func.__module__ == "podmeter.cli.lab"


# --- the declared dependencies -----------------------------------------------------------------------------


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _requirement_name(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert found, requirement
    return _normalize(found.group(0))


def imports(paths: Sequence[Path]) -> dict[str, set[str]]:
    """Module -> files, for every absolute import anywhere in the files (in functions too)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if _under(node.module, ["podmeter"]):  # `from podmeter import lab`
                    names += [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def third_party_imports(paths: Sequence[Path]) -> dict[str, set[str]]:
    """Module -> files, for every import of a non-stdlib, non-podmeter module."""
    return {name: files for name, files in imports(paths).items()
            if name.partition(".")[0] not in (*sys.stdlib_module_names, "podmeter")}


def distribution_of(module: str) -> str:
    """The installed distribution that holds ``module`` (lightkube.models is lightkube-models', not
    lightkube's, though both install under lightkube/)."""
    candidates = importlib.metadata.packages_distributions()[module.partition(".")[0]]
    if len(set(candidates)) > 1:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        origin = Path(spec.origin).resolve()
        candidates = [name for name in candidates
                      if any(Path(str(f.locate())).resolve() == origin
                             for f in importlib.metadata.distribution(name).files or ())]
    assert len(set(candidates)) == 1, (module, candidates)
    return _normalize(candidates[0])


def _distributions(imports: dict[str, set[str]]) -> set[str]:
    return {distribution_of(name) for name in imports}


def _is_lab_file(path: Path) -> bool:
    relative = path.relative_to(SRC).as_posix()
    return relative.startswith("lab/") or (relative.startswith("cli/") and f"podmeter.cli.{path.stem}" in LAB_CLI)


def project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def test_the_product_declares_every_package_it_imports_and_no_lab_package() -> None:
    files = [p for p in SRC.rglob("*.py") if not _is_lab_file(p)]
    imported = _distributions(third_party_imports(files))
    declared = {_requirement_name(r) for r in project()["dependencies"]}  # type: ignore[attr-defined]
    assert imported == declared, f"imported but not declared: {imported - declared}; " \
                                 f"declared but not imported: {declared - imported}"


def test_the_lab_extra_is_what_the_lab_imports_beyond_the_product() -> None:
    from podmeter.cli.main import LAB_REQUIRES

    files = [p for p in SRC.rglob("*.py") if _is_lab_file(p)]
    lab_imports = third_party_imports(files)
    product = {_requirement_name(r) for r in project()["dependencies"]}  # type: ignore[attr-defined]
    extra = {_requirement_name(r) for r in project()["optional-dependencies"]["lab"]}  # type: ignore[index]
    assert _distributions(lab_imports) - product == extra
    assert not extra & product
    # main.py checks the extra by import name, without importing it
    assert {distribution_of(name) for name in LAB_REQUIRES} == extra
