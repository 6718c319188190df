"""The lab's drops and loss steps: the scenario format, the checks on wrong counts (no root), and a run that
induces every kind in chosen pods and expects them exactly, its report.html naming each induced reason and
the retransmits where loss was induced (root: namespaces, veths, bpffs, nft)."""

from __future__ import annotations

import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from podmeter.cli.lab import failed_checks
from podmeter.lab.dropcheck import check_drop_records, check_drops, check_loss
from podmeter.lab.report import write_report
from podmeter.lab.run import LabOptions, LabRun
from podmeter.lab.scenario import InduceDrops, InduceLoss, ScenarioError, load_scenario, parse_scenario

MINI = """
name: drops-mini
seed: 3
datapath: ebpf
duration: 14
settle: 3
node: {pod_cidr: 10.244.6.0/27, filter_map_size: 64}
agent: {resync_interval: 5}
operator: {enabled: false}
namespaces: [{name: net}, {name: quiet}]
steps:
  - {at: 0, do: pods, namespace: net, count: 3, prefix: edge, deployment: true}
  - {at: 0, do: pods, namespace: quiet, count: 2}
  - {at: 2, do: drops, namespace: net, how: netfilter-input, packets: 25}
  - {at: 4, do: drops, namespace: net, how: netfilter-output, packets: 10}
  - {at: 6, do: drops, namespace: net, how: blackhole, packets: 15}
  - {at: 8, do: loss, namespace: net, every: 5, bytes: 2000000}
"""


def test_the_steps_decode_with_their_defaults_and_refuse_bad_values() -> None:
    scenario = parse_scenario(MINI)
    drops = [s for s in scenario.steps if isinstance(s, InduceDrops)]
    assert [(s.how, s.packets, s.port, s.reason) for s in drops] == [
        ("netfilter-input", 25, 5299, None), ("netfilter-output", 10, 5299, None), ("blackhole", 15, 5299, None)]
    [loss] = [s for s in scenario.steps if isinstance(s, InduceLoss)]
    assert (loss.every, loss.bytes, loss.port) == (5, 2_000_000, 5298)
    with pytest.raises(ScenarioError, match=r"\$.steps\[2\].how"):
        parse_scenario(MINI.replace("how: netfilter-input", "how: explode"))
    with pytest.raises(ScenarioError, match=r"\$.steps\[5\].every"):
        parse_scenario(MINI.replace("every: 5", "every: 1"))
    with pytest.raises(ScenarioError, match="reason"):
        parse_scenario(MINI.replace("packets: 15}", "packets: 15, reason: not-a-name}"))


def test_the_default_scenario_induces_one_of_each() -> None:
    steps = load_scenario("default").steps
    assert {s.how for s in steps if isinstance(s, InduceDrops)} == {"netfilter-input", "netfilter-output",
                                                                     "blackhole"}
    assert any(isinstance(s, InduceLoss) for s in steps)


def test_drop_counts_must_be_exact_for_the_induced_and_zero_for_the_rest_of_the_two_pods() -> None:
    expected = {("net/a", "egress", "NETFILTER_DROP"): 5, ("net/b", "ingress", "NETFILTER_DROP"): 5}
    before = {("net/a", "egress", "NETFILTER_DROP"): 2.0, ("web/x", "ingress", "NO_SOCKET"): 1.0}
    exact = {("net/a", "egress", "NETFILTER_DROP"): 7.0, ("net/b", "ingress", "NETFILTER_DROP"): 5.0,
             ("web/x", "ingress", "NO_SOCKET"): 9.0}  # another pod's drops are not the step's business
    assert check_drops(expected, before, exact, ("net/a", "net/b")) == []
    short = {**exact, ("net/b", "ingress", "NETFILTER_DROP"): 4.0}
    assert check_drops(expected, before, short, ("net/a", "net/b")) == [
        "net/b ingress drops NETFILTER_DROP: expected 5 more, the agent counted 4"]
    wrong_reason = {**exact, ("net/a", "egress", "NOT_SPECIFIED"): 1.0}
    assert check_drops(expected, before, wrong_reason, ("net/a", "net/b")) == [
        "net/a egress drops NOT_SPECIFIED grew by 1, nothing of that was induced"]


