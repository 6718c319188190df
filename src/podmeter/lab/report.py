"""The lab report: ``report.json``, PNG plots and ``report.html`` (self-contained: plots inlined).

Plots: live pods vs desired vs kernel filter entries over time; agent and operator RSS over time;
identities; pod watch events per second, relists and repairs; open violations and filter drift; each with
the run's faults, agent kills (and when the successor was ready) and the end of the steps as labelled
vertical lines, and the spans the checks were held shaded; the workload-to-workload traffic matrix of the
flows the lab checked (``flows.png``).

The HTML page reads at a glance: the verdict and what decided it; the run (podmeter's version and commit,
the kernel, the date, the duration, the seed, the scenario, the datapath mode); one row per invariant
I1-I8 (what it checks, held, FAILED or not checked, its failures, and its worst transient: the longest
violation that cleared within the settle time, and for how long); every failure with its IPs and pods; the
timeline of faults; the traffic checks with their flow checks (what was expected and found when one
failed); the top flows by bytes; memory against the baselines; the counts; relative links to the run's
logs. Every number is written for people (thousands separators, units, durations like ``2 min 47 s``):
no cell shows a Python repr.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import itertools

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from podmeter.lab import runinfo
from podmeter.lab.flowcheck import FROM_POD, TO_POD, WORLD, counted_bytes
from podmeter.lab.run import LabResult, Sample
from podmeter.lab.runinfo import Mark

TOP_FLOWS = 15
NOTHING = "\N{EN DASH}"  # a cell with no value


def write_report(result: LabResult, out: Path) -> list[Path]:
    """Write every report file into ``out``; returns their paths (JSON first, HTML last)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(_as_json(result), indent=2))
    marks = result.marks
    plots = [_plot(out / "filter.png", result.samples, "pods and filter entries",
                   [("pods", "live pods on the node"), ("desired", "desired IPs"), ("kernel", "kernel entries")],
                   marks),
             _plot(out / "memory.png", result.samples, "RSS (MiB)",
                   [("agent_rss", "agent"), ("operator_rss", "operator")], marks),
             _plot(out / "identities.png", result.samples, "identities", [("identities", "operator identities")],
                   marks),
             _plot(out / "events.png", _rates(result.samples), "agent: events/s, relists, repairs",
                   [("events", "pod events/s"), ("relists", "relists"), ("repairs", "repairs")], marks),
             _plot(out / "violations.png", result.samples, "open violations and filter drift",
                   [("open_violations", "open violations"), ("filter_drift", "IPs leaked or missing (I2, I3)")], marks),
             _matrix_plot(out / "flows.png", result.flows)]
    html_path = out / "report.html"
    html_path.write_text(_html(result, plots, out))
    files = [json_path, *plots, html_path]
    result.report_files = [str(p) for p in files]
    return files


def _as_json(result: LabResult) -> dict[str, Any]:
    data = dataclasses.asdict(result)
    data["samples"] = [dataclasses.asdict(s) for s in result.samples]
    return data


def _rates(samples: list[Sample]) -> list[Sample]:
    """Events as a rate between samples (the counter restarts with the agent: negative steps are 0)."""
    rated: list[Sample] = []
    for prev, cur in itertools.pairwise(samples):
        rate = None
        if prev.events is not None and cur.events is not None and cur.t > prev.t:
            rate = max(0.0, cur.events - prev.events) / (cur.t - prev.t)
        rated.append(dataclasses.replace(cur, events=rate))
    return rated


def _plot(path: Path, samples: list[Sample], title: str, series: list[tuple[str, str]],
          marks: Sequence[Mark] = ()) -> Path:
    fig = time_figure(samples, title, series, marks)
    fig.savefig(path)
    plt.close(fig)
    return path


# kind -> (colour, line style) of its vertical line; an agent kill's successor ready: READY
MARK_STYLES = {runinfo.FAULT: ("#c8640a", "-"), runinfo.AGENT_KILL: ("#a4161a", "-"),
               runinfo.TEARDOWN: ("#555555", "--")}
READY = ("#176f2c", ":")


