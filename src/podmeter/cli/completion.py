"""`podmeter completion bash|zsh`: a shell completion script, made from the command's own parsers.

    source <(podmeter completion bash)                        # this shell (bash)
    podmeter completion bash > /etc/bash_completion.d/podmeter
    source <(podmeter completion zsh)                         # this shell (zsh, after compinit)
    podmeter completion zsh > "${fpath[1]}/_podmeter"         # zsh: a file named _podmeter on $fpath

The script knows every command, option and choice of this podmeter (read from argparse at the moment it
is printed, so it matches the installed version); it completes commands, options, the choices of options
and arguments that have them, and file names for options that take a path.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from podmeter.cli.parsing import DEFAULT_ONLY, plain

SHELLS = ("bash", "zsh")
# Options whose value is a file or directory: by metavar, or by the option's name.
PATH_METAVARS = frozenset({"FILE", "PATH", "PEM", "DIR"})
PATH_NAME = re.compile(r"(kubeconfig|file|dir|bpffs|cert|key|ca|out|scenario)(-|$)")


@dataclass
class Option:
    flags: list[str]
    takes_value: bool
    choices: list[str] | None
    is_path: bool
    help: str
    repeatable: bool


@dataclass
class Command:
    """One parser: its options, the choices of its positional arguments, its subcommands."""

    help: str = ""
    options: list[Option] = field(default_factory=list)
    positionals: list[list[str] | None] = field(default_factory=list)  # choices per positional, or None
    children: dict[str, Command] = field(default_factory=dict)


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "completion", help="print a shell completion script (bash or zsh)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from podmeter.cli.main import build_parser

    tree = describe(build_parser())
    print(bash(tree) if args.shell == "bash" else zsh(tree), end="")
    return 0


# --- the parsers, as data ------------------------------------------------------------------------------


def _help(action: argparse.Action) -> str:
    text = action.help if isinstance(action.help, str) and action.help != DEFAULT_ONLY else ""
    return " ".join(plain(text).split())


def describe(parser: argparse.ArgumentParser, help_text: str = "") -> Command:
    command = Command(help_text)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: _help(choice) for choice in action._choices_actions}
            for name, sub in action.choices.items():
                command.children[name] = describe(sub, helps.get(name, ""))
            continue
        if action.help == argparse.SUPPRESS:
            continue
        choices = [str(c) for c in action.choices] if action.choices is not None else None
        if not action.option_strings:
            command.positionals.append(choices)
            continue
        takes_value = action.nargs != 0
        name = action.option_strings[-1].lstrip("-")
        is_path = takes_value and choices is None and (
            str(action.metavar or "") in PATH_METAVARS or getattr(action.type, "__name__", "") == "Path"
            or bool(PATH_NAME.search(name)))
        command.options.append(Option(list(action.option_strings), takes_value, choices, is_path, _help(action),
                                      isinstance(action, (argparse._AppendAction, argparse._CountAction))))
    return command


def _paths(command: Command, path: str = "") -> list[tuple[str, Command]]:
    out = [(path, command)]
    for name, child in command.children.items():
        out += _paths(child, f"{path}/{name}")
    return out


# --- bash -------------------------------------------------------------------------------------------------


def _words(items: list[str]) -> str:
    return shlex.quote(" ".join(items))


def bash(tree: Command) -> str:
    paths = _paths(tree)
    children = [f'        "{path}/{name}") path="{path}/{name}" ;;'
                for path, command in paths for name in command.children]
    values = [f'        "{path}|{flag}") return 0 ;;'
              for path, command in paths for option in command.options if option.takes_value for flag in option.flags]
    value_words = []
    for path, command in paths:
        for option in command.options:
            if not option.takes_value:
                continue
            reply = (f"COMPREPLY=($(compgen -W {_words(option.choices)} -- \"$cur\"))" if option.choices
                     else 'COMPREPLY=($(compgen -f -- "$cur"))' if option.is_path else "COMPREPLY=()")
            value_words += [f'        "{path}|{flag}") {reply} ;;' for flag in option.flags]
    options = [f'        "{path}") words={_words([f for o in command.options for f in o.flags])} ;;'
               for path, command in paths]
    arguments = []
    for path, command in paths:
        items = [*command.children, *(c for choices in command.positionals if choices for c in choices)]
        if items:
            arguments.append(f'        "{path}") words={_words(items)} ;;')
    nl = "\n"
    return f"""# bash completion for podmeter, made by `podmeter completion bash` (podmeter's own parsers).
# Load it with: source <(podmeter completion bash)
__podmeter_child() {{
    case "$1/$2" in
{nl.join(children)}
        *) return 1 ;;
    esac
    echo "$path"
}}

__podmeter_takes_value() {{
    case "$1|$2" in
{nl.join(values)}
    esac
    return 1
}}

