"""The settings dataclasses (``runtime.settings``) are the only source of the two processes' defaults: each
command parses its arguments into one settings value, and parsing none gives exactly the dataclasses'
defaults, option by option (so a default written in a parser as well could not differ from the settings')."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import pytest

from podmeter.cli import agent as agent_cli
from podmeter.cli import operator as operator_cli
from podmeter.cli.main import build_parser
from podmeter.runtime.settings import AgentProcessSettings, AgentSettings, OperatorProcessSettings

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variables PODMETER_<OPTION> are defaults too: none in these tests."""
    for name in list(os.environ):
        if name.startswith("PODMETER_"):
            monkeypatch.delenv(name)


def fields(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a settings value by its path (``datapath.bpffs``), nested settings flattened."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        leaf = getattr(value, field.name)
        if dataclasses.is_dataclass(leaf):
            out |= fields(leaf, f"{prefix}{field.name}.")
        else:
            out[prefix + field.name] = leaf
    return out


def parser(command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)]
    parsed: argparse.ArgumentParser = sub.choices[command]
    return parsed


def test_every_agent_default_is_the_settings_default() -> None:
    parsed = agent_cli.settings_from(build_parser("agent").parse_args(["agent", "--node-name", "n"]))
    expected = AgentProcessSettings(agent=AgentSettings(node_name="n"))
    assert fields(parsed) == fields(expected)
    assert parsed == expected


def test_every_operator_default_is_the_settings_default() -> None:
    parsed = operator_cli.settings_from(build_parser("operator").parse_args(["operator"]))
    assert fields(parsed) == fields(OperatorProcessSettings())
    assert parsed == OperatorProcessSettings()


@pytest.mark.parametrize("command", ["agent", "operator"])
def test_every_option_reaches_the_settings(command: str) -> None:
    """Each option changed on the command line changes the settings: none is parsed and then dropped."""
    required = ["--node-name", "n"] if command == "agent" else []
    settings_from = agent_cli.settings_from if command == "agent" else operator_cli.settings_from
    base = fields(settings_from(build_parser(command).parse_args([command, *required])))
    for action in parser(command)._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or action.dest in ("help", "node_name"):
            continue
        changed = fields(settings_from(build_parser(command).parse_args([command, *required, *_other(action)])))
        assert changed != base, f"{command} {flag} does not reach the settings"


def _other(action: argparse.Action) -> list[str]:
    """Command-line words that give ``action`` a value other than its default."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if not action.default else f"--no-{flag[2:]}"]
    if action.nargs == 0:  # store_true
        return [flag]
    if action.choices is not None:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if isinstance(action.default, bool | int | float) and not isinstance(action.default, str):
        return [flag, str(action.default + 1)]
    if action.dest == "retina_compat":
        return [flag, "remote"]
    if action.dest in ("flow_export_allow", "flow_export_deny"):  # observe's filters
        return [flag, "namespace=other-value"]
    return [flag, "other-value"]


def test_the_flow_export_filters_are_observes_and_bad_ones_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from podmeter.model.flow_records import FlowFilter

    args = ["agent", "--node-name", "n", "--flow-export-file", "/var/run/podmeter/flows.log",
            "--flow-export-allow", "namespace=shop verdict=dropped",
            "--flow-export-allow", "--to-pod shop/db --port 5432",
            "--flow-export-deny=protocol=icmp", "--flow-export-field-mask", "time, source.namespace,verdict"]
    export = agent_cli.settings_from(build_parser("agent").parse_args(args)).flow_export
    assert export.allow == (FlowFilter(namespace="shop", verdict="dropped"), FlowFilter(to_pod="shop/db", port=5432))
    assert export.deny == (FlowFilter(protocol="icmp"),)
    assert export.field_mask == ("time", "source.namespace", "verdict")
    for bad, said in (("verdict=lost", "invalid choice: 'lost'"), ("port=99999", "port number"),
                      ("shop", "unrecognized arguments: shop"), ("", "at least one filter"),
                      ("last=5", "unrecognized arguments: --last=5"), ("'namespace=shop", "No closing quotation")):
        with pytest.raises(SystemExit) as exit_:
            build_parser("agent").parse_args(["agent", "--node-name", "n", "--flow-export-allow", bad])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