def time_figure(samples: list[Sample], title: str, series: list[tuple[str, str]],
                marks: Sequence[Mark] = ()) -> Figure:
    """One time plot: the series (seconds since the steps started) with the run's marks on it."""
    fig, ax = plt.subplots(figsize=(10, 3.3), dpi=90)
    plotted: list[float] = []
    for attr, label in series:
        # A missing value (a process down, a map not readable) is a gap in the line, not a bridge.
        values = [getattr(s, attr) for s in samples]
        if any(v is not None for v in values):
            ax.plot([s.t for s in samples], [math.nan if v is None else v for v in values], label=label,
                    linewidth=1.2)
            plotted += [float(v) for v in values if v is not None]
    if not ax.lines:
        ax.text(0.5, 0.5, "no samples of these in this run", ha="center", va="center", transform=ax.transAxes,
                color="#777777")
    elif all(v.is_integer() for v in plotted):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no tick at 12.5 pods
    if marks and ax.lines:
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.2 * (high - low))  # room for the marks' labels above most of the data
    draw_marks(ax, marks)
    ax.set_title(title)
    ax.set_xlabel("seconds since the steps started")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def draw_marks(ax: Any, marks: Sequence[Mark]) -> None:
    """Faults, agent kills and the end of the steps as labelled vertical lines (the label reads upwards,
    left of its line); the spans the checks were held shaded."""
    for mark in marks:
        if mark.kind == runinfo.HELD:
            if mark.until is not None:
                ax.axvspan(mark.t, max(mark.until, mark.t + 0.05), color="#888888", alpha=0.15, linewidth=0,
                           label="_checks held")
            continue
        color, style = MARK_STYLES.get(mark.kind, MARK_STYLES[runinfo.FAULT])
        _mark_line(ax, mark.t, mark.label, color, style)
        if mark.kind == runinfo.AGENT_KILL and mark.until is not None:
            _mark_line(ax, mark.until, "agent ready", *READY)


def _mark_line(ax: Any, t: float, label: str, color: str, style: str) -> None:
    ax.axvline(t, color=color, linestyle=style, linewidth=1.0, alpha=0.9, label=f"_{label}")
    ax.text(t, 0.97, label, transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="top",
            fontsize=7, color=color, bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1.0})


def _html(result: LabResult, plots: list[Path], out: Path) -> str:
    verdict = "PASSED" if result.passed else "FAILED"
    color = "#176f2c" if result.passed else "#a4161a"
    invariants = invariant_rows(result)
    parts = [f"<h1>podmeter lab: {html.escape(result.scenario)}</h1>"]
    if result.info is not None and result.info.description:
        parts.append(f"<p>{html.escape(result.info.description)}</p>")
    parts.append(f"<p style='font-size:1.4em;color:{color}'><b>{verdict}</b> &middot; "
                 f"{html.escape(_at_a_glance(result, invariants))}</p>")
    parts += [f"<p><i>{html.escape(n)}</i></p>" for n in result.notes]
    if result.error:
        parts.append(f"<p style='color:{color}'>error: {html.escape(result.error)}</p>")
    parts.append("<h2>Run</h2>")
    parts.append(_table(["", ""], _run_rows(result, out), header=False))
    parts.append("<h2>Invariants</h2>")
    parts.append(_invariants_table(invariants))
    parts.append("<h2>Invariant failures</h2>")
    parts.append(_table(["invariant", "subject", "detail", "lasted"],
                        [[f["invariant"], f["subject"], f["detail"], _duration(f["lasted_s"])]
                         for f in result.failures])
                 if result.failures else "<p>none: every violation cleared within the settle time</p>")
    parts.append("<h2>Traffic checks</h2>")
    parts.append(_table(["check", "from", "to", "left the source", "entered the destination", "expected", "flow",
                         "result"],
                        [[_check_name(t), t.get("src", NOTHING), t.get("dst", NOTHING), _counters(t.get("src_egress")),
                          _counters(t.get("dst_ingress")), _counters(t.get("expected", t.get("skipped"))),
                          _flow_cell(t), _check_result(t)]
                         for t in result.traffic]) if result.traffic else "<p>none in this scenario</p>")
    parts += _flow_failures(result.traffic)
    parts += _dns_section(result.traffic)
    parts += _nodes_section(result)  # a multi-node run: one line per node, the cross-node matrix
    parts.append("<h2>Flows</h2>")
    parts += _flows_section(result.flows, plots)
    parts.append("<h2>Memory</h2>")
    tolerance = result.memory.get("tolerance_mib")
    parts.append(_table(["process", "baseline", "at the end", "growth", f"within {_human(tolerance)} MiB"],
                        [[name, _mib(v["baseline_mib"]), _mib(v["end_mib"]), _mib(v["growth_mib"], sign=True),
                          _yes_no(v["returned"])]
                         for name, v in result.memory.items() if isinstance(v, dict)])
                 if any(isinstance(v, dict) for v in result.memory.values()) else "<p>not measured</p>")
    parts.append("<h2>Counts</h2>")
    parts.append(_table(["what", "value"], [[_COUNT_NAMES.get(k, k.replace("_", " ")), _count_value(k, v)]
                                            for k, v in result.counts.items()]))
    parts.append("<h2>Over time</h2>")
    parts += _timeline_section(result.marks)
    for plot in plots:
        if plot.stem != "flows":
            parts.append(_image(plot))
    parts.append("<h2>Logs and files</h2>")
    parts.append(_files_section(result, plots, out))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}td,th{border:1px solid #ccc;"
             "padding:3px 8px;vertical-align:top}th{text-align:left;background:#f4f4f4}"
             ".held{color:#176f2c;font-weight:bold}.failed{color:#a4161a;font-weight:bold}"
             ".unchecked{color:#777}.small{font-size:0.85em;color:#444}")
    body = "\n".join(parts)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>podmeter lab: "
            f"{html.escape(result.scenario)}</title><style>{style}</style></head><body>{body}</body></html>")