def record(src: str, dst: str | None, packets: int, reason: str) -> dict[str, object]:
    def end(pod: str | None) -> dict[str, object]:
        if pod is None:
            return {"ip": "198.51.100.66", "world": True, "namespace": None, "pod": None}
        namespace, name = pod.split("/")
        return {"ip": "10.0.0.1", "world": False, "namespace": namespace, "pod": name}

    return {"source": end(src), "destination": end(dst), "packets": packets, "drop_reason": reason,
            "verdict": "dropped"}


def test_dropped_flow_records_must_carry_the_packets_the_reason_and_the_pods() -> None:
    good = [record("net/a", "net/b", 3, "NETFILTER_DROP"), record("net/a", "net/b", 2, "NETFILTER_DROP")]
    assert check_drop_records(good, 5, "NETFILTER_DROP", "net/a", "net/b") == []
    assert check_drop_records(good[:1], 5, "NETFILTER_DROP", "net/a", "net/b") == [
        "dropped-flow records of the step carry 3 packets, expected 5"]
    assert check_drop_records([record("net/a", None, 5, "NOT_SPECIFIED")], 5, "NOT_SPECIFIED", "net/a", None) == []
    misnamed = check_drop_records([record("net/c", "net/b", 5, "NETFILTER_DROP")], 5, "NETFILTER_DROP", "net/a",
                                  "net/b")
    assert misnamed == ["a dropped-flow record net/c -> net/b says NETFILTER_DROP, expected net/a -> net/b "
                        "NETFILTER_DROP"]


def test_retransmits_must_grow_where_loss_was_induced_and_nowhere_else() -> None:
    assert check_loss("net/a", {"net/a": 1, "net/b": 0}, {"net/a": 9, "net/b": 0, "net/c": 0}) == []
    assert check_loss("net/a", {"net/a": 1}, {"net/a": 1}) == [
        "net/a lost packets on its link but the agent counted no retransmit"]
    assert check_loss("net/a", {}, {"net/a": 4, "net/b": 2}) == [
        "net/b retransmitted 2 segments but no loss was induced there"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nft")
def test_a_run_that_induces_each_kind_counts_each_exactly_with_its_reason(tmp_path: Path) -> None:
    lab = LabRun(parse_scenario(MINI), LabOptions(tmp_path, progress=False))
    result = lab.run()
    assert result.error is None and result.failures == [], (result.error, result.failures)
    checks = {t["kind"]: t for t in result.traffic}
    assert set(checks) == {"drops netfilter-input", "drops netfilter-output", "drops blackhole", "loss"}
    assert all(t["ok"] for t in checks.values()), [t["flow"] for t in checks.values()]
    into = checks["drops netfilter-input"]
    assert into["drops"] == {f"{into['src']} egress NETFILTER_DROP": 25, f"{into['dst']} ingress NETFILTER_DROP": 25}
    blackhole = checks["drops blackhole"]
    assert blackhole["drops"] == {f"{blackhole['src']} egress NOT_SPECIFIED": 15}
    loss = checks["loss"]
    assert loss["retransmits"][loss["src"]] > 0 and set(loss["retransmits"]) == {loss["src"]}
    assert loss["on_records"] > 0
    assert result.passed, failed_checks(result)
    write_report(result, tmp_path)
    rows = report_rows((tmp_path / "report.html").read_text())
    for how, reason, packets in (("netfilter-input", "NETFILTER_DROP", 25), ("netfilter-output", "NETFILTER_DROP", 10),
                                 ("blackhole", "NOT_SPECIFIED", 15)):
        check = checks[f"drops {how}"]
        row = rows[f"udp drops {how}"]
        assert row[1:3] == [check["src"], check["dst"]] and row[3] == f"{packets} {reason}", row
        assert row[5] == f"{packets} x {reason}" and row[7] == "exact", row
    assert rows["udp drops netfilter-input"][4] == "25 NETFILTER_DROP"  # the destination's ingress drops too
    row = rows["tcp loss"]
    assert row[1:3] == [loss["src"], loss["dst"]], row
    assert row[3].startswith(f"{loss['retransmits'][loss['src']]:.0f} retransmits, ") and row[4] == "0 retransmits"
    assert row[7] == "exact", row


class _Cells(HTMLParser):
    """The text of every table cell, row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def report_rows(page: str) -> dict[str, list[str]]:
    """The report's table rows by their first cell (the traffic checks: by check name)."""
    cells = _Cells()
    cells.feed(page)
    return {row[0]: row for row in cells.rows if row}
