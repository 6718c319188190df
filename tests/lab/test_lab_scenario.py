"""Scenario files: every shipped one is valid; bad input is refused with the field and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from podmeter.lab.scenario import (
    Churn,
    KillAgent,
    ScenarioError,
    load_scenario,
    parse_scenario,
    shipped_scenarios,
)

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

GOOD = """
name: t
duration: 10
namespaces: [{name: web}]
steps:
  - {at: 0, do: pods, namespace: web, count: 2}
  - {at: 1, do: churn, namespace: web, rate: 2, duration: 3, unique_labels: true}
  - {at: 2, do: kill-agent, down: 1}
"""


def test_a_good_scenario_decodes_into_typed_steps() -> None:
    scenario = parse_scenario(GOOD)
    assert scenario.seed == 1 and scenario.node.pod_cidr == "10.244.0.0/25"
    assert isinstance(scenario.steps[1], Churn) and scenario.steps[1].unique_labels
    assert isinstance(scenario.steps[2], KillAgent) and scenario.steps[2].deletes == 0


@pytest.mark.parametrize("name", shipped_scenarios())
def test_every_shipped_scenario_is_valid(name: str) -> None:
    assert load_scenario(name).name


def test_the_shipped_scenarios_the_issue_asks_for_exist() -> None:
    assert {"default", "cronjob-churn", "interest-flips", "watch-restarts", "overflow", "soak"} <= set(
        shipped_scenarios())


@pytest.mark.parametrize(("text", "message"), [
    ("name: t\nduration: 5\nsteps: [{at: 0, do: explode}]",
     "$.steps[0].do: Invalid value 'explode'; a step's `do` is one of: annotate, apps, churn"),
    ("name: t\nduration: 5\nnamespaces: [{name: a}]\nsteps: [{at: 0, do: pods, namespace: a, count: two}]",
     "$.steps[0].count: Expected `int`, got `str`"),
    ("name: t\nduration: 5\nnamespaces: [{name: a}]\nsteps: [{at: 0, do: pods, namespace: a, count: 0}]",
     "$.steps[0].count: Expected `int` >= 1"),
    ("name: t\nduration: 5\nnamespaces: [{name: a}]\nsteps: [{at: 0, do: pods, namespace: a, cuont: 2}]",
     "$.steps[0]: Object contains unknown field `cuont`"),
    ("name: t\nduration: 5\nsteps: [{at: 0, do: pods, namespace: nope, count: 1}]",
     "$.steps[0].namespace: 'nope' is not declared under namespaces (declared: none)"),
    ("name: t\nduration: 5\nsteps: [{at: 9, do: kill-agent}]", "$.steps[0].at: 9.0 is after the duration (5.0)"),
    ("name: t\nduration: 5\nsteps: [{at: 1, do: configure, include: [a], exclude: [b]}]",
     "$.steps[0]: include and exclude cannot both be non-empty"),
    ("name: t\nduration: 5\nnode: {pod_cidr: 10.0.0.0/33}", "$.node.pod_cidr:"),
    ("name: t\nduration: 5\nnode: {pod_cidr: 'fd00::/64'}", "must be an IPv4 network"),
    ("name: t\nduration: 5\nnamespaces: [{name: Web_1}]", "$.namespaces[0].name: 'Web_1' is not a DNS-1123 label"),
    ("name: t\nduration: -1", "$.duration: Expected `float` > 0.0"),
    ("name: t", "Object missing required field `duration`"),
    ("name: t\nduration: 5\nagent: {fault: melt}", "$.agent.fault: Invalid enum value 'melt'"),
    ("name: [t\nduration", "not valid YAML"),
    ("name: t\nduration: 5\nsteps: [{at: 1, do: kill-agent, deletes: 2}]", "$.steps[0].namespace: needed when"),
])
def test_bad_input_is_refused_with_the_field_and_the_reason(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, "bad.yaml")
    assert str(caught.value).startswith("bad.yaml: ")
    assert message in str(caught.value)


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    text = ("name: t\nduration: 5\nnamespaces: [{name: a}]\n"
            "steps: [{at: 7, do: delete, namespace: a}, {at: 1, do: delete, namespace: b}]")
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text)
    assert "$.steps[0].at" in str(caught.value) and "$.steps[1].namespace" in str(caught.value)


def test_unknown_names_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"no shipped scenario of that name .shipped: .*default"):
        load_scenario("no-such-scenario")
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(str(tmp_path / "missing.yaml"))


def test_a_file_path_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(GOOD)
    assert load_scenario(str(path)).name == "t"


@pytest.mark.process
def test_podmeter_lab_refuses_a_bad_file_before_starting_anything(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nduration: 5\nsteps: [{at: 0, do: pods, namespace: web, count: 1}]\n")
    result = subprocess.run([sys.executable, "-m", "podmeter", "lab", str(bad), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "bad.yaml: $.steps[0].namespace: 'web' is not declared under namespaces" in result.stderr
    assert not (tmp_path / "out").exists()