def _table(head: list[str], rows: list[list[Any]], *, header: bool = True) -> str:
    """Every cell written for people (:func:`_human`); an :class:`Html` cell is markup already."""
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head) if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table style='border-collapse:collapse'>{f'<tr>{cells}</tr>' if cells else ''}{body}</table>"


def _image(plot: Path) -> str:
    data = base64.b64encode(plot.read_bytes()).decode()
    return f"<p><img alt='{plot.stem}' src='data:image/png;base64,{data}'></p>"


# --- at a glance: numbers for people, the run, the invariants, the timeline, the files -----------------


class Html(str):
    """A table cell that is markup already (escaped where it holds text)."""

    __slots__ = ()


def _cell(value: Any) -> str:
    return value if isinstance(value, Html) else html.escape(_human(value))


def _human(value: Any) -> str:
    """Any value as a person reads it: ``12,345``, ``0.3``, ``yes``, an en dash for nothing, a mapping as
    ``key value, ...``, a sequence joined with commas: never a Python repr."""
    if value is None:
        return NOTHING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, dict):
        return ", ".join(f"{str(k).replace('_', ' ')} {_human(v)}" for k, v in value.items()) or NOTHING
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(_human(v) for v in value) or NOTHING
    return str(value)


def _number(value: float) -> str:
    """``1,234``, ``56.7``, ``0.3`` (never ``0.30000000000000004``)."""
    if math.isnan(value) or math.isinf(value):
        return NOTHING
    if value == int(value):
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) < 0.01:
        return f"{value:.1g}"
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _duration(seconds: float | None) -> str:
    """``850 ms``, ``4.5 s``, ``47 s``, ``2 min 47 s``, ``1 h 3 min``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return NOTHING
    if seconds == 0:
        return "0 s"
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{minutes} min {secs} s" if secs else f"{minutes} min"


def _is_pair(value: Any) -> bool:
    return (isinstance(value, list | tuple) and len(value) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value))


def _counters(value: Any) -> str:
    """A (packets, bytes) pair: ``40 pkts, 13,680 B``; pairs in turn (the holders of a reused IP): joined
    with ``then``; anything else (a skip's reason) as :func:`_human` writes it."""
    if _is_pair(value):
        return f"{_human(value[0])} pkts, {_human(value[1])} B"
    if isinstance(value, list | tuple) and value and all(_is_pair(v) for v in value):
        return " then ".join(_counters(v) for v in value)
    return _human(value)


def _check_result(check: dict[str, Any]) -> Html:
    if "skipped" in check:
        return Html("<span class='unchecked'>skipped</span>")
    if check.get("ok"):
        return Html("<span class='held'>exact</span>")
    return Html("<span class='failed'>FAILED</span>")


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}" + ("" if count == 1 else "s")


def _mib(value: float | None, *, sign: bool = False) -> str:
    if value is None:
        return NOTHING
    return f"{value:+,.1f} MiB" if sign else f"{value:,.1f} MiB"


def _yes_no(value: Any) -> Html:
    return Html("<span class='held'>yes</span>" if value else "<span class='failed'>no</span>")


_COUNT_NAMES = {
    "pods_created": "pods created", "pods_deleted": "pods deleted",
    "lifecycles": "lifecycles (pods created and deleted again)",
    "deleted_in_phase": "pods deleted, by their phase at the delete", "interest_flips": "interest flips",
    "faults": "API server faults", "agent_kills": "agent SIGKILLs", "driver_errors": "steps that failed",
    "transient_violations": "transient violations (cleared within the settle time)",
    "overflow_max_waiting": "most desired IPs waiting for room in a full map",
    "max_filter_drift": "most IPs leaked or missing at once", "delete_to_unmapped_ms": "pod deleted to IP unmapped",
    "restart_converged_after_s": "agent ready to kernel map converged", "flow_checks": "flow checks",
}


