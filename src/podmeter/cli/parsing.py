"""The ``podmeter`` command's argument parsing: help that reads as plain text with every default shown,
and options taken from ``PODMETER_<NAME>`` checked like command-line flags.

* :class:`Parser` is the parser class of the command and of every subcommand (argparse gives
  subparsers their parent's class). A ``PODMETER_<NAME>`` value that does not convert or is not one of the
  option's choices is a usage error of that subcommand (exit status 2, its usage and which variable is
  wrong), unless the flag itself is on the command line, which wins.
* :class:`HelpFormatter` turns the reStructuredText of the modules' docstrings (used as descriptions)
  into plain text (````x```` -> ```x```, ``:mod:`x``` -> ``x``) and appends ``(default: X)`` to every
  option whose help does not say its default already.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator, Sequence
from typing import Any

from podmeter.model.hostport import host_port

_LITERAL = re.compile(r"``(.+?)``", re.S)
_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj|ref):`~?([^`]+)`")


def plain(text: str) -> str:
    """reStructuredText inline markup -> plain text with Markdown-style backticks."""
    return _ROLE.sub(r"\1", _LITERAL.sub(r"`\1`", text))


_BOOLEAN_DEFAULT = " (default: %(default)s)"
DEFAULT_ONLY = "\0default"  # the help of an option that had none: the formatter writes its default


def shown(value: object) -> str:
    """A default as a person writes it on the command line, never a Python repr: 60 for 60.0, on/off for a
    boolean, HOST:PORT for an address (``[::1]:9978``), a list as a comma-separated one (as
    ``PODMETER_<NAME>`` takes it)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
        host, port = value
        return host_port(host, port)
    if isinstance(value, (list, tuple)):
        return ",".join(shown(v) for v in value)
    return str(value)


def shows_default(action: argparse.Action) -> bool:
    """Whether a ``(default: X)`` belongs in this option's help: it has a default worth saying."""
    if not action.option_strings or action.required or action.help == argparse.SUPPRESS:
        return False
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return False
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    return not (isinstance(default, (str, list, tuple)) and not default)


class HelpFormatter(argparse.HelpFormatter):
    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _get_help_string(self, action: argparse.Action) -> str:
        # BooleanOptionalAction (Python < 3.14) appends its own "(default: %(default)s)", which would print
        # True or False: podmeter's own default text (on/off) replaces it.
        text = plain(action.help or "").replace(_BOOLEAN_DEFAULT, "")
        if text == DEFAULT_ONLY:
            text = ""
        if shows_default(action) and "default" not in text.lower():
            default = shown(action.default).replace("%", "%%")
            text = f"{text} (default: {default})" if text else f"(default: {default})"
        return text


class RawDescriptionHelpFormatter(HelpFormatter):
    """Descriptions and epilogs kept as written (examples, one per line), markup made plain."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in plain(text).splitlines(keepends=True))


def use_podmeter_help(parser: argparse.ArgumentParser) -> None:
    """podmeter's formatter for ``parser``, also where a command chose argparse's own (the raw-description
    one stays raw)."""
    raw = isinstance(parser.formatter_class, type) and issubclass(parser.formatter_class,
                                                                  argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDescriptionHelpFormatter if raw else HelpFormatter


class Parser(argparse.ArgumentParser):
    """An ArgumentParser with podmeter's help formatter and checked environment defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.env_errors: dict[argparse.Action, str] = {}

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        words = list(args) if args is not None else []
        for action, message in self.env_errors.items():
            if not any(word == flag or word.startswith(flag + "=") for word in words for flag in action.option_strings):
                self.error(message)
        return super().parse_known_args(args, namespace)


class VersionAction(argparse.Action):
    """``--version``: the version is looked up when asked for (it may run git), not on every start."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from podmeter.version import describe

        print(describe())
        parser.exit()


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every parser of its subcommands, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                yield from walk(sub)


def give_every_default_a_help(parser: argparse.ArgumentParser) -> None:
    """argparse prints no help line for an option without help: give those with a default one, so
    ``--help`` shows every default (the formatter adds the value)."""
    for action in parser._actions:
        if action.help is None and shows_default(action):
            action.help = DEFAULT_ONLY