__podmeter_value() {{
    case "$1|$2" in
{nl.join(value_words)}
        *) COMPREPLY=() ;;
    esac
}}

__podmeter_options() {{
    local words=""
    case "$1" in
{nl.join(options)}
    esac
    echo "$words"
}}

__podmeter_arguments() {{
    local words=""
    case "$1" in
{nl.join(arguments)}
    esac
    echo "$words"
}}

_podmeter() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" path="" next word i skip=0
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        [[ $word == = ]] && continue  # bash splits --option=value at "=" (COMP_WORDBREAKS): the value follows
        if ((skip)); then skip=0; continue; fi
        if [[ $word == -* ]]; then
            [[ $word != *=* ]] && __podmeter_takes_value "$path" "$word" && skip=1
            continue
        fi
        next=$(__podmeter_child "$path" "$word") && path=$next
    done
    [[ $cur == = ]] && cur=""
    if ((skip)); then
        [[ $prev == = ]] && prev="${{COMP_WORDS[COMP_CWORD-2]}}"
        __podmeter_value "$path" "$prev"
        return 0
    fi
    if [[ $cur == --*=* ]]; then
        local flag="${{cur%%=*}}"
        cur="${{cur#*=}}"
        __podmeter_value "$path" "$flag"
        COMPREPLY=("${{COMPREPLY[@]/#/$flag=}}")  # "=" is not a word break here: the word is --option=value
        return 0
    fi
    local candidates
    candidates=$(__podmeter_arguments "$path")
    if [[ $cur == -* || -z $candidates ]]; then
        candidates=$(__podmeter_options "$path")
    fi
    COMPREPLY=($(compgen -W "$candidates" -- "$cur"))
    return 0
}}

complete -F _podmeter podmeter
"""


# --- zsh --------------------------------------------------------------------------------------------------


def _zsh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _zsh_text(text: str) -> str:
    """A description inside _arguments' [...]: brackets and backslashes escaped."""
    return re.sub(r"([\[\]\\])", r"\\\1", text)


def _zsh_name(text: str) -> str:
    """A name before a colon (a _describe item, an _arguments message): colons and backslashes escaped."""
    return re.sub(r"([:\\])", r"\\\1", text)


def _zsh_spec(option: Option) -> list[str]:
    if option.takes_value:
        action = (f"({' '.join(option.choices)})" if option.choices else "_files" if option.is_path else " ")
        value = f":{_zsh_name(option.flags[-1].lstrip('-').upper())}:{action}"
    else:
        value = ""
    exclusive = f"({' '.join(option.flags)})" if len(option.flags) > 1 and not option.repeatable else ""
    star = "*" if option.repeatable else ""
    out = []
    for flag in option.flags:
        equals = "=" if option.takes_value and flag.startswith("--") else ""
        out.append(_zsh_quote(f"{exclusive}{star}{flag}{equals}[{_zsh_text(option.help)}]{value}"))
    return out


def _zsh_function(name: str, command: Command, path: list[str]) -> list[str]:
    specs = [spec for option in command.options for spec in _zsh_spec(option)]
    lines = [f"{name}() {{"]
    if command.children:
        items = " ".join(_zsh_quote(f"{_zsh_name(child)}:{sub.help}")
                         for child, sub in command.children.items())
        title = _zsh_quote(" ".join(["podmeter", *path, "command"]))
        lines += [
            "    local curcontext=$curcontext state line",
            "    local -a commands",
            f"    commands=({items})",
            f"    _arguments -C {' '.join(specs)} ': :->command' '*:: :->argument' && return",
            "    case $state in",
            f"        command) _describe -t commands {title} commands ;;",
            "        argument)",
            "            case $words[1] in",
        ]
        for child in command.children:
            lines.append(f"                {_zsh_quote(child)}) {name}_{re.sub(r'[^a-z0-9]', '_', child)} ;;")
        lines += ["            esac ;;", "    esac", "}"]
    else:
        positionals = [_zsh_quote(f"{n + 1}:argument:({' '.join(choices)})" if choices else f"{n + 1}:argument: ")
                       for n, choices in enumerate(command.positionals)]
        lines += [f"    _arguments -s {' '.join([*specs, *positionals])}", "}"]
    for child, sub in command.children.items():
        lines += ["", *_zsh_function(f"{name}_{re.sub(r'[^a-z0-9]', '_', child)}", sub, [*path, child])]
    return lines


def zsh(tree: Command) -> str:
    body = "\n".join(_zsh_function("_podmeter", tree, []))
    return f"""#compdef podmeter
# zsh completion for podmeter, made by `podmeter completion zsh` (podmeter's own parsers).
# Load it with: source <(podmeter completion zsh), or save it as _podmeter in a directory of $fpath.
{body}

if [[ $zsh_eval_context[-1] == loadautofunc ]]; then
    _podmeter "$@"
else
    compdef _podmeter podmeter
fi
"""
