"""The multi-node lab's checks fail when they should (no root, no process): an endpoint cache that is
stale or incomplete (I7), and flows across nodes that the two agents name wrongly or drained in the wrong
place; plus the scenario rules for several nodes."""

from __future__ import annotations

from typing import Any

import pytest

from podmeter.lab.cluster import Placed, _pairs
from podmeter.lab.endpointcheck import (
    cache_of,
    check_cross_flow,
    endpoint_violations,
    expected_cache,
    identities_by_uid,
    node_matrix,
)
from podmeter.lab.flowcheck import FROM_POD, TO_POD, Expectation, Holder, PodEnd
from podmeter.lab.scenario import ScenarioError, load_scenario, parse_scenario
from podmeter.lab.traffic import Endpoint
from podmeter.model.records import Pod

UDP = 20 * (300 + 42)


def pod(name: str, ip: str, node: str, app: str = "web", phase: str = "Running") -> Pod:
    return Pod(uid=f"uid-{name}", namespace="shop", name=name, node_name=node, ips=(ip,), host_network=False,
               phase=phase, deleting=False, observe=True, labels=("app", app), resource_version="1")


HELD = [{"id": 300, "namespace": "shop", "labels": {"app": "web"}},
        {"id": 301, "namespace": "shop", "labels": {"app": "db"}}]


def test_the_expected_cache_is_every_pod_with_an_address_and_an_identity() -> None:
    pods = [pod("a", "10.1.0.1", "n0"), pod("b", "10.1.1.1", "n1", app="db"),
            pod("done", "10.1.0.2", "n0", phase="Succeeded"), pod("new", "10.1.0.3", "n0", app="cache")]
    ids = identities_by_uid(pods, HELD)
    assert ids == {"uid-a": 300, "uid-b": 301}
    assert expected_cache(pods, ids) == {"10.1.0.1": ("shop", "a", 300), "10.1.1.1": ("shop", "b", 301)}


def test_a_stale_or_missing_entry_is_an_i7_violation_named_by_its_ip() -> None:
    expected = {"10.1.0.1": ("shop", "a", 300), "10.1.0.2": ("shop", "b2", 301), "10.1.0.3": ("shop", "c", 300)}
    cache = cache_of({"endpoints": {
        "10.1.0.1": {"namespace": "shop", "pod": "a", "identity": 300},
        "10.1.0.2": {"namespace": "shop", "pod": "b", "identity": 301},  # the IP's previous holder: reused
        "10.1.0.9": {"namespace": "shop", "pod": "gone", "identity": 300},  # a deleted pod that stayed
    }})
    found = endpoint_violations("lab-2", expected, cache)
    assert [(inv, ip) for inv, ip, _ in found] == [("I7", "10.1.0.2"), ("I7", "10.1.0.3"), ("I7", "10.1.0.9")]
    details = {ip: detail for _, ip, detail in found}
    assert details["10.1.0.2"] == ("stale: the agent of lab-2 names 10.1.0.2 shop/b (identity 301); the API server "
                                   "and the operator say shop/b2 (identity 301)")
    assert details["10.1.0.3"] == ("missing: the agent of lab-2 does not name 10.1.0.3 shop/c (identity 300); the API "
                                   "server and the operator do")
    assert details["10.1.0.9"].startswith("stale: the agent of lab-2 names 10.1.0.9 shop/gone (identity 300); no pod")
    assert endpoint_violations("lab-0", expected, dict(expected)) == []


def test_a_wrong_identity_is_stale_too() -> None:
    found = endpoint_violations("n", {"10.1.0.1": ("shop", "a", 300)}, {"10.1.0.1": ("shop", "a", 299)})
    assert [d.partition(";")[0] for _, _, d in found] == ["stale: the agent of n names 10.1.0.1 shop/a (identity 299)"]


# --- a flow across two nodes ------------------------------------------------------------------------------

SRC = PodEnd("shop/a", "10.1.0.1", 40000, "Pod shop/a")
DST = PodEnd("shop/b", "10.1.1.1", 5201, "Pod shop/b")
NODES = {"shop/a": "n0", "shop/b": "n1"}
EXPECT = Expectation("UDP", [Holder(SRC, {FROM_POD: (20, UDP), TO_POD: (20, UDP)}, None)], DST)


def end(e: PodEnd, node: str, identity: int | None) -> dict[str, Any]:
    ns, name = e.pod.split("/")
    return {"ip": e.ip, "port": e.port, "namespace": ns, "pod": name, "workload": name, "workload_kind": "Pod",
            "node": node, "identity": identity, "world": False}


def record(point: str, drained_by: str, *, src_id: int | None = 300, dst_id: int | None = 301,
           src_node: str = "n0", dst_node: str = "n1") -> dict[str, Any]:
    return {"protocol": "UDP", "observation": point, "node": drained_by, "packets": 20, "bytes": UDP,
            "source": end(SRC, src_node, src_id), "destination": end(DST, dst_node, dst_id), "tcp_flags": []}


def test_a_flow_named_on_both_ends_by_both_agents_passes() -> None:
    verdict = check_cross_flow(EXPECT, {"n0": [record(FROM_POD, "n0")], "n1": [record(TO_POD, "n1")]}, NODES,
                               {"shop/a": 300, "shop/b": 301})
    assert verdict["ok"], verdict["problems"]
    assert verdict["identities"] == {"shop/a": {"n0": [300], "n1": [300]}, "shop/b": {"n0": [301], "n1": [301]}}


