"""Flow checks: what the agent's flow records say about one exchange must be exactly what the lab sent.

The lab knows every exchange it makes: both ends (pod, IP, port: the source port is read from the socket),
the protocol, and, from the pinned per-pod counters read before and after, the packets and bytes that left
the source and entered the destination. The agent drains its kernel flow map every ``--flow-interval``
and serves the named records at ``GET /debug/flows`` (docs/flows.md); one exchange may span several
drains, so the records of one key (5-tuple and observation point) are added up. The check
(:func:`check_flow`), against the records of the exchange's two keys (forward and reverse):

* every record names the right pods at both ends (namespace, pod, workload, node; never ``world``), and
  each named source lies within the time its pod held the address (:attr:`Holder.window`);
* at **both** observation points (``from-pod``: leaving the source's veth, ``to-pod``: entering the
  destination's) the packets and bytes of each direction equal what the counters (and, for UDP, the exact
  expectation) say;
* TCP: the flags of all records of a direction ORed together hold SYN and FIN (the connection opened and
  closed within the exchange).

An address reused during a flow (:class:`Holder`, more than one): records named by each holder carry
exactly that holder's packets, and nothing is named by anyone else. :func:`misnamed` is the run-wide
version: no record names a pod for an address the lab never saw it hold.

Pure functions over the records as ``/debug/flows`` prints them (dicts), so a test can feed wrong ones;
:class:`FlowClient` is the little I/O there is (the agent's HTTP endpoints).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from podmeter.lab.checks import Samples, metric_sum, parse_metrics
from podmeter.lab.processes import http_text

FROM_POD, TO_POD = "from-pod", "to-pod"
POINTS = (FROM_POD, TO_POD)
WORLD = "world"
WINDOW_SLACK = 0.25  # seconds: kernel timestamps become wall-clock time at the drain (docs/flows.md)

Record = dict[str, Any]  # one line of /debug/flows
Counts = tuple[int, int]  # packets, bytes
FlowKey = tuple[str, str, int, str, int]  # protocol, source ip, source port, destination ip, destination port
Pair = tuple[str, str, str, str, str, str, str]  # the labels of podmeter_workload_flow_bytes_total


@dataclass(frozen=True)
class PodEnd:
    """One end of an exchange as the lab made it: ``pod`` is ``namespace/name``; ``workload``, when set,
    is what the agent must call it (``Kind namespace/name``, :func:`workload_name`)."""

    pod: str
    ip: str
    port: int
    workload: str | None = None


@dataclass(frozen=True)
class Holder:
    """A pod that held the source address, what it sent (per observation point) and when: its records
    must have their first and last packet within ``window`` (wall-clock seconds; None: not checked)."""

    end: PodEnd
    sent: Mapping[str, Counts]
    window: tuple[float, float] | None = None


@dataclass(frozen=True)
class Expectation:
    """One exchange: the source address's holders in order (one, unless the address was reused during
    the flow), the destination, what came back (per point), the flags each direction must show."""

    protocol: str  # as records print it: "UDP", "TCP"
    holders: Sequence[Holder]
    destination: PodEnd
    reverse: Mapping[str, Counts] = field(default_factory=lambda: dict.fromkeys(POINTS, (0, 0)))
    forward_flags: frozenset[str] = frozenset()
    reverse_flags: frozenset[str] = frozenset()
    node: str | None = None

    @property
    def key(self) -> FlowKey:
        source = self.holders[0].end
        return self.protocol, source.ip, source.port, self.destination.ip, self.destination.port


# --- reading records ---------------------------------------------------------------------------------


def end_name(end: Mapping[str, Any]) -> str:
    """``namespace/pod``, or ``world`` for an address no pod held."""
    if end.get("world") or end.get("pod") is None:
        return WORLD
    return f"{end.get('namespace')}/{end.get('pod')}"


def workload_name(end: Mapping[str, Any]) -> str:
    """``Kind namespace/name`` (``Deployment web/frontend``, ``Pod web/reuse-3``), or ``world``."""
    if end.get("world") or end.get("workload") is None:
        return WORLD
    return f"{end.get('workload_kind')} {end.get('namespace')}/{end.get('workload')}"


def key_of(record: Mapping[str, Any]) -> FlowKey:
    s, d = record["source"], record["destination"]
    return str(record["protocol"]), str(s["ip"]), int(s["port"] or 0), str(d["ip"]), int(d["port"] or 0)


def reverse_key(key: FlowKey) -> FlowKey:
    protocol, sip, sport, dip, dport = key
    return protocol, dip, dport, sip, sport


def _fmt(counts: Counts) -> str:
    return f"{counts[0]} pkts {counts[1]} B"


def _counts(value: Sequence[int] | None) -> Counts:
    return (int(value[0]), int(value[1])) if value else (0, 0)


# --- one exchange --------------------------------------------------------------------------------------


def check_flow(expect: Expectation, records: Iterable[Record]) -> dict[str, Any]:
    """Compare the records of the exchange's keys with what the lab sent; the result has ``ok``,
    ``problems`` (one line each: what was expected, what was found), ``expected`` and ``found``."""
    forward, backward = expect.key, reverse_key(expect.key)
    holders = {h.end.pod: h for h in expect.holders}
    problems: list[str] = []
    sums: dict[tuple[str, str, str], list[int]] = {}  # (direction, source name, point) -> [packets, bytes]
    flags: dict[str, set[str]] = {"forward": set(), "reverse": set()}
    seen = 0
    for record in records:
        key = key_of(record)
        if key not in (forward, backward):
            continue
        seen += 1
        direction = "forward" if key == forward else "reverse"
        source, destination = record["source"], record["destination"]
        # Forward: the source is the address's holder, the destination the lab's; reverse: the other way.
        holder_end, peer_end = (source, destination) if direction == "forward" else (destination, source)
        holder_name, peer_name = end_name(holder_end), end_name(peer_end)
        point = str(record.get("observation"))
        if point not in POINTS:
            problems.append(f"{direction} record with an unknown observation point {point!r}")
        total = sums.setdefault((direction, holder_name, point), [0, 0])
        total[0] += int(record.get("packets", 0))
        total[1] += int(record.get("bytes", 0))
        flags[direction].update(record.get("tcp_flags") or ())
        if peer_name != expect.destination.pod:
            problems.append(f"a {direction} {point} record ({record.get('packets')} pkts) names "
                            f"{expect.destination.ip} {peer_name}, not {expect.destination.pod}")
        elif expect.destination.workload and workload_name(peer_end) != expect.destination.workload:
            problems.append(f"{expect.destination.pod} is named workload {workload_name(peer_end)}, "
                            f"not {expect.destination.workload}")
        holder = holders.get(holder_name)
        if holder is None:
            continue  # counted under its wrong name below
        if holder.end.workload and workload_name(holder_end) != holder.end.workload:
            problems.append(f"{holder_name} is named workload {workload_name(holder_end)}, not {holder.end.workload}")
        if holder.window is not None:
            low, high = holder.window
            first, last = float(record.get("first", 0.0)), float(record.get("time", 0.0))
            if first < low - WINDOW_SLACK or last > high + WINDOW_SLACK:
                problems.append(f"a {direction} {point} record named {holder_name} has packets from "
                                f"{first - low:+.2f} s to {last - low:+.2f} s of its holding, which lasted "
                                f"{high - low:.2f} s: packets of another holder of {holder.end.ip}?")
        if expect.node is not None and record.get("node") != expect.node:
            problems.append(f"a {direction} record drained by node {record.get('node')!r}, not {expect.node!r}")

    for holder in expect.holders:
        for point in POINTS:
            want, got = _counts(holder.sent.get(point)), _counts(sums.get(("forward", holder.end.pod, point)))
            if got != want:
                problems.append(f"{holder.end.pod} -> {expect.destination.pod} {expect.protocol} at {point}: "
                                f"expected {_fmt(want)}, found {_fmt(got)}")
    for point in POINTS:
        want = _counts(expect.reverse.get(point))
        back = [_counts(sums.get(("reverse", h.end.pod, point))) for h in expect.holders]
        got = (sum(c[0] for c in back), sum(c[1] for c in back))
        if got != want:
            problems.append(f"{expect.destination.pod} -> {expect.holders[0].end.pod} {expect.protocol} at "
                            f"{point}: expected {_fmt(want)}, found {_fmt(got)}")
    for (direction, name, point), (packets, size) in sorted(sums.items()):
        if name not in holders:
            problems.append(f"{packets} pkts {size} B of {expect.holders[0].end.ip}:{expect.holders[0].end.port} "
                            f"({direction}, {point}) are named {name}, which did not send them "
                            f"(senders: {', '.join(holders)})")
    for direction, wanted in (("forward", expect.forward_flags), ("reverse", expect.reverse_flags)):
        missing = sorted(wanted - flags[direction])
        if missing:
            problems.append(f"{direction} TCP flags {sorted(flags[direction])} lack {', '.join(missing)}")
    if not seen:
        problems.append(f"no flow record of {_key_text(forward)} or its reverse")
    return {
        "ok": not problems,
        "problems": problems,
        "records": seen,
        "expected": {
            "forward": {h.end.pod: {p: list(h.sent.get(p, (0, 0))) for p in POINTS} for h in expect.holders},
            "reverse": {p: list(expect.reverse.get(p, (0, 0))) for p in POINTS},
            "flags": {"forward": sorted(expect.forward_flags), "reverse": sorted(expect.reverse_flags)},
        },
        "found": {
            "forward": _by_name(sums, "forward"),
            "reverse": _by_name(sums, "reverse"),
            "flags": {d: sorted(f) for d, f in flags.items()},
        },
    }


def _by_name(sums: Mapping[tuple[str, str, str], list[int]], direction: str) -> dict[str, dict[str, list[int]]]:
    out: dict[str, dict[str, list[int]]] = {}
    for (d, name, point), total in sorted(sums.items()):
        if d == direction:
            out.setdefault(name, {})[point] = list(total)
    return out


def _key_text(key: FlowKey) -> str:
    protocol, sip, sport, dip, dport = key
    return f"{protocol} {sip}:{sport} -> {dip}:{dport}"


def of_key(records: Iterable[Record], key: FlowKey) -> list[Record]:
    """The records of one exchange: its key and the reverse."""
    keys = (key, reverse_key(key))
    return [r for r in records if key_of(r) in keys]


# --- the whole run -------------------------------------------------------------------------------------


def misnamed(records: Iterable[Record], held: Mapping[str, set[str]]) -> list[tuple[str, str]]:
    """(ip, detail) for every end named by a pod the lab never saw hold that address (``held``: IP ->
    ``namespace/name`` of every pod seen with it)."""
    found: dict[tuple[str, str], list[int]] = {}
    for record in records:
        for role in ("source", "destination"):
            end = record[role]
            if end.get("service"):
                continue  # a Service's frontend, named by its backend: the services step checks those
            name = end_name(end)
            if name != WORLD and name not in held.get(str(end["ip"]), set()):
                total = found.setdefault((str(end["ip"]), name), [0, 0])
                total[0] += 1
                total[1] += int(record.get("packets", 0))
    return [(ip, f"{count} flow records ({packets} pkts) name {ip} {name}, a pod the lab never saw hold it "
                 f"(holders seen: {', '.join(sorted(held.get(ip, set()))) or 'none'})")
            for (ip, name), (count, packets) in sorted(found.items())]


def aggregate(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The records added up per flow (key, and the names of both ends: an address reused during a flow
    gives one row per holder), for the report: packets and bytes at each point, the flags seen."""
    rows: dict[tuple[FlowKey, str, str], dict[str, Any]] = {}
    for record in records:
        source, destination = record["source"], record["destination"]
        key = key_of(record)
        row = rows.get((key, end_name(source), end_name(destination)))
        if row is None:
            row = rows[(key, end_name(source), end_name(destination))] = {
                "protocol": key[0],
                "source": {"ip": key[1], "port": key[2], "pod": end_name(source), "workload": workload_name(source)},
                "destination": {"ip": key[3], "port": key[4], "pod": end_name(destination),
                                "workload": workload_name(destination)},
                FROM_POD: [0, 0], TO_POD: [0, 0], "tcp_flags": [],
            }
        point = row.get(str(record.get("observation")))
        if isinstance(point, list):
            point[0] += int(record.get("packets", 0))
            point[1] += int(record.get("bytes", 0))
        row["tcp_flags"] = sorted(set(row["tcp_flags"]) | set(record.get("tcp_flags") or ()))
    return list(rows.values())