def _count_value(key: str, value: Any) -> str:
    if key == "delete_to_unmapped_ms" and isinstance(value, dict):
        if not value.get("count"):
            return "not measured"
        text = (f"p50 {_duration(value['p50'] / 1000)}, p99 {_duration(value['p99'] / 1000)}, "
                f"max {_duration(value['max'] / 1000)} over {value['count']:,} deletes")
        if value.get("unseen"):
            text += f"; {value['unseen']:,} IPs reused before they were seen leaving the map"
        return text
    if key == "restart_converged_after_s" and isinstance(value, list):
        return ", ".join(_duration(v) for v in value) if value else "no restart"
    if key == "flow_checks" and isinstance(value, dict):
        text = f"{value.get('exact', 0):,} of {value.get('checked', 0):,} exact"
        if value.get("records_at_end") is not None:
            text += f"; {value['records_at_end']:,} records at the end checked for I8"
        return text
    return _human(value)


_DATAPATHS = {"ebpf": "eBPF: pods are network namespaces sending real packets; the kernel map is read through "
                      "its pin",
              "memory": "memory: IPs only, no packets; the filter is read from the agent's /debug/state"}


def _run_rows(result: LabResult, out: Path) -> list[list[Any]]:
    info = result.info
    rows: list[list[Any]] = [["scenario", result.scenario], ["seed", result.seed],
                             ["datapath", _DATAPATHS.get(result.datapath, result.datapath)]]
    if info is None:  # a result from before the run recorded its metadata
        return [*rows, ["steps ran", _duration(result.steps_s)], ["logs", _log_links(out / "logs", out)]]
    steps = f"steps {_duration(result.steps_s)}"
    if result.steps_s is not None and result.steps_s < info.planned_s - 0.5:
        steps += f" (of {_duration(info.planned_s)}: the lifecycles were done)"
    elif result.steps_s is not None and result.steps_s > info.planned_s + 0.5:
        steps += f" (of {_duration(info.planned_s)}: the step running then finished first)"
    return [*rows,
            ["podmeter", f"{info.podmeter_version}, commit {info.commit or 'unknown'}"],
            ["kernel", info.kernel], ["host", f"{info.host}, Python {info.python}"],
            ["started", info.started],
            ["duration", f"{_duration(info.duration_s)} in all: start-up, {steps}, teardown and settling"],
            ["settle", f"{_duration(info.settle_s)} (a violation lasting longer fails the run), a sample every "
                       f"{_duration(info.sample_interval_s)}"],
            *([["Hubble API", ", ".join(f"{node} {address}" for node, address in result.hubble.items())]]
              if result.hubble else []),
            ["logs", _log_links(Path(info.log_dir), out)]]


def _at_a_glance(result: LabResult, invariants: list[dict[str, Any]]) -> str:
    checked = [r for r in invariants if r["status"] != NOT_CHECKED]
    failed = [r["id"] for r in checked if r["status"] == FAILED]
    parts = [f"{len(checked) - len(failed)} of {len(checked)} invariants checked held"
             + (f" ({', '.join(failed)} failed)" if failed else "")]
    real = [t for t in result.traffic if "skipped" not in t]
    if real:
        parts.append(f"{sum(bool(t.get('ok')) for t in real):,} of {len(real):,} traffic checks exact")
    grown = [name for name, v in result.memory.items() if isinstance(v, dict) and not v.get("returned")]
    if any(isinstance(v, dict) for v in result.memory.values()):
        parts.append(f"memory of {', '.join(grown)} not back to baseline" if grown else "memory back to baseline")
    parts.append(f"{result.datapath}, seed {result.seed}")
    if result.info is not None and result.info.duration_s is not None:
        parts.append(_duration(result.info.duration_s))
    return " · ".join(parts)


# --- the invariants ------------------------------------------------------------------------------------

HELD, FAILED, NOT_CHECKED = "held", "failed", "not checked"
INVARIANTS = [
    ("I1", "store", "the agent's pod store holds exactly the API server's pods of its node"),
    ("I2", "filter", "the kernel filter holds exactly the IPs of the observed pods: none leaked, none missing"),
    ("I3", "eligibility", "no IP of a finished or host-network pod is in the kernel filter"),
    ("I4", "identities", "the identities held equal the label sets of the live pods"),
    ("I5", "series", "a per-pod series exists only for a pod of the node and counts only that pod's traffic"),
    ("I6", "restart", "after an agent SIGKILL, its successor converges from the pinned map within the settle time"),
    ("I7", "endpoints", "the cluster-wide endpoints (IP cache, PodSlices) equal the API server's pods"),
    ("I8", "flows", "every flow record names the pod that held the IP when its packets were counted"),
]


