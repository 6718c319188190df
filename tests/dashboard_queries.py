"""The dashboards' panels and queries, and which of the series they ask for podmeter exports (pure: it reads
the dashboards' JSON files and nothing else).

* :func:`panels` walks a Grafana dashboard (rows and their nested panels included) and returns every panel
  with at least one query (``targets[].expr``, hidden targets left out): a text panel or a row has none.
* :func:`promql` turns a panel's query into what Prometheus evaluates, as Grafana would send it: its
  interval variables (``$__rate_interval``...) replaced, a variable inside a regular-expression matcher
  (``instance=~"$Nodes"``) by ``.*`` (the "All" a user leaves there), any other by the value a user picks
  (``cluster="$cluster"``: :data:`PICKED` plus the scenario's own).
* :data:`EXPORTED`, :data:`NOT_EXPORTED` and :data:`NOT_YET` are the one place that says which of the
  dashboards' series podmeter exports, under which agent argument, with which label values: the test of
  the dashboards expects data exactly in the panels :func:`expected` says podmeter fills, and
  ``docs/metrics.md``'s table of Retina's and Hubble's series is checked against them. When podmeter
  exports one more series, its name moves from :data:`NOT_YET` (or :data:`NOT_EXPORTED`) to
  :data:`EXPORTED`, and the threshold rises with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podmeter.model.hubble_metrics import RCODES
from podmeter.model.node_stats import INTERFACE_STATISTICS, TCP_STATES
from podmeter.model.retina_dns import RETURN_CODES

ROOT = Path(__file__).resolve().parent.parent
RETINA_DASHBOARDS = ROOT / "tests" / "data" / "dashboards" / "retina"
OWN_DASHBOARDS = ROOT / "deploy" / "dashboards"
OWN_PREFIXES = ("podmeter_", "process_")  # podmeter's own series: every panel of its dashboards must fill

# Grafana's interval variables, for a Prometheus scraping every second (the test's): a rate window holds
# many samples, and what happened in the last seconds of traffic is in it.
INTERVALS = {"__rate_interval": "15s", "__interval": "5s", "__range": "5m", "__range_s": "300",
             "__range_ms": "300000", "__interval_ms": "5000"}
CLUSTER = "podmeter-lab"  # the `cluster` target label Retina's scrape configuration adds
PICKED = {"cluster": CLUSTER}  # what a user picks where a variable is not in a regular expression
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)|\[\[([A-Za-z_]\w*)\]\]")
REGEX_MATCHER = re.compile(r'(=~|!~)(\s*)"((?:[^"\\]|\\.)*)"')
SERIES = re.compile(r"\b((?:networkobservability|hubble|podmeter|process|kube)_[a-zA-Z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
COMMENT = re.compile(r"#[^\n]*")


@dataclass(frozen=True)
class Panel:
    dashboard: str
    id: int
    title: str
    queries: tuple[str, ...]


@dataclass(frozen=True)
class Series:
    """A series of the dashboards podmeter exports: with which agent argument (None: always;
    ``--retina-compat`` is given by ``--retina-compat=local`` too, ``--retina-compat=remote`` only by
    itself), and for some labels the only values it ever has (a matcher asking for another finds nothing)."""

    requires: str | None = None
    values: Mapping[str, frozenset[str]] = field(default_factory=dict)
    why: str = ""  # what podmeter puts there, in a word (docs/metrics.md says it in full)


RETINA, REMOTE, HUBBLE = "--retina-compat", "--retina-compat=remote", "--hubble-metrics"
_DIRECTIONS = frozenset({"ingress", "egress"})
_EMPTY = frozenset({""})
_RETURN_CODES = frozenset(RETURN_CODES.values())
_RCODES = frozenset(RCODES.values())
EXPORTED: dict[str, Series] = {
    "networkobservability_adv_forward_count": Series(REMOTE),
    "networkobservability_adv_drop_count": Series(REMOTE),
    "networkobservability_forward_bytes": Series(RETINA, {"direction": _DIRECTIONS}),
    "networkobservability_forward_count": Series(RETINA, {"direction": _DIRECTIONS}),
    "networkobservability_drop_bytes": Series(RETINA, {"direction": _DIRECTIONS}),
    "networkobservability_drop_count": Series(RETINA, {"direction": _DIRECTIONS}),
    # resetcount (the observed pods' RSTs) and the node's TcpExt counters lower-cased: the ones the dashboards
    # ask for of the kernel's hundred or so
    "networkobservability_tcp_connection_stats": Series(RETINA, {"statistic_name": frozenset(
        {"resetcount", "tcptimeouts", "tcptsreorder"})}),
    "networkobservability_tcp_flag_counters": Series(RETINA, {"flag": frozenset({"rst"})}),
    # The node's own stack, from the kernel's files of the agent's network namespace (/proc/net)
    "networkobservability_tcp_state": Series(RETINA, {"state": frozenset(TCP_STATES.values())}),
    "networkobservability_tcp_connection_remote": Series(RETINA),
    "networkobservability_udp_connection_stats": Series(RETINA, {"statistic_name": frozenset({"active"})}),
    "networkobservability_interface_stats": Series(RETINA, {"statistic_name": frozenset(INTERFACE_STATISTICS)},
                                                   "no driver counters"),
    # With `flow` and `tcp` in --hubble-metrics, with the pod contexts the dashboards match
    # (dashboard_support.HUBBLE_METRICS).
    "hubble_flows_processed_total": Series(HUBBLE, {"verdict": frozenset({"FORWARDED", "DROPPED"}),
                                                    "type": frozenset({"Trace", "Drop"}),
                                                    "subtype": frozenset({"to-endpoint", "from-endpoint", ""})}),
    "hubble_tcp_flags_total": Series(HUBBLE, {"flag": frozenset({"SYN", "SYN-ACK", "FIN", "RST"})}),
    # DNS, from the DNS drain (podmeter reads no answer records: no answer addresses, no count of them)
    "networkobservability_dns_request_count": Series(RETINA, {"return_code": _RETURN_CODES, "response": _EMPTY,
                                                              "num_response": frozenset({"0"})}),
    "networkobservability_dns_response_count": Series(RETINA, {"return_code": _RETURN_CODES, "response": _EMPTY,
                                                               "num_response": _EMPTY}, "no answer records"),
    # With `dns` in --hubble-metrics (its `query` option and pod contexts: dashboard_support.HUBBLE_METRICS).
    "hubble_dns_queries_total": Series(HUBBLE, {"rcode": _EMPTY, "ips_returned": frozenset({"0"})}),
    "hubble_dns_responses_total": Series(HUBBLE, {"rcode": _RCODES, "ips_returned": _EMPTY}, "no answer records"),
}
NOT_EXPORTED = {  # name: why podmeter does not export it
    "networkobservability_node_apiserver_handshake_latency_ms_bucket":
        "the node's own TCP handshakes with the API server: they never pass the pods' veths podmeter hooks",
}
NOT_YET: dict[str, str] = {}  # name: the work that brings it (docs/metrics.md says "not yet")
# Series only the dashboards' template variables read (kube-state-metrics'): never a panel's query.
VARIABLE_ONLY = {"kube_pod_info", "kube_node_info"}


def dashboard_files() -> dict[str, Path]:
    """Every dashboard the test evaluates, by name: Retina's six, then podmeter's own."""
    found = {f"retina/{path.stem}": path for path in sorted(RETINA_DASHBOARDS.glob("*.json"))}
    found |= {f"podmeter/{path.stem}": path for path in sorted(OWN_DASHBOARDS.glob("*.json"))}
    return found


def is_own(dashboard: str) -> bool:
    return dashboard.startswith("podmeter/")


def _walk(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for panel in node.get("panels", ()):
        yield panel
        yield from _walk(panel)  # a row's panels (collapsed rows hold theirs)


def panels(name: str, dashboard: Mapping[str, Any]) -> list[Panel]:
    out = []
    for panel in _walk(dashboard):
        queries = tuple(t["expr"] for t in panel.get("targets", ()) if t.get("expr") and not t.get("hide"))
        if queries:
            out.append(Panel(name, int(panel.get("id", 0)), str(panel.get("title") or ""), queries))
    return out


def all_panels() -> list[Panel]:
    return [p for name, path in dashboard_files().items() for p in panels(name, json.loads(path.read_text()))]


def promql(query: str, picked: Mapping[str, str] = PICKED) -> str:
    """The query as Grafana sends it (see the module's docstring); a variable with no value is a KeyError."""
    text = VARIABLE.sub(lambda m: "$" + _name(m) if _name(m) not in INTERVALS else INTERVALS[_name(m)], query)
    text = REGEX_MATCHER.sub(lambda m: m[1] + m[2] + '"' + VARIABLE.sub(".*", m[3]) + '"', text)
    return VARIABLE.sub(lambda m: picked[_name(m)], text)


def _name(match: re.Match[str]) -> str:
    return next(group for group in match.groups() if group)


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)


