"""The ``podmeter`` console script: one subcommand per module of :mod:`podmeter.cli`.

Every long option can also come from an environment variable ``PODMETER_<NAME>`` (``--node-name`` ->
``PODMETER_NODE_NAME``); a flag on the command line wins over the environment. A variable whose value the
option would refuse is a usage error, as the flag would be (:mod:`podmeter.cli.parsing`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from podmeter.cli.parsing import Parser, VersionAction, give_every_default_a_help, use_podmeter_help, walk

# Subcommand modules; each defines ``register(subparsers) -> None`` and sets ``func`` on its parser.
COMMANDS = ("agent", "operator", "observe", "apiserver", "node", "lab", "inspect", "doctor", "demo", "bpffs",
            "completion")
# The lab's commands: they import podmeter.lab, which is only usable with the `lab` extra installed
# (and is not in the image at all). The product's commands never import it (tests/deploy/test_packaging.py).
LAB_COMMANDS = frozenset({"apiserver", "node", "lab"})
# What the `lab` extra of pyproject.toml brings, by import name (tests/deploy/test_packaging.py keeps them equal).
LAB_REQUIRES = ("matplotlib", "rich", "yaml", "pyroute2")
LAB_EXTRA_MISSING = "the lab needs the lab extra: pip install 'podmeter[lab]'"


def lab_missing() -> str | None:
    """The first module the lab needs that cannot be imported here (its own package, or one of the lab
    extra's), or None; found without importing any of them."""
    for name in ("podmeter.lab", *LAB_REQUIRES):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def _is_lab_module(name: str | None) -> bool:
    """Whether a module that failed to import is the lab's (its package, its commands, its extra's)."""
    if not name:
        return False
    if name == "podmeter.lab" or name.startswith("podmeter.lab."):
        return True
    return name.partition(".")[0] in LAB_REQUIRES or name in {f"podmeter.cli.{c}" for c in LAB_COMMANDS}


def _lab_extra_missing(command: str) -> int:
    print(f"podmeter {command}: {LAB_EXTRA_MISSING}", file=sys.stderr)
    return 2


def _register_unavailable(subparsers: Any, name: str) -> None:
    """A placeholder for a lab command, listed by `podmeter --help` where the lab cannot run."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help="(lab) needs the lab extra: pip install 'podmeter[lab]'", add_help=False)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=lambda args: _lab_extra_missing(name))


def env_defaults(parser: argparse.ArgumentParser) -> None:
    """Take the default of every long option from ``PODMETER_<NAME>`` when that variable is set. A value
    the option refuses (its type or its choices) is kept in ``parser.env_errors``: parsing that command
    then fails with a usage error naming the variable, unless the flag is given on the command line."""
    errors: dict[argparse.Action, str] = getattr(parser, "env_errors", {})
    for action in parser._actions:
        long_opts = [o for o in action.option_strings if o.startswith("--")]
        if not long_opts or action.dest in ("help", "version"):
            continue
        env_name = "PODMETER_" + long_opts[0][2:].upper().replace("-", "_")
        if env_name in os.environ:
            raw = os.environ[env_name]
            try:
                value = _typed_env(action, raw)
                _check_choices(action, value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                errors[action] = f"{env_name}={raw!r} (for {long_opts[0]}): {exc}"
                continue
            action.default = value
            action.required = False
    if errors and isinstance(parser, Parser):
        parser.env_errors = errors


def _check_choices(action: argparse.Action, value: object) -> None:
    if action.choices is None:
        return
    for item in value if isinstance(value, list) else [value]:
        if item not in action.choices:
            raise ValueError(f"invalid choice {item!r} (choose from {', '.join(map(str, action.choices))})")


def _typed_env(action: argparse.Action, raw: str) -> object:
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(action, argparse._AppendAction):
        # A repeatable option takes a comma-separated list from the environment (PODMETER_INTERFACE=a,b).
        return [_convert(action, item.strip()) for item in raw.split(",") if item.strip()]
    return _convert(action, raw)


def _convert(action: argparse.Action, raw: str) -> object:
    if action.type is not None and callable(action.type):
        return action.type(raw)
    return raw


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported (each pulls in its own stack:
    the agent aiohttp and lightkube, the lab matplotlib, the operator an etcd client), so a process starts
    in a fraction of the time. Where the lab cannot run (no `lab` extra, or the image, which has no
    podmeter.lab), its commands are placeholders that say so."""
    parser = Parser(
        prog="podmeter", description="Pod-level network observability for Kubernetes that cannot leak.",
        epilog="Every long option can also be set as PODMETER_<OPTION>; `podmeter COMMAND --help` for more.")
    parser.add_argument("--version", action=VersionAction,
                        help="print podmeter's version (and the commit it was built from, when known) and exit")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    lab_ok = lab_missing() is None if only is None or only in LAB_COMMANDS else True
    for name in COMMANDS if only is None else (only,):
        if name in LAB_COMMANDS and not lab_ok:
            _register_unavailable(subparsers, name)
            continue
        module = importlib.import_module(f"podmeter.cli.{name}")
        module.register(subparsers)
    for sub in subparsers.choices.values():
        env_defaults(sub)
    for each in walk(parser):
        use_podmeter_help(each)
        give_every_default_a_help(each)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words == ["--version"]:  # without importing any command
        from podmeter.version import describe

        print(describe())
        return 0
    command = words[0] if words and words[0] in COMMANDS else None
    if command in LAB_COMMANDS and lab_missing() is not None:
        return _lab_extra_missing(str(command))
    try:
        parser = build_parser(command)
        args = parser.parse_args(words)
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        # A lab command whose extra is only partly installed (the check above looks at top-level names).
        if command in LAB_COMMANDS and _is_lab_module(exc.name):
            return _lab_extra_missing(str(command))
        raise
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