def invariant_rows(result: LabResult) -> list[dict[str, Any]]:
    """One row per invariant (I1-I8, then any other a failure names): ``status`` held, failed or not
    checked (with a ``note`` saying why or how), ``failures``, ``transients`` and ``worst`` (the longest
    violation that cleared within the settle time: how long, what)."""
    failures: dict[str, list[dict[str, Any]]] = {}
    for failure in result.failures:
        failures.setdefault(str(failure["invariant"]), []).append(failure)
    known = {ident for ident, _, _ in INVARIANTS}
    extra = [(ident, "", "") for ident in sorted(failures) if ident not in known]
    return [_invariant_row(result, ident, name, what, failures.get(ident, []))
            for ident, name, what in [*INVARIANTS, *extra]]


def _transient(transients: dict[str, Any], prefix: str, intro: str = "") -> str:
    """``2.6 s: 10.244.0.7`` and, below it, the violation's detail."""
    return (f"{html.escape(intro)}{html.escape(_duration(transients.get(prefix + 'longest_s')))}: "
            f"{html.escape(str(transients.get(prefix + 'subject', '')))}<br><span class='small'>"
            f"{html.escape(str(transients.get(prefix + 'detail', '')))}</span>")


def _invariant_row(result: LabResult, ident: str, name: str, what: str,
                   failures: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"id": ident, "name": name, "checks": what, "failures": len(failures),
                           "status": FAILED if failures else HELD, "note": "", "transients": None, "worst": NOTHING}
    if ident in ("I1", "I2", "I3", "I4", "I5"):
        transients = result.transients.get(ident) or {}
        row["transients"] = int(transients.get("count", 0))
        held = int(transients.get("held_count", 0))
        worst = []
        if row["transients"] > held:
            worst.append(_transient(transients, ""))
        if held:
            worst.append(_transient(transients, "held_", f"during a hold of the checks ({_plural(held, 'transient')}):"
                                                         " "))
        if worst:
            row["worst"] = Html("<br>".join(worst))
    if not result.samples:
        return {**row, "status": FAILED if failures else NOT_CHECKED, "note": "the run ended before its first sample"}
    counts, info = result.counts, result.info
    if result.checked and ident not in result.checked and ident not in ("I6", "I8") and not failures:
        return {**row, "status": NOT_CHECKED, "note": _UNCHECKED.get(ident, "no sample of this run could check it")}
    if ident == "I4":
        operator = info.operator if info is not None else any(s.identities is not None for s in result.samples)
        if not operator and not failures:
            row.update(status=NOT_CHECKED, note="the operator did not run in this scenario")
    elif ident == "I5":
        # The exchanges whose counters and series are compared (not the drop and loss checks): failed, yet
        # their flow records exact (those fail I8).
        off = [t for t in result.traffic if "skipped" not in t and not t.get("ok", True) and "src_egress" in t
               and t.get("kind") in (None, "reuse-during-flow")
               and (not isinstance(t.get("flow"), dict) or t["flow"].get("ok"))]
        if off:
            row.update(status=FAILED, note=f"the kernel's counters or the agent's series differ in "
                                           f"{_plural(len(off), 'traffic check')}")
    elif ident == "I6":
        kills = int(counts.get("agent_kills") or 0)
        converged = [float(c) for c in counts.get("restart_converged_after_s") or []]
        settle = info.settle_s if info is not None else math.inf
        if not kills:
            row.update(status=NOT_CHECKED, note="no agent kill in this scenario")
        else:
            late = kills - len([c for c in converged if c <= settle])
            row.update(status=FAILED if late or failures else HELD, failures=len(failures) + late,
                       note=f"{_plural(kills, 'SIGKILL')}: " + (f"{_plural(late, 'successor')} did not converge "
                                                                  "within the settle time" if late else
                                                                  "every successor converged"))
            if converged:
                row["worst"] = f"{_duration(max(converged))} from the successor ready to the kernel map converged"
    elif ident == "I7" and not result.checked and not failures:
        row.update(status=NOT_CHECKED, note=_UNCHECKED["I7"])
    elif ident == "I8":
        flows = counts.get("flow_checks") or {}
        checked, exact = int(flows.get("checked") or 0), int(flows.get("exact") or 0)
        if not checked and flows.get("records_at_end") is None and not failures:
            reason = "memory mode has no packets" if result.datapath == "memory" else "no traffic in this scenario"
            row.update(status=NOT_CHECKED, note=f"{reason}, so no flows")
        else:
            row.update(status=FAILED if failures or exact < checked else HELD,
                       failures=len(failures) + checked - exact,
                       note=f"{exact:,} of {checked:,} flow checks exact, and every record at the end named a pod "
                            "that held its IP" if not failures else f"{exact:,} of {checked:,} flow checks exact")
    return row


