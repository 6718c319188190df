"""The lab report: ``report.json``, PNG plots and ``report.html`` (self-contained: plots inlined).

Plots: live pods vs desired vs kernel filter entries over time; agent and operator RSS over time;
identities; pod watch events per second, relists and repairs. The HTML page adds the verdict, every
failure with its IPs and pods, the traffic checks, memory against the baselines and the counts.
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

from podmeter.lab.run import LabResult, Sample


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
                   [("events", "pod events/s"), ("relists", "relists"), ("repairs", "repairs")])]
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
    parts.append(_table(["protocol", "from", "to", "from egress (pkts, bytes)", "to ingress", "expected", "ok"],
                        [[t.get("protocol"), t.get("src", "-"), t.get("dst", "-"), t.get("src_egress", "-"),
                          t.get("dst_ingress", "-"), t.get("expected", t.get("skipped", "-")), t.get("ok", "-")]
                         for t in result.traffic]) if result.traffic else "<p>none in this scenario</p>")
    parts.append("<h2>Memory</h2>")
    parts.append(_table(["process", "baseline MiB", "end MiB", "growth MiB", "returned"],
                        [[name, v["baseline_mib"], v["end_mib"], v["growth_mib"], v["returned"]]
                         for name, v in result.memory.items() if isinstance(v, dict)]))
    parts.append("<h2>Counts</h2>")
    parts.append(_table(["what", "value"], [[k, v] for k, v in result.counts.items()]))
    parts.append("<h2>Over time</h2>")
    for plot in plots:
        data = base64.b64encode(plot.read_bytes()).decode()
        parts.append(f"<p><img alt='{plot.stem}' src='data:image/png;base64,{data}'></p>")
    style = "body{font-family:sans-serif;max-width:1000px;margin:2em auto}td,th{border:1px solid #ccc;padding:3px 8px}"
    body = "\n".join(parts)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>podmeter lab: "
            f"{html.escape(result.scenario)}</title><style>{style}</style></head><body>{body}</body></html>")


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table style='border-collapse:collapse'><tr>{cells}</tr>{body}</table>"
