"""The lab report: ``report.json``, PNG plots and ``report.html`` (self-contained: plots inlined).

Plots: live pods vs desired vs kernel filter entries over time; agent and operator RSS over time;
identities; pod watch events per second, relists and repairs; the workload-to-workload traffic matrix of
the flows the lab checked (``flows.png``). The HTML page adds the verdict, every failure with its IPs and
pods, the traffic checks with their flow checks (what was expected and found when one failed), the top
flows by bytes, memory against the baselines and the counts.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import itertools

import matplotlib.pyplot as plt

from podmeter.lab.flowcheck import FROM_POD, TO_POD, WORLD, counted_bytes
from podmeter.lab.run import LabResult, Sample

TOP_FLOWS = 15


def write_report(result: LabResult, out: Path) -> list[Path]:
    """Write every report file into ``out``; returns their paths (JSON first, HTML last)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(_as_json(result), indent=2))
    plots = [_plot(out / "filter.png", result.samples, "pods and filter entries",
                   [("pods", "live pods on the node"), ("desired", "desired IPs"), ("kernel", "kernel entries")]),
             _plot(out / "memory.png", result.samples, "RSS (MiB)",
                   [("agent_rss", "agent"), ("operator_rss", "operator")]),
             _plot(out / "identities.png", result.samples, "identities", [("identities", "operator identities")]),
             _plot(out / "events.png", _rates(result.samples), "agent: events/s, relists, repairs",
                   [("events", "pod events/s"), ("relists", "relists"), ("repairs", "repairs")]),
             _matrix_plot(out / "flows.png", result.flows)]
    html_path = out / "report.html"
    html_path.write_text(_html(result, plots))
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


def _plot(path: Path, samples: list[Sample], title: str, series: list[tuple[str, str]]) -> Path:
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=90)
    for attr, label in series:
        # A missing value (a process down, a map not readable) is a gap in the line, not a bridge.
        values = [getattr(s, attr) for s in samples]
        if any(v is not None for v in values):
            ax.plot([s.t for s in samples], [math.nan if v is None else v for v in values], label=label,
                    linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel("seconds")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _html(result: LabResult, plots: list[Path]) -> str:
    verdict = "PASSED" if result.passed else "FAILED"
    color = "#176f2c" if result.passed else "#a4161a"
    parts = [f"<h1>podmeter lab: {html.escape(result.scenario)}</h1>",
             f"<p style='font-size:1.4em;color:{color}'><b>{verdict}</b> &middot; datapath {result.datapath}"
             f" &middot; seed {result.seed}</p>"]
    parts += [f"<p><i>{html.escape(n)}</i></p>" for n in result.notes]
    if result.error:
        parts.append(f"<p style='color:{color}'>error: {html.escape(result.error)}</p>")
    parts.append("<h2>Invariant failures</h2>")
    parts.append(_table(["invariant", "subject", "detail", "lasted s"],
                        [[f["invariant"], f["subject"], f["detail"], f["lasted_s"]] for f in result.failures])
                 if result.failures else "<p>none: every violation cleared within the settle time</p>")
    parts.append("<h2>Traffic checks</h2>")
    parts.append(_table(["check", "from", "to", "from egress (pkts, bytes)", "to ingress", "expected", "flow", "ok"],
                        [[_check_name(t), t.get("src", "-"), t.get("dst", "-"), t.get("src_egress", "-"),
                          t.get("dst_ingress", "-"), t.get("expected", t.get("skipped", "-")), _flow_cell(t),
                          t.get("ok", "-")]
                         for t in result.traffic]) if result.traffic else "<p>none in this scenario</p>")
    parts += _flow_failures(result.traffic)
    parts.append("<h2>Flows</h2>")
    parts += _flows_section(result.flows, plots)
    parts.append("<h2>Memory</h2>")
    parts.append(_table(["process", "baseline MiB", "end MiB", "growth MiB", "returned"],
                        [[name, v["baseline_mib"], v["end_mib"], v["growth_mib"], v["returned"]]
                         for name, v in result.memory.items() if isinstance(v, dict)]))
    parts.append("<h2>Counts</h2>")
    parts.append(_table(["what", "value"], [[k, v] for k, v in result.counts.items()]))
    parts.append("<h2>Over time</h2>")
    for plot in plots:
        if plot.stem != "flows":
            parts.append(_image(plot))
    style = "body{font-family:sans-serif;max-width:1000px;margin:2em auto}td,th{border:1px solid #ccc;padding:3px 8px}"
    body = "\n".join(parts)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>podmeter lab: "
            f"{html.escape(result.scenario)}</title><style>{style}</style></head><body>{body}</body></html>")


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table style='border-collapse:collapse'><tr>{cells}</tr>{body}</table>"


def _image(plot: Path) -> str:
    data = base64.b64encode(plot.read_bytes()).decode()
    return f"<p><img alt='{plot.stem}' src='data:image/png;base64,{data}'></p>"


# --- flows -------------------------------------------------------------------------------------------


def _check_name(check: dict[str, Any]) -> str:
    kind = check.get("kind")
    return f"{check.get('protocol')} {kind}" if kind else str(check.get("protocol"))


def _flow_cell(check: dict[str, Any]) -> str:
    flow = check.get("flow")
    if not isinstance(flow, dict):
        return "-"
    if flow.get("ok"):
        return f"exact ({flow.get('records', 0)} records)"
    return f"{len(flow.get('problems') or [])} problems"


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
    return f"{counts[0]} pkts, {counts[1]} B"


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