_UNCHECKED = {  # why an invariant the samples never checked was not checked
    "I1": "the agent's store was never read", "I2": "the kernel filter was never read",
    "I3": "the kernel filter was never read", "I4": "the operator did not run, or its identities were never read",
    "I5": "the agent's metrics were never read",
    "I7": "this run did not check it; tests/runtime/test_endpoint_publication.py does (operators against the lab API "
          "server)",
}


def _invariants_table(rows: list[dict[str, Any]]) -> str:
    labels = {HELD: "held", FAILED: "FAILED", NOT_CHECKED: "not checked"}
    classes = {HELD: "held", FAILED: "failed", NOT_CHECKED: "unchecked"}
    cells = []
    for row in rows:
        status = row["status"]
        note = f"<br><span class='small'>{html.escape(row['note'])}</span>" if row["note"] else ""
        result = Html(f"<span class='{classes[status]}'>{labels[status]}</span>{note}")
        transients = NOTHING if row["transients"] is None else row["transients"]
        cells.append([Html(f"<b>{html.escape(row['id'])}</b> {html.escape(row['name'])}"), row["checks"], result,
                      row["failures"], transients, row["worst"]])
    return _table(["invariant", "what it checks", "result", "failures", "transients",
                   "worst transient: how long, what"], cells)


# --- the timeline and the files ------------------------------------------------------------------------


def _timeline_section(marks: list[Mark]) -> list[str]:
    rows: list[list[Any]] = []
    for mark in sorted(marks, key=lambda m: m.t):
        span = None if mark.until is None else _duration(max(0.0, mark.until - mark.t))
        if mark.kind == runinfo.HELD:
            rows.append([_duration(mark.t), "the checks held (violations do not age)", span])
        elif mark.kind == runinfo.AGENT_KILL:
            rows.append([_duration(mark.t), "agent SIGKILL",
                         f"successor ready after {span}" if span else "no successor ready"])
        elif mark.kind == runinfo.TEARDOWN:
            rows.append([_duration(mark.t), "the steps end: every pod is deleted, then the run settles", None])
        else:
            rows.append([_duration(mark.t), f"fault: {mark.label}", span])
    if not rows:
        return ["<p>no faults in this run</p>"]
    return ["<p>Marked on every plot below: faults (orange), agent SIGKILLs (red) and their successor ready "
            "(green, dotted), the end of the steps (grey, dashed); the checks were held in the shaded spans. "
            "Times are seconds since the steps started.</p>",
            _table(["at", "what", "for"], rows)]


def _href(path: Path, out: Path) -> str:
    return html.escape(urllib.parse.quote(Path(os.path.relpath(path, out)).as_posix()), quote=True)


def _log_links(log_dir: Path, out: Path) -> Html | str:
    logs = sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []
    if not logs:
        return "no logs"
    return Html(", ".join(f"<a href='{_href(p, out)}'>{html.escape(p.name)}</a>" for p in logs))


def _files_section(result: LabResult, plots: list[Path], out: Path) -> str:
    log_dir = Path(result.info.log_dir) if result.info is not None else out / "logs"
    logs = sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []
    rows: list[list[Any]] = [
        [Html(f"<a href='{_href(p, out)}'>{html.escape(p.name)}</a>"), what, _bytes(p.stat().st_size)]
        for p, what in [*[(log, f"the {log.stem}'s log (stdout and stderr, every start)") for log in logs],
                        (out / "report.json", "everything on this page, and every sample, as JSON"),
                        *[(plot, "plot") for plot in plots]]
        if p.exists()]
    return _table(["file", "what", "size"], rows) if rows else "<p>no files</p>"


# --- flows -------------------------------------------------------------------------------------------


def _check_name(check: dict[str, Any]) -> str:
    kind = check.get("kind")
    return f"{check.get('protocol')} {kind}" if kind else str(check.get("protocol"))


def _flow_cell(check: dict[str, Any]) -> str:
    flow = check.get("flow")
    if not isinstance(flow, dict):
        return "-"
    if flow.get("ok"):
        return f"exact ({flow.get('records', 0):,} records)"
    problems = len(flow.get("problems") or [])
    return f"{problems:,} problem{'' if problems == 1 else 's'}"