def counted_bytes(flow: Mapping[str, Any]) -> int:
    """A flow's bytes counted once, where the workload series count them: leaving a pod of the node, or
    entering one when it came from elsewhere (docs/flows.md)."""
    out, into = flow[FROM_POD], flow[TO_POD]
    return int(out[1]) if out[0] else int(into[1])


def pair_of(record: Mapping[str, Any]) -> Pair:
    """The labels of the record's ``podmeter_workload_flow_bytes_total`` series."""
    s, d = record["source"], record["destination"]

    def end(e: Mapping[str, Any]) -> tuple[str, str, str]:
        if e.get("world") or e.get("workload") is None:
            return "", "", WORLD
        return str(e.get("namespace") or ""), str(e.get("workload_kind") or ""), str(e.get("workload"))

    return (*end(s), *end(d), str(record["protocol"]))


def series_bytes(records: Iterable[Record]) -> dict[Pair, int]:
    """What each workload pair's series must have grown by: a local source's packets at ``from-pod``
    (a packet between two pods of the node is counted where it leaves), others at ``to-pod``."""
    local = {key_of(r) for r in records if r.get("observation") == FROM_POD}
    out: dict[Pair, int] = {}
    for record in records:
        point = record.get("observation")
        if point == FROM_POD or (point == TO_POD and key_of(record) not in local):
            pair = pair_of(record)
            out[pair] = out.get(pair, 0) + int(record.get("bytes", 0))
    return out


