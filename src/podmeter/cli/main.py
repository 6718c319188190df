"""The ``podmeter`` console script: one subcommand per module of :mod:`podmeter.cli`.

Every long option can also come from an environment variable ``PODMETER_<NAME>`` (``--node-name`` ->
``PODMETER_NODE_NAME``); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Subcommand modules; each defines ``register(subparsers) -> None`` and sets ``func`` on its parser.
COMMANDS = ("agent", "operator", "apiserver", "node", "lab", "inspect", "doctor", "demo")


def env_defaults(parser: argparse.ArgumentParser) -> None:
    """Take the default of every long option from ``PODMETER_<NAME>`` when that variable is set."""
    for action in parser._actions:
        long_opts = [o for o in action.option_strings if o.startswith("--")]
        if not long_opts or action.dest == "help":
            continue
        env_name = "PODMETER_" + long_opts[0][2:].upper().replace("-", "_")
        if env_name in os.environ:
            action.default = _typed_env(action, os.environ[env_name])
            action.required = False


def _typed_env(action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse._StoreTrueAction):
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
    in a fraction of the time."""
    parser = argparse.ArgumentParser(
        prog="podmeter", description="Pod-level network observability for Kubernetes that cannot leak.",
        epilog="Every long option can also be set as PODMETER_<OPTION>; `podmeter COMMAND --help` for more.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS if only is None else (only,):
        module = importlib.import_module(f"podmeter.cli.{name}")
        module.register(subparsers)
    for sub in subparsers.choices.values():
        env_defaults(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(words)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