def alternatives(query: str) -> list[list[Selector]]:
    """The query's series selectors, per alternative of a top-level ``or`` (any one of them fills the panel)."""
    text = COMMENT.sub("", query)
    parts, depth, start = [], 0, 0
    for match in re.finditer(r"[()]|\bor\b", text):
        token = match[0]
        depth += {"(": 1, ")": -1}.get(token, 0)
        if token == "or" and depth == 0:
            parts.append(text[start:match.start()])
            start = match.end()
    parts.append(text[start:])
    return [[Selector(m[1], tuple(MATCHER.findall(m[2] or ""))) for m in SERIES.finditer(part)] for part in parts]


def missing(selector: Selector, args: Sequence[str]) -> str | None:
    """Why podmeter, run with ``args``, exports nothing ``selector`` selects; None if it does."""
    name = selector.name
    if name.startswith(OWN_PREFIXES):
        return None
    series = EXPORTED.get(name)
    if series is None:
        why = NOT_EXPORTED.get(name) or (f"not yet: {NOT_YET[name]}" if name in NOT_YET else "not in the table")
        return f"{name}: {why}"
    if series.requires is not None and not any(a == series.requires or a.startswith(series.requires + "=")
                                               for a in args):
        return f"{name}: only with {series.requires}"
    for label, operator, value in selector.matchers:
        allowed = series.values.get(label)
        if allowed is None:
            continue
        matches = [bool(re.fullmatch(value, v)) if operator in ("=~", "!~") else v == value for v in allowed]
        if not (any(matches) if operator in ("=", "=~") else not all(matches)):
            shown = ", ".join(f'"{v}"' for v in sorted(allowed))
            return f'{name}{{{label}{operator}"{value}"}}: podmeter has only {label} {shown}'
    return None


def expected(panel: Panel, args: Sequence[str]) -> str | None:
    """None if podmeter run with ``args`` fills ``panel`` (one query with one alternative all of whose
    selectors it exports), else why not (the first missing series)."""
    reasons = []
    for query in panel.queries:
        for selectors in alternatives(query):
            why = [found for s in selectors if (found := missing(s, args)) is not None]
            if not why:
                return None
            reasons.append(why[0])
    return reasons[0] if reasons else "no series"


def queried_series() -> set[str]:
    """Every series name a panel of Retina's dashboards queries."""
    return {s.name for p in all_panels() if not is_own(p.dashboard) for q in p.queries
            for alt in alternatives(q) for s in alt}
