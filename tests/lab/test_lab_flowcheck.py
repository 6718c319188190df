"""The lab's flow check against fake records: right ones pass, and each kind of wrong one fails, saying what
was expected and what was found (a flow named by the wrong pod, a missing SYN, packets missing at one
observation point, an IP reused during a flow credited to the next holder, a pod named for an IP it never
held). No root, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from podmeter.lab.checks import parse_metrics
from podmeter.lab.flowcheck import (
    FROM_POD,
    TO_POD,
    Expectation,
    Holder,
    PodEnd,
    aggregate,
    check_flow,
    check_series,
    counted_bytes,
    misnamed,
    series_bytes,
    series_values,
)

A = PodEnd("web/frontend-1", "10.244.0.1", 40000, "Deployment web/frontend")
B = PodEnd("web/api-2", "10.244.0.2", 5201, "Deployment web/api")
T0 = 1_000.0


def _end(end: PodEnd | None, ip: str, port: int) -> dict[str, Any]:
    if end is None:
        return {"ip": ip, "port": port, "namespace": None, "pod": None, "workload": None, "workload_kind": None,
                "node": None, "identity": None, "world": True}
    namespace, _, pod = end.pod.partition("/")
    assert end.workload is not None
    kind, _, workload = end.workload.partition(" ")
    return {"ip": ip, "port": port, "namespace": namespace, "pod": pod, "workload": workload.partition("/")[2],
            "workload_kind": kind, "node": "lab-node", "identity": None, "world": False}


def record(src: PodEnd | None, dst: PodEnd | None, point: str, packets: int, size: int, *, protocol: str = "UDP",
           flags: tuple[str, ...] = (), key: tuple[str, int, str, int] | None = None, first: float = T0 + 0.1,
           last: float = T0 + 0.2) -> dict[str, Any]:
    """One /debug/flows line. ``key`` overrides the addresses (a name on someone else's address)."""
    sip, sport, dip, dport = key or (src.ip if src else "0.0.0.0", src.port if src else 0,
                                     dst.ip if dst else "0.0.0.0", dst.port if dst else 0)
    return {"time": last, "first": first, "node": "lab-node", "source": _end(src, sip, sport),
            "destination": _end(dst, dip, dport), "protocol": protocol, "observation": point, "packets": packets,
            "bytes": size, "tcp_flags": list(flags), "verdict": "forwarded"}


UDP_WANT = {FROM_POD: (50, 12_100), TO_POD: (50, 12_100)}


def udp_expectation() -> Expectation:
    return Expectation("UDP", [Holder(A, UDP_WANT, (T0, T0 + 1))], B, node="lab-node")


def test_exact_udp_records_pass_also_split_across_drains() -> None:
    records = [record(A, B, FROM_POD, 30, 7_260), record(A, B, FROM_POD, 20, 4_840),  # two drains
               record(A, B, TO_POD, 50, 12_100)]
    verdict = check_flow(udp_expectation(), records)
    assert verdict["ok"], verdict["problems"]
    assert verdict["found"]["forward"] == {"web/frontend-1": {FROM_POD: [50, 12_100], TO_POD: [50, 12_100]}}


def test_a_flow_named_by_the_wrong_pod_fails_and_says_who() -> None:
    impostor = PodEnd("web/frontend-9", A.ip, A.port, "Deployment web/frontend")
    records = [record(impostor, B, FROM_POD, 50, 12_100), record(A, B, TO_POD, 50, 12_100)]
    verdict = check_flow(udp_expectation(), records)
    assert not verdict["ok"]
    assert ("web/frontend-1 -> web/api-2 UDP at from-pod: expected 50 pkts 12100 B, found 0 pkts 0 B"
            in verdict["problems"])
    assert any("are named web/frontend-9, which did not send them" in p for p in verdict["problems"])
    assert verdict["found"]["forward"]["web/frontend-9"] == {FROM_POD: [50, 12_100]}


def test_a_destination_named_world_or_the_wrong_workload_fails() -> None:
    records = [record(A, None, FROM_POD, 50, 12_100, key=(A.ip, A.port, B.ip, B.port)),
               record(A, B, TO_POD, 50, 12_100)]
    problems = check_flow(udp_expectation(), records)["problems"]
    assert problems == ["a forward from-pod record (50 pkts) names 10.244.0.2 world, not web/api-2"]
    wrong_kind = PodEnd(A.pod, A.ip, A.port, "Pod web/frontend-1")
    records = [record(wrong_kind, B, FROM_POD, 50, 12_100), record(A, B, TO_POD, 50, 12_100)]
    assert check_flow(udp_expectation(), records)["problems"] == [
        "web/frontend-1 is named workload Pod web/frontend-1, not Deployment web/frontend"]


def test_packets_missing_at_one_observation_point_fail() -> None:
    records = [record(A, B, FROM_POD, 50, 12_100), record(A, B, TO_POD, 49, 11_858)]
    verdict = check_flow(udp_expectation(), records)
    assert verdict["problems"] == [
        "web/frontend-1 -> web/api-2 UDP at to-pod: expected 50 pkts 12100 B, found 49 pkts 11858 B"]
    assert verdict["expected"]["forward"]["web/frontend-1"][TO_POD] == [50, 12_100]


def test_no_records_at_all_fail() -> None:
    verdict = check_flow(udp_expectation(), [])
    assert not verdict["ok"] and verdict["records"] == 0
    assert "no flow record of UDP 10.244.0.1:40000 -> 10.244.0.2:5201 or its reverse" in verdict["problems"]


def test_an_unexpected_reverse_flow_fails() -> None:
    records = [record(A, B, FROM_POD, 50, 12_100), record(A, B, TO_POD, 50, 12_100),
               record(B, A, FROM_POD, 1, 70)]
    assert check_flow(udp_expectation(), records)["problems"] == [
        "web/api-2 -> web/frontend-1 UDP at from-pod: expected 0 pkts 0 B, found 1 pkts 70 B"]


def _tcp(forward_flags: tuple[tuple[str, ...], ...], reverse_flags: tuple[str, ...]) -> dict[str, Any]:
    records = []
    for i, flags in enumerate(forward_flags):  # one record per drain, each point
        records += [record(A, B, point, 10, 5_000, protocol="TCP", flags=flags, first=T0 + i, last=T0 + i + 0.5)
                    for point in (FROM_POD, TO_POD)]
    records += [record(B, A, point, 6, 400, protocol="TCP", flags=reverse_flags) for point in (FROM_POD, TO_POD)]
    expect = Expectation("TCP", [Holder(A, {p: (10 * len(forward_flags), 5_000 * len(forward_flags))
                                            for p in (FROM_POD, TO_POD)}, (T0, T0 + 10))], B,
                         {FROM_POD: (6, 400), TO_POD: (6, 400)}, forward_flags=frozenset({"SYN", "FIN"}),
                         reverse_flags=frozenset({"SYN", "FIN"}))
    return check_flow(expect, records)


def test_tcp_flags_are_ored_across_the_records_of_a_direction() -> None:
    verdict = _tcp((("SYN", "ACK"), ("ACK", "PSH"), ("ACK", "FIN")), ("SYN", "ACK", "FIN"))
    assert verdict["ok"], verdict["problems"]
    assert verdict["found"]["flags"]["forward"] == ["ACK", "FIN", "PSH", "SYN"]


def test_a_tcp_flow_without_its_syn_fails() -> None:
    verdict = _tcp((("ACK",), ("ACK", "PSH"), ("ACK", "FIN")), ("SYN", "ACK", "FIN"))
    assert verdict["problems"] == ["forward TCP flags ['ACK', 'FIN', 'PSH'] lack SYN"]
    assert verdict["expected"]["flags"]["forward"] == ["FIN", "SYN"]
    assert not _tcp((("SYN", "ACK"), ("ACK",)), ("SYN", "ACK"))["ok"]  # no FIN either way


# --- an IP reused during a flow ---------------------------------------------------------------------------

A2 = PodEnd("web/reuse-7", A.ip, A.port, "Pod web/reuse-7")  # A's IP and port, the next holder


def reuse_expectation() -> Expectation:
    want = {FROM_POD: (20, 6_840), TO_POD: (20, 6_840)}
    return Expectation("UDP", [Holder(A, want, (T0, T0 + 1)), Holder(A2, want, (T0 + 3, T0 + 4))], B)


def test_a_reused_ip_each_holder_named_for_exactly_its_own_packets_passes() -> None:
    records = [record(h, B, point, 20, 6_840, first=t + 0.1, last=t + 0.5)
               for h, t in ((A, T0), (A2, T0 + 3)) for point in (FROM_POD, TO_POD)]
    verdict = check_flow(reuse_expectation(), records)
    assert verdict["ok"], verdict["problems"]
    assert set(verdict["found"]["forward"]) == {A.pod, A2.pod}


def test_the_old_holders_packets_credited_to_the_new_one_fail() -> None:
    # One entry spanning the reuse (no drain when the address changed hands), named by the new holder.
    records = [record(A2, B, point, 40, 13_680, first=T0 + 0.1, last=T0 + 3.5) for point in (FROM_POD, TO_POD)]
    problems = check_flow(reuse_expectation(), records)["problems"]
    assert ("web/frontend-1 -> web/api-2 UDP at from-pod: expected 20 pkts 6840 B, found 0 pkts 0 B" in problems)
    assert ("web/reuse-7 -> web/api-2 UDP at from-pod: expected 20 pkts 6840 B, found 40 pkts 13680 B" in problems)
    assert any("named web/reuse-7 has packets from -2.90 s" in p and "another holder of 10.244.0.1" in p
               for p in problems)


def test_a_record_outside_its_holders_time_fails_even_with_the_right_counts() -> None:
    # A's packets named A, but stamped after A was gone: the window check catches what the sums cannot.
    records = [record(A, B, point, 20, 6_840, first=T0 + 3.1, last=T0 + 3.5) for point in (FROM_POD, TO_POD)]
    records += [record(A2, B, point, 20, 6_840, first=T0 + 3.1, last=T0 + 3.5) for point in (FROM_POD, TO_POD)]
    problems = check_flow(reuse_expectation(), records)["problems"]
    assert len(problems) == 2 and all("named web/frontend-1 has packets from +3.10 s" in p for p in problems)


# --- the whole run, the report's numbers, the series ------------------------------------------------------


def test_misnamed_names_a_pod_for_an_ip_it_never_held() -> None:
    held = {A.ip: {A.pod}, B.ip: {B.pod}}
    good = [record(A, B, FROM_POD, 5, 500)]
    assert misnamed(good, held) == []
    stolen = PodEnd("web/api-2", A.ip, A.port, "Deployment web/api")  # B's name on A's address
    [(ip, detail)] = misnamed([*good, record(stolen, B, FROM_POD, 7, 700)], held)
    assert ip == A.ip
    assert detail == ("1 flow records (7 pkts) name 10.244.0.1 web/api-2, a pod the lab never saw hold it "
                      "(holders seen: web/frontend-1)")


def test_aggregate_adds_up_per_flow_and_holder_and_counts_bytes_once() -> None:
    records = [record(A, B, FROM_POD, 30, 7_260), record(A, B, FROM_POD, 20, 4_840), record(A, B, TO_POD, 50, 12_100),
               record(A2, B, FROM_POD, 1, 100)]
    rows = aggregate(records)
    assert len(rows) == 2
    first = next(r for r in rows if r["source"]["pod"] == A.pod)
    assert first[FROM_POD] == [50, 12_100] and first[TO_POD] == [50, 12_100]
    assert first["source"]["workload"] == "Deployment web/frontend" and counted_bytes(first) == 12_100


@pytest.mark.parametrize(("grown", "ok"), [(12_100, True), (24_200, False)])
def test_the_workload_series_must_grow_by_the_records_bytes(grown: int, ok: bool) -> None:
    records = [record(A, B, FROM_POD, 50, 12_100), record(A, B, TO_POD, 50, 12_100)]
    expected = series_bytes(records)
    pair = ("web", "Deployment", "frontend", "web", "Deployment", "api", "UDP")
    assert expected == {pair: 12_100}  # the packet counted once, where it left the pod

    def metrics(value: int) -> Any:
        labels = ",".join(f'{k}="{v}"' for k, v in zip(
            ("source_namespace", "source_workload_kind", "source_workload", "destination_namespace",
             "destination_workload_kind", "destination_workload", "protocol"), pair, strict=True))
        return parse_metrics(f"# TYPE podmeter_workload_flow_bytes counter\n"
                             f"podmeter_workload_flow_bytes_total{{{labels}}} {value}\n")

    before, after = series_values(metrics(100), expected), series_values(metrics(100 + grown), expected)
    problems = check_series(expected, before, after)
    assert (problems == []) is ok
    if not ok:
        assert problems == ["podmeter_workload_flow_bytes_total Deployment web/frontend -> Deployment web/api UDP "
                            "grew by 24200, the records say 12100"]
