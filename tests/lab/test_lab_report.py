"""The lab report reads at a glance: a result built like the run builds one, rendered (no root).

The invariant table lists I1-I8 held, failed or not checked with the worst transient; the run's metadata is
there; faults and agent kills are marked on the time plots; every number is written for people (no Python
repr in any cell); the logs are linked relatively; the page needs nothing outside itself.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from podmeter.lab import runinfo
from podmeter.lab import scenario as sc
from podmeter.lab.checks import Checker, Observation, Truth, parse_metrics
from podmeter.lab.report import _duration, _human, invariant_rows, time_figure, write_report
from podmeter.lab.run import LabOptions, LabResult, LabRun, Sample
from podmeter.lab.runinfo import Mark, RunInfo
from podmeter.lab.scenario import parse_scenario
from podmeter.model.records import decode_pod

IDS = [f"I{i}" for i in range(1, 9)]


def _samples() -> list[Sample]:
    samples = []
    for i in range(80):
        t = round(0.5 * (i + 1), 2)
        down = 24 <= i < 29  # the agent is down after its SIGKILL: no metrics, no kernel read
        samples.append(Sample(t=t, pods=9 + i % 5, desired=6 + i % 3, kernel=None if down else 6 + i % 3,
                              agent_rss=None if down else 75.84765625 + i / 7, operator_rss=67.32421875 + i / 9,
                              identities=3.0 + i % 2, events=None if down else 18.0 + 3 * i,
                              relists=None if down else 4.0 + i // 20, repairs=None if i < 30 else 2.0,
                              open_violations=i % 4, filter_drift=i % 3))
    return samples


def _udp(src: str, dst: str, *, ok: bool = True) -> dict[str, Any]:
    """A traffic check as run.py records it: tuples for (packets, bytes), floats for the series."""
    return {"protocol": "udp", "src": src, "dst": dst, "src_ip": "10.244.0.5", "dst_ip": "10.244.0.1",
            "ports": [46496, 5201], "delivered": 40, "src_egress": (40, 13680), "dst_ingress": (40, 13680),
            "expected": (40, 13680), "metrics": {"src_egress_bytes": 13680.0, "dst_ingress_bytes": 13680.0},
            "flow": {"ok": ok, "problems": [] if ok else ["forward TCP flags ['ACK'] lack SYN"], "records": 4,
                     "expected": {"forward": {src: {"from-pod": [40, 13680]}}}, "found": {"forward": {}}},
            "ok": ok}


def _result(tmp_path: Path) -> LabResult:
    result = LabResult("short", "ebpf", 7, passed=False)
    result.failures = [{"invariant": "I2", "subject": "10.244.0.9",
                        "detail": "leaked: 10.244.0.9 is in the kernel filter but no pod holds it (last held by "
                                  "web/app-3)", "lasted_s": 0.1 + 0.2 + 4}]
    reuse = {"protocol": "udp", "kind": "reuse-during-flow", "src": "web/reuse-50 then web/reuse-51",
             "dst": "web/frontend-1", "expected": (20, 6840), "src_egress": [(20, 6840), (20, 6840)],
             "dst_ingress": (40, 13680), "reused": True, "held_by": None, "delivered": 40,
             "flow": {"ok": True, "problems": [], "records": 4}, "ok": True}
    tcp = {**_udp("web/frontend-3", "web/api-4"), "protocol": "tcp", "src_egress": (97, 106410),
           "dst_ingress": (97, 106410)}
    del tcp["expected"]
    result.traffic = [_udp("web/api-5", "web/frontend-1"), tcp, reuse,
                      {"protocol": "udp", "skipped": "memory mode has no packets"}]
    result.flows = [{"protocol": "UDP", "source": {"ip": "10.244.0.5", "port": 46496, "pod": "web/api-5",
                                                   "workload": "Deployment web/api"},
                     "destination": {"ip": "10.244.0.1", "port": 5201, "pod": "web/frontend-1",
                                     "workload": "Deployment web/frontend"},
                     "from-pod": [40, 13680], "to-pod": [40, 13680], "tcp_flags": []}]
    result.memory = {"tolerance_mib": 16.0,
                     "agent": {"baseline_mib": 77.0, "end_mib": 77.30000000000001, "growth_mib": 0.30000000000000004,
                               "returned": True},
                     "operator": {"baseline_mib": 67.3, "end_mib": 67.7, "growth_mib": 0.4, "returned": True}}
    result.samples = _samples()
    result.counts = {"pods_created": 1234, "pods_deleted": 1234, "lifecycles": 1234,
                     "deleted_in_phase": {"Running": 15, "Succeeded": 36}, "interest_flips": 5, "faults": 2,
                     "agent_kills": 1, "driver_errors": 0, "transient_violations": 44, "overflow_max_waiting": 0,
                     "max_filter_drift": 3,
                     "delete_to_unmapped_ms": {"count": 13, "p50": 4.02, "p99": 43.48, "max": 43.48, "unseen": 1},
                     "restart_converged_after_s": [0.18], "flow_checks": {"checked": 3, "exact": 3,
                                                                          "records_at_end": 15234},
                     "drops_induced": {"netfilter": 12, "last": None, "ratio": 0.1 + 0.2}}  # a count added later
    result.steps_s = 30.0
    result.info = RunInfo(scenario="short", description="every kind of step once", seed=7, datapath="ebpf",
                          podmeter_version="0.1.0", commit="c60021f1a2b3-dirty", kernel="6.1.0-18-amd64",
                          host="labhost", python="3.11.2", started="2025-01-05 14:03:12 +0000",
                          started_unix=1736085792.0, planned_s=30.0, settle_s=4.0, sample_interval_s=0.5,
                          operator=True, log_dir=str(tmp_path / "logs"), duration_s=167.4)
    result.marks = [Mark(10.02, runinfo.FAULT, "close-watches"),
                    Mark(12.0, runinfo.HELD, "checks held", until=14.61),
                    Mark(12.01, runinfo.AGENT_KILL, "agent SIGKILL", until=14.6),
                    Mark(18.3, runinfo.FAULT, "compaction gap"),
                    Mark(30.0, runinfo.TEARDOWN, "teardown")]
    result.transients = {"I1": {"count": 3, "longest_s": 0.52, "subject": "web/app-7",
                                "detail": "missing: the agent's store lacks web/app-7 (uid u-7)", "held_count": 0,
                                "held_longest_s": 0.0, "held_subject": "", "held_detail": ""},
                         "I2": {"count": 40, "longest_s": 0.51, "subject": "10.244.0.3",
                                "detail": "leaked: 10.244.0.3 is in the kernel filter but no pod holds it (last held "
                                          "by jobs/job-28)", "held_count": 2, "held_longest_s": 2.6100000000000003,
                                "held_subject": "10.244.0.7",
                                "held_detail": "missing: 10.244.0.7 of observed web/app-7 is not in the kernel filter"},
                         "I5": {"count": 1, "longest_s": 0.0, "subject": "", "detail": "", "held_count": 1,
                                "held_longest_s": 4.7, "held_subject": "web/frontend-2",
                                "held_detail": "series podmeter_pod_bytes_total of web/frontend-2, a pod that is gone"}}
    result.checked = ["I1", "I2", "I3", "I4", "I5"]
    return result


class Cells(HTMLParser):
    """Every table row's cells as text; every link and image source."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.links: list[str] = []
        self.sources: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append(" ")
        elif tag == "a":
            self.links.append(dict(attrs).get("href") or "")
        elif tag in ("img", "script", "link", "iframe"):
            self.sources.append(dict(attrs).get("src") or dict(attrs).get("href") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _page(tmp_path: Path, result: LabResult | None = None) -> tuple[str, Cells]:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    for name in ("apiserver", "node", "agent", "operator"):
        (logs / f"{name}.log").write_text(f"{name} started\n")
    write_report(result or _result(tmp_path), tmp_path)
    page = (tmp_path / "report.html").read_text()
    cells = Cells()
    cells.feed(page)
    return page, cells


def _invariant_table(cells: Cells) -> dict[str, list[str]]:
    return {row[0].split()[0]: row for row in cells.rows if row and re.fullmatch(r"I\d+ \w+", row[0])}


def test_the_invariant_table_lists_i1_to_i8_held_or_failed_with_the_worst_transient(tmp_path: Path) -> None:
    rows = {r["id"]: r for r in invariant_rows(_result(tmp_path))}
    assert list(rows) == IDS
    assert rows["I2"]["status"] == "failed" and rows["I2"]["failures"] == 1
    assert {i for i, r in rows.items() if r["status"] == "held"} == {"I1", "I3", "I4", "I5", "I6", "I8"}
    assert rows["I7"]["status"] == "not checked"  # the lab does not check it: it says so, and where it is
    _, cells = _page(tmp_path)
    table = _invariant_table(cells)
    assert list(table) == IDS
    for row in table.values():
        what, result = row[1], row[2]
        assert len(what) > 20, row  # what it checks, in one line
        assert result.split()[0] in {"held", "FAILED", "not"}, row
    assert table["I2"][2].startswith("FAILED") and table["I1"][2].startswith("held")
    assert table["I7"][2].startswith("not checked") and "test_endpoint_publication" in table["I7"][2]
    # The worst transient and for how long; the worst during a deliberate outage (a hold) apart.
    assert table["I1"][4:] == ["3", "520 ms: web/app-7 missing: the agent's store lacks web/app-7 (uid u-7)"]
    assert table["I2"][4] == "40" and table["I2"][5] == (
        "510 ms: 10.244.0.3 leaked: 10.244.0.3 is in the kernel filter but no pod holds it (last held by "
        "jobs/job-28) during a hold of the checks (2 transients): 2.6 s: 10.244.0.7 missing: 10.244.0.7 of "
        "observed web/app-7 is not in the kernel filter")
    assert table["I5"][5].startswith("during a hold of the checks (1 transient): 4.7 s: web/frontend-2 series ")
    assert table["I3"][4:] == ["0", "\N{EN DASH}"]
    assert table["I6"][5] == "180 ms from the successor ready to the kernel map converged"


def test_an_invariant_is_held_only_if_the_run_checked_it(tmp_path: Path) -> None:
    result = _result(tmp_path)
    result.checked = ["I1", "I2", "I3", "I5", "I7"]  # the operator's identities never read; I7 checked
    rows = {r["id"]: r for r in invariant_rows(result)}
    assert rows["I4"]["status"] == "not checked" and "operator" in rows["I4"]["note"]
    assert rows["I7"]["status"] == "held"
    result.counts["agent_kills"], result.traffic, result.counts["flow_checks"] = 0, [], {"checked": 0, "exact": 0}
    result.datapath = "memory"
    rows = {r["id"]: r for r in invariant_rows(result)}
    assert rows["I6"]["status"] == rows["I8"]["status"] == "not checked"
    assert rows["I6"]["note"] == "no agent kill in this scenario" and "memory mode" in rows["I8"]["note"]


def test_a_failed_flow_check_or_a_lost_restart_fails_i8_and_i6(tmp_path: Path) -> None:
    result = _result(tmp_path)
    result.traffic[0] = _udp("web/api-5", "web/frontend-1", ok=False)
    result.counts["flow_checks"] = {"checked": 3, "exact": 2, "records_at_end": 10}
    result.counts["restart_converged_after_s"] = []  # the successor never converged
    rows = {r["id"]: r for r in invariant_rows(result)}
    assert rows["I8"]["status"] == rows["I6"]["status"] == "failed"
    assert rows["I5"]["status"] == "held"  # the counters agreed: only the flow records were off
    result.traffic[1] = {**result.traffic[1], "ok": False}  # counters off, flow records exact
    assert {r["id"]: r for r in invariant_rows(result)}["I5"]["status"] == "failed"
    result.traffic[1] = {"protocol": "udp", "kind": "drops", "ok": False}  # a drop check is not I5's
    assert {r["id"]: r for r in invariant_rows(result)}["I5"]["status"] == "held"


def test_no_cell_holds_a_python_repr(tmp_path: Path) -> None:
    page, cells = _page(tmp_path)
    texts = [cell for row in cells.rows for cell in row]
    assert len(texts) > 100
    reprs = [re.compile(p) for p in (r"\{'", r"\['", r"\bNone\b", r"\bTrue\b", r"\bFalse\b",
                                     r"\(\s*-?\d+\s*,\s*-?\d+\s*\)", r"\(\s*[^()]*,\s*\)", r"\d\.\d{5,}")]
    for text in texts:
        for pattern in reprs:
            assert not pattern.search(text), (pattern.pattern, text)
    # Nowhere on the page either (the images aside, whose base64 may spell anything).
    visible = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    for needle in ("{'", "None", "0.30000000000000004", "77.30000000000001", "2.6100000000000003", "(40, 13680)"):
        assert needle not in visible, needle
    # People's numbers: thousands separators, units, durations.
    for text in ("13,680 B", "40 pkts, 13,680 B", "1,234", "106,410 B", "+0.3 MiB", "77.3 MiB", "4.3 s",
                 "p50 4.0 ms, p99 43 ms", "15,234 records", "Running 15, Succeeded 36",
                 "20 pkts, 6,840 B then 20 pkts, 6,840 B", "netfilter 12, last \N{EN DASH}, ratio 0.3"):
        assert text in texts or any(text in t for t in texts), text


def test_the_run_metadata_is_on_the_page(tmp_path: Path) -> None:
    page, cells = _page(tmp_path)
    run = {row[0]: row[1] for row in cells.rows if len(row) == 2}
    assert run["scenario"] == "short" and run["seed"] == "7" and run["datapath"].startswith("eBPF")
    assert run["podmeter"] == "0.1.0, commit c60021f1a2b3-dirty"
    assert run["kernel"] == "6.1.0-18-amd64"
    assert run["started"] == "2025-01-05 14:03:12 +0000"
    assert run["duration"].startswith("2 min 47 s in all") and "steps 30 s" in run["duration"]
    assert run["settle"].startswith("4.0 s")
    assert "every kind of step once" in page
    assert "ebpf, seed 7" in page  # and in the verdict line


@pytest.mark.parametrize(("steps_s", "said"), [(30.0, "steps 30 s, teardown"), (21.0, "the lifecycles were done"),
                                              (32.5, "the step running then finished first")])
def test_the_run_table_says_why_the_steps_took_other_than_planned(tmp_path: Path, steps_s: float, said: str
                                                                  ) -> None:
    result = _result(tmp_path)
    result.steps_s = steps_s
    _, cells = _page(tmp_path, result)
    duration = {row[0]: row[1] for row in cells.rows if len(row) == 2}["duration"]
    assert said in duration


def test_faults_and_agent_kills_are_marked_on_the_time_plots(tmp_path: Path) -> None:
    result = _result(tmp_path)
    fig = time_figure(result.samples, "pods", [("pods", "live pods")], result.marks)
    [ax] = [a for a in fig.axes if a.get_title() == "pods"]
    vertical = {round(float(line.get_xdata()[0]), 2): line for line in ax.lines
                if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2}
    assert set(vertical) == {10.02, 12.01, 14.6, 18.3, 30.0}  # faults, the kill, the successor ready, teardown
    labels = {text.get_text().strip(): round(text.get_position()[0], 2) for text in ax.texts}
    assert labels == {"close-watches": 10.02, "agent SIGKILL": 12.01, "agent ready": 14.6,
                      "compaction gap": 18.3, "teardown": 30.0}
    assert vertical[12.01].get_color() != vertical[10.02].get_color()  # a kill is not drawn like a fault
    [held] = [p for p in ax.patches if p.get_label() == "_checks held"]
    assert held.get_x() == pytest.approx(12.0) and held.get_width() == pytest.approx(2.61)
    # Every time plot of the report, and the page's timeline, show them.
    page, cells = _page(tmp_path, result)
    timeline = {row[1]: row for row in cells.rows if len(row) == 3 and row[0] != "file"}
    assert timeline["fault: close-watches"][0] == "10 s"
    assert timeline["agent SIGKILL"] == ["12 s", "agent SIGKILL", "successor ready after 2.6 s"]
    assert timeline["the checks held (violations do not age)"][2] == "2.6 s"
    for name in ("filter", "memory", "identities", "events", "violations"):
        assert f"alt='{name}'" in page and (tmp_path / f"{name}.png").stat().st_size > 5000


def test_the_logs_are_linked_relatively_and_the_page_needs_nothing_outside_itself(tmp_path: Path) -> None:
    page, cells = _page(tmp_path)
    assert {"logs/agent.log", "logs/apiserver.log", "logs/node.log", "logs/operator.log", "report.json"} <= set(
        cells.links)
    assert all(not re.match(r"[a-z]+:|/", link) for link in cells.links), cells.links  # relative, all of them
    assert all((tmp_path / link).exists() for link in cells.links)
    assert cells.sources and all(src.startswith("data:image/png;base64,") for src in cells.sources)
    assert str(tmp_path) not in page
    assert "http://" not in page and "https://" not in page


def test_a_run_that_ended_before_its_first_sample_still_renders(tmp_path: Path) -> None:
    result = LabResult("broken", "memory", 3, error="LabProcessError: apiserver exited (status 1)")
    page, cells = _page(tmp_path, result)
    table = _invariant_table(cells)
    assert list(table) == IDS and all(row[2].startswith("not checked") for row in table.values())
    assert "FAILED" in page and "apiserver exited" in page


@pytest.mark.parametrize(("seconds", "text"), [(0, "0 s"), (0.0042, "4.2 ms"), (0.18, "180 ms"), (4.3, "4.3 s"),
                                                (47.2, "47 s"), (167.4, "2 min 47 s"), (120, "2 min"),
                                                (3720, "1 h 2 min"), (None, "\N{EN DASH}")])
def test_durations_read_like_people_say_them(seconds: float | None, text: str) -> None:
    assert _duration(seconds) == text


def test_values_read_like_people_write_them() -> None:
    assert _human(0.1 + 0.2) == "0.3" and _human(1234567) == "1,234,567" and _human(75.84765625) == "75.8"
    assert _human(None) == "\N{EN DASH}" and _human(True) == "yes" and _human((1, 2)) == "1, 2"
    assert _human({"p50": 4.02, "max_ms": 43.48}) == "p50 4.02, max ms 43.5"


# --- what the run records for the report -------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _truth(*ips: str) -> Truth:
    pods = {f"u-{i}": decode_pod({"metadata": {"uid": f"u-{i}", "name": f"app-{i}", "namespace": "web"},
                                  "spec": {"nodeName": "n"}, "status": {"phase": "Running", "podIP": ip}})
            for i, ip in enumerate(ips)}
    return Truth(pods, {p.ips[0]: frozenset({p.uid}) for p in pods.values()}, set(),
                 {(p.namespace, p.name) for p in pods.values()})


def test_the_checker_keeps_the_longest_transient_of_each_invariant() -> None:
    clock = Clock()
    checker = Checker(settle=5.0, clock=clock)
    truth = _truth("10.0.0.1", "10.0.0.2")

    def sample(kernel: set[str]) -> None:
        checker.observe(Observation(clock.now, truth, kernel, 16, parse_metrics(""), None, agent_up=False))

    sample({"10.0.0.2"})  # 10.0.0.1 missing
    clock.now = 0.5
    sample({"10.0.0.1", "10.0.0.2"})  # cleared after 0.5 s
    checker.hold()
    sample({"10.0.0.1"})  # 10.0.0.2 missing, during a hold
    clock.now = 2.0
    checker.release()  # its settle clock restarts here, but it has been open since 0.5
    sample({"10.0.0.1"})
    clock.now = 3.0
    sample({"10.0.0.1", "10.0.0.2"})
    assert checker.failures == []
    i2 = checker.summary()["transients"]["I2"]
    assert (i2["count"], i2["held_count"]) == (2, 1)
    assert (i2["longest_s"], i2["subject"]) == (0.5, "10.0.0.1")  # outside holds
    assert (i2["held_longest_s"], i2["held_subject"]) == (2.5, "10.0.0.2")  # all of it, the hold included
    assert i2["held_detail"].startswith("missing: 10.0.0.2 of observed web/app-1")
    assert checker.summary()["checked"] == ["I2", "I3"]  # the agent was never up, no operator


def test_the_run_marks_fault_steps_and_holds_and_records_its_metadata(tmp_path: Path) -> None:
    scenario = parse_scenario("name: m\nseed: 4\ndatapath: memory\nduration: 5\nnamespaces: [{name: web}]\nsteps: []\n")
    lab = LabRun(scenario, LabOptions(tmp_path, datapath="memory", progress=False))
    lab.step_started(sc.Fault(at=1, fault="stall", seconds=2))
    lab.step_started(sc.CreatePods(at=0, namespace="web", count=2))  # ordinary life: not marked
    lab.step_started(sc.Fault(at=2, fault="fail", count=3, code=429, verb="list", repeat=2, every=1))
    lab.hold()
    lab.hold()
    lab.release()
    lab.release()
    kinds = [(m.kind, m.label) for m in lab.result.marks]
    assert kinds == [("fault", "stall 2 s"), ("fault", "fail 429 (3 list requests), 2 times every 1 s"),
                     ("held", "checks held")]
    assert lab.result.marks[-1].until is not None
    assert runinfo.is_marked(sc.CompactionGap(at=1, namespace="web"))
    assert not runinfo.is_marked(sc.KillAgent(at=1))  # the run marks the SIGKILL itself, and the successor
    info = runinfo.collect(scenario, "memory", tmp_path, 5.0)
    assert info.podmeter_version and info.kernel and info.started[:2] == "20" and info.log_dir.endswith("logs")