def _flow_failures(checks: list[dict[str, Any]]) -> list[str]:
    """Each failed flow check: its problems (expected vs found, one per line), then both in full."""
    parts: list[str] = []
    for check in checks:
        flow = check.get("flow")
        if not isinstance(flow, dict) or flow.get("ok"):
            if check.get("problem"):
                parts.append(f"<p><b>{html.escape(_check_name(check))}</b>: {html.escape(str(check['problem']))}</p>")
            continue
        title = f"{_check_name(check)} {check.get('src')} -> {check.get('dst')}"
        items = "".join(f"<li>{html.escape(str(p))}</li>" for p in flow.get("problems") or [])
        detail = html.escape(json.dumps({"expected": flow.get("expected"), "found": flow.get("found")}, indent=1))
        parts.append(f"<p><b>flow check failed: {html.escape(title)}</b></p><ul>{items}</ul>"
                     f"<details><summary>expected and found</summary><pre>{detail}</pre></details>")
    return parts


def _dns_section(checks: list[dict[str, Any]]) -> list[str]:
    """Per client pod of each dns step: the answers by return code and the names asked (the server's
    account, which the agent's was checked against)."""
    rows = [[pod, _counters_text(seen.get("queries")), _counters_text(seen.get("responses")),
             ", ".join(seen.get("names") or [])[:400] or NOTHING]
            for check in checks if check.get("kind") == "dns"
            for pod, seen in sorted((check.get("per_pod") or {}).items())]
    if not rows:
        return []
    return ["<h2>DNS</h2>", _table(["pod", "queries by type", "answers by return code", "names asked"], rows)]


def _counters_text(counts: Any) -> str:
    if not isinstance(counts, dict) or not counts:
        return NOTHING
    return ", ".join(f"{key} {value:,}" for key, value in sorted(counts.items(), key=lambda kv: -kv[1]))


def _workload_label(flow_end: dict[str, Any]) -> str:
    """``web/frontend`` for a Deployment (the usual case), ``web/reuse-5 (Pod)`` otherwise, ``world``."""
    text = str(flow_end.get("workload", WORLD))
    if text == WORLD:
        return WORLD
    kind, _, name = text.partition(" ")
    return name if kind == "Deployment" else f"{name} ({kind})"


def _matrix(flows: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], int]]:
    cells: dict[tuple[str, str], int] = {}
    for flow in flows:
        key = (_workload_label(flow["source"]), _workload_label(flow["destination"]))
        cells[key] = cells.get(key, 0) + counted_bytes(flow)
    totals: dict[str, int] = {}
    for (src, dst), value in cells.items():
        totals[src] = totals.get(src, 0) + value
        totals[dst] = totals.get(dst, 0) + value
    rows = sorted({src for src, _ in cells}, key=lambda w: (-totals[w], w))
    cols = sorted({dst for _, dst in cells}, key=lambda w: (-totals[w], w))
    return rows, cols, cells