@pytest.mark.parametrize(("by_node", "problem"), [
    ({"n0": [record(FROM_POD, "n0")], "n1": []}, "the agent of n1 has no record of shop/a -> shop/b"),
    ({"n0": [record(FROM_POD, "n0"), record(TO_POD, "n0")], "n1": []},
     "a forward to-pod record drained by 'n0' (from the agent of n0): only n1's agent sees the packets enter"),
    ({"n0": [record(FROM_POD, "n0")], "n1": [record(TO_POD, "n1", src_id=299)]},
     "the agents disagree on the identity of shop/a (n0: 300, n1: 299)"),
    ({"n0": [record(FROM_POD, "n0", dst_id=None)], "n1": [record(TO_POD, "n1")]},
     "shop/b is named without an identity (n0: None, n1: 301)"),
    ({"n0": [record(FROM_POD, "n0", src_id=7)], "n1": [record(TO_POD, "n1", src_id=7)]},
     "shop/a is named with identity n0: 7, n1: 7, the operator holds 300"),
    ({"n0": [record(FROM_POD, "n0", dst_node="n0")], "n1": [record(TO_POD, "n1")]},
     "the agent of n0 places shop/b on node 'n0', not n1"),
])
def test_a_flow_across_nodes_fails_on_what_two_agents_can_get_wrong(by_node: dict[str, Any], problem: str) -> None:
    verdict = check_cross_flow(EXPECT, by_node, NODES, {"shop/a": 300, "shop/b": 301})
    assert not verdict["ok"]
    assert any(p.startswith(problem) for p in verdict["problems"]), verdict["problems"]


def test_a_stale_name_at_the_far_end_fails_the_flow_check() -> None:
    """The destination's agent still calls 10.1.1.1 by its previous holder (a stale cache on n0)."""
    stale = record(FROM_POD, "n0")
    stale["destination"] = {**stale["destination"], "pod": "old-b", "workload": "old-b"}
    verdict = check_cross_flow(EXPECT, {"n0": [stale], "n1": [record(TO_POD, "n1")]}, NODES,
                               {"shop/a": 300, "shop/b": 301})
    assert not verdict["ok"]
    assert any("names 10.1.1.1 shop/old-b, not shop/b" in p for p in verdict["problems"]), verdict["problems"]


def test_the_node_matrix_counts_each_packet_once_where_it_left_a_pod() -> None:
    cells = node_matrix([record(FROM_POD, "n0"), record(TO_POD, "n1")])
    assert cells == {("n0", "n1"): [20, UDP, 1]}


def test_pairs_across_nodes_go_round_the_ring() -> None:
    import random

    ends = [Placed(Endpoint(f"shop/p{i}", f"10.0.{i}.1", ""), f"n{i % 3}") for i in range(6)]
    pairs = _pairs(ends, ["n0", "n1", "n2"], 6, True, random.Random(1))
    assert [(a.node, b.node) for a, b in pairs] == [("n0", "n1"), ("n1", "n2"), ("n2", "n0"), ("n0", "n2"),
                                                    ("n1", "n0"), ("n2", "n1")]
    local = _pairs(ends, ["n0", "n1", "n2"], 5, False, random.Random(1))
    assert len(local) == 3 and all(a.node == b.node and a.pod != b.pod for a, b in local)


# --- scenarios with several nodes ------------------------------------------------------------------------


def test_the_shipped_cluster_scenario_has_three_nodes() -> None:
    scenario = load_scenario("cluster")
    assert [n.name for n in scenario.nodes] == ["lab-0", "lab-1", "lab-2"]
    kinds = {s.__struct_config__.tag for s in scenario.steps}
    assert {"kill-agent", "kill-operator", "churn", "traffic"} <= kinds


@pytest.mark.parametrize(("text", "message"), [
    ("nodes: [{name: a, pod_cidr: 10.1.0.0/24}, {name: b, pod_cidr: 10.1.0.128/25}]",
     "$.nodes[1].pod_cidr: 10.1.0.128/25 overlaps $.nodes[0].pod_cidr 10.1.0.0/24"),
    ("nodes: [{name: a, pod_cidr: 10.1.0.0/24}, {name: a, pod_cidr: 10.2.0.0/24}]",
     "$.nodes[1].name: 'a' is declared twice"),
    ("nodes: [{name: a, pod_cidr: 192.168.255.0/28}]", "overlaps the nodes' own network 192.168.255.0/24"),
    ("nodes: [{name: a}]\nsteps: [{at: 1, do: kill-agent, node: b}]",
     "$.steps[0].node: 'b' is not declared under nodes (declared: a)"),
    ("steps: [{at: 1, do: kill-operator}]", "$.steps[0]: kill-operator needs a multi-node scenario"),
    ("nodes: [{name: a}]\nnamespaces: [{name: w}]\nsteps: [{at: 1, do: traffic, namespace: w, across_nodes: true}]",
     "$.steps[0].across_nodes: needs at least two nodes"),
    ("nodes: [{name: a, agent_fault: melt}]", "$.nodes[0].agent_fault"),
])
def test_bad_node_lists_are_refused_with_the_field(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(f"name: t\nduration: 5\n{text}")
    assert message in str(info.value)