_PAIR_LABELS = ("source_namespace", "source_workload_kind", "source_workload", "destination_namespace",
                "destination_workload_kind", "destination_workload", "protocol")


def series_values(samples: Samples, pairs: Iterable[Pair]) -> dict[Pair, float]:
    """The current value of each pair's bytes series (0 when absent) in the agent's parsed /metrics."""
    out: dict[Pair, float] = {}
    for pair in pairs:
        labels = dict(zip(_PAIR_LABELS, pair, strict=True))
        out[pair] = metric_sum(samples, "podmeter_workload_flow_bytes_total", **labels) or 0.0
    return out


def check_series(expected: Mapping[Pair, int], before: Mapping[Pair, float],
                 after: Mapping[Pair, float]) -> list[str]:
    """The agent's workload-pair series must have grown by exactly the records' bytes."""
    problems = []
    for pair, want in sorted(expected.items()):
        got = after.get(pair, 0.0) - before.get(pair, 0.0)
        if got != want:
            src = f"{pair[1]} {pair[0]}/{pair[2]}" if pair[0] else pair[2]
            dst = f"{pair[4]} {pair[3]}/{pair[5]}" if pair[3] else pair[5]
            problems.append(f"podmeter_workload_flow_bytes_total {src} -> {dst} {pair[6]} grew by {got:.0f}, "
                            f"the records say {want}")
    return problems


# --- the agent's endpoints -------------------------------------------------------------------------------


class FlowClient:
    """The agent's ``/debug/flows`` and the drain counter of its ``/metrics``."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")

    def records(self, since: float | None = None, **filters: str | int) -> list[Record] | None:
        """Every record the agent still has that matches (``since``: wall-clock seconds); None: no answer."""
        params: dict[str, str] = {"last": "1000000", **{k: str(v) for k, v in filters.items()}}
        if since is not None:
            params["since"] = f"{since:.6f}"
        text = http_text(f"{self.base}/debug/flows?{urllib.parse.urlencode(params)}", timeout=10.0)
        if text is None:
            return None
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def metrics(self) -> Samples:
        return parse_metrics(http_text(f"{self.base}/metrics"))

    def drains(self) -> float | None:
        return metric_sum(self.metrics(), "podmeter_flow_drains_total")

    def wait_for_drains(self, after: float | None, count: int, deadline: float) -> bool:
        """Until the agent finished ``count`` more drains than ``after`` (so one began after every packet
        of the exchange was counted), or ``deadline`` (monotonic); whether it did."""
        if after is None:
            after = self.drains()
        while True:
            now = self.drains()
            if after is not None and now is not None and now >= after + count:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