def _matrix_plot(path: Path, flows: list[dict[str, Any]]) -> Path:
    """Rows: source workload; columns: destination workload; colour (log scale) and label: bytes, each
    packet counted once (where it left a pod of the node)."""
    from matplotlib.colors import LogNorm

    rows, cols, cells = _matrix(flows)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(cols) + 3), max(2.6, 0.45 * len(rows) + 1.6)), dpi=90)
    if not cells:
        ax.text(0.5, 0.5, "no flows checked in this run", ha="center", va="center")
        ax.set_axis_off()
    else:
        grid = [[cells.get((r, c), 0) or math.nan for c in cols] for r in rows]
        values = [v for v in cells.values() if v > 0] or [1]
        low, high = max(1, min(values)), max(values)
        vmin, vmax = min(low, high / 10), max(high, 10)
        image = ax.imshow(grid, cmap="YlOrRd", aspect="auto", norm=LogNorm(vmin=vmin, vmax=vmax))
        ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_xlabel("destination workload")
        ax.set_ylabel("source workload")
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                if cells.get((r, c)):
                    dark = math.log(cells[(r, c)] / vmin) > 0.6 * math.log(vmax / vmin)
                    ax.text(j, i, _bytes(cells[(r, c)]), ha="center", va="center", fontsize=8,
                            color="white" if dark else "black")
        fig.colorbar(image, ax=ax, label="bytes", fraction=0.05)
    ax.set_title("workload to workload traffic (bytes, flows the lab checked)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _bytes(value: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _point(counts: list[int]) -> str:
    return f"{counts[0]:,} pkts, {counts[1]:,} B"


def _end_text(end: dict[str, Any]) -> str:
    return f"{end.get('pod')} {end.get('ip')}:{end.get('port')}"


def _flows_section(flows: list[dict[str, Any]], plots: list[Path]) -> list[str]:
    matrix = [p for p in plots if p.stem == "flows"]
    parts = [_image(p) for p in matrix]
    if not flows:
        parts.append("<p>no flow records checked in this run</p>")
        return parts
    top = sorted(flows, key=lambda f: (-counted_bytes(f), f["protocol"], _end_text(f["source"])))[:TOP_FLOWS]
    parts.append(f"<p>Top {len(top)} of {len(flows)} flows by bytes (records of one flow added up; "
                 f"from-pod: leaving the source's veth, to-pod: entering the destination's)</p>")
    parts.append(_table(["protocol", "source", "destination", "bytes", "from-pod", "to-pod", "TCP flags"],
                        [[f["protocol"], _end_text(f["source"]), _end_text(f["destination"]),
                          _bytes(counted_bytes(f)), _point(f[FROM_POD]), _point(f[TO_POD]),
                          " ".join(f["tcp_flags"]) or "-"]
                         for f in top]))
    return parts


# --- several nodes (podmeter.lab.cluster): one line per node, the cross-node matrix --------------------


def _nodes_section(result: LabResult) -> list[str]:
    """One line per node of a multi-node run, then the matrix of its cross-node traffic; nothing for a
    single-node run."""
    if not result.nodes:
        return []
    rows = []
    for node in result.nodes:
        peaks, memory = node.get("peaks") or {}, node.get("memory") or {}
        agent = f"{node.get('agent_starts', 0)} started" + (f", fault {node['agent_fault']}"
                                                            if node.get("agent_fault") else "")
        converged = ", ".join(f"{c:g} s" for c in node.get("restart_converged_after_s") or [])
        rows.append([node["name"], node["pod_cidr"], node.get("address", "-"), agent,
                     f"{peaks.get('pods', 0)} / {peaks.get('desired', 0)} / {peaks.get('kernel', '-')}",
                     str(peaks.get("endpoints", "-")),
                     f"{memory['growth_mib']:+.1f} MiB" if memory else "-",
                     ", ".join(node.get("failed_invariants") or []) or "none",
                     str(node.get("transient_violations", 0)), converged or "-"])
    parts = ["<h2>Nodes</h2>",
             "<p>Each node is a network namespace with its own <code>podmeter node</code>, agent (own pins, own "
             "port) and pod CIDR; the checks ran on every node (I1-I3, I5, and I7 on its agent's endpoint "
             "cache).</p>",
             _table(["node", "pod CIDR", "address", "agent", "most pods / desired / kernel", "most endpoints",
                     "agent RSS growth", "failed", "transients", "restart converged"], rows)]
    return parts + _cross_node_matrix(result.cross_node)


def _cross_node_matrix(cross: dict[str, Any]) -> list[str]:
    names: list[str] = cross.get("nodes") or []
    cells: dict[str, dict[str, dict[str, Any]]] = cross.get("cells") or {}
    if len(names) < 2:
        return []
    head = "".join(f"<th>to {html.escape(n)}</th>" for n in names)
    body = []
    for source in names:
        tds = []
        for destination in names:
            cell = cells.get(source, {}).get(destination) or {}
            checks, exact = int(cell.get("checks", 0)), int(cell.get("exact", 0))
            if not checks and not cell.get("bytes"):
                tds.append("<td style='color:#777'>&ndash;</td>")
                continue
            color = "#e3f4e6" if checks and exact == checks else "#f9dede" if checks else "#f4f4f4"
            verdict = f"{exact} of {checks} exact" if checks else "not checked"
            tds.append(f"<td style='background:{color}'><b>{verdict}</b><br>{_bytes(cell.get('bytes', 0))}, "
                       f"{int(cell.get('packets', 0)):,} pkts, {int(cell.get('flows', 0))} flows</td>")
        body.append(f"<tr><th>from {html.escape(source)}</th>{''.join(tds)}</tr>")
    return ["<h3>Cross-node traffic</h3>",
            "<p>Rows: the node of the source pod; columns: the node of the destination pod. In each cell the "
            "traffic checks between them (exact: the kernel counters of both nodes, both agents' per-pod "
            "series, and both agents' flow records: the source's at from-pod and the destination's at to-pod, "
            "each naming both ends with the same identity), then the bytes of their flows, each packet counted "
            "once (where it left a pod).</p>",
            f"<table style='border-collapse:collapse'><tr><th></th>{head}</tr>{''.join(body)}</table>"]
