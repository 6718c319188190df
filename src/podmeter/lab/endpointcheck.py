"""The multi-node lab's cluster-wide checks: each agent's endpoint cache (I7), and flows seen by two agents.

**I7, on every node.** Truth is the API server's pods (every pod that holds an address, whatever its node)
and the identities the operator holds for their label sets (its ``/debug/identities``): IP -> (namespace,
pod, identity), computed with the model's own rule (:func:`podmeter.model.endpoint_slices.expected_endpoints`),
never from the PodSlices, which are what is under test (the operator's publication and the agents'
consumption together). Each agent's cache is its ``GET /debug/endpoints``. An IP the cache names for the
wrong pod or identity, or for nobody the API server knows, is **stale**; one it lacks is **missing**; the
subject of the violation is the IP. Like every violation, one that outlives the settle time fails the run.

**Flows across nodes.** A packet from pod A on node X to pod B on node Y is seen twice, by two agents: X's
records it ``from-pod`` (leaving A's veth), Y's ``to-pod`` (entering B's); the reverse direction the other
way round. :func:`check_cross_flow` adds both agents' records of the exchange and checks them with
:func:`podmeter.lab.flowcheck.check_flow` (names, workloads, exact packets and bytes at both points, flags),
then what only two agents can get wrong: each point's records come from the agent of the right node, both
agents place each end on its node, and name it with the same identity, the operator's.

Pure functions over what the endpoints print (dicts), so tests can feed wrong ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from podmeter.lab.flowcheck import FROM_POD, TO_POD, WORLD, Expectation, Record, check_flow, end_name, key_of
from podmeter.model.endpoint_slices import expected_endpoints
from podmeter.model.identity import LabelFilter, key_of_flat
from podmeter.model.interest import holds_identity
from podmeter.model.records import Pod

Named = tuple[str, str, int | None]  # namespace, pod, identity (None: the cache has none for it)


# --- I7: the endpoint caches ---------------------------------------------------------------------------


def identities_by_uid(pods: Iterable[Pod], held: Sequence[Mapping[str, Any]],
                      label_filter: LabelFilter | None = None) -> dict[str, int]:
    """UID -> the identity the operator holds for the pod's label set. ``held``: the ``identities`` of the
    operator's ``/debug/identities`` (``id``, ``namespace``, ``labels``)."""
    label_filter = label_filter or LabelFilter()
    ids = {(str(d["namespace"]), tuple(sorted(dict(d["labels"]).items()))): int(d["id"])
           for d in held if d.get("id") is not None}
    out: dict[str, int] = {}
    for pod in pods:
        if holds_identity(pod):
            key = key_of_flat(pod.namespace, pod.labels, label_filter)
            found = ids.get((key.namespace, tuple(sorted(key.label_dict().items()))))
            if found is not None:
                out[pod.uid] = found
    return out


def expected_cache(pods: Iterable[Pod], identities: Mapping[str, int]) -> dict[str, Named]:
    """IP -> (namespace, pod, identity) every agent's cache must hold."""
    return {ip: (ns, name, ident) for ip, (ns, name, ident) in expected_endpoints(pods, identities).items()}


def cache_of(debug_endpoints: Mapping[str, Any]) -> dict[str, Named]:
    """An agent's ``/debug/endpoints`` as IP -> (namespace, pod, identity)."""
    return {ip: (str(e.get("namespace")), str(e.get("pod")), e.get("identity"))
            for ip, e in (debug_endpoints.get("endpoints") or {}).items()}


def _ip_order(ip: str) -> tuple[int, int | str]:
    try:
        return 0, int(ipaddress.ip_address(ip))
    except ValueError:
        return 1, ip


def _named(n: Named) -> str:
    return f"{n[0]}/{n[1]} (identity {n[2]})"


def endpoint_violations(node: str, expected: Mapping[str, Named],
                        cache: Mapping[str, Named]) -> list[tuple[str, str, str]]:
    """I7 for one agent: (invariant, IP, detail) for every IP its cache names wrongly or lacks. The detail
    before its first ``;`` is what the cache holds wrongly (a violation's identity across samples), after it
    what the API server says now."""
    found: list[tuple[str, str, str]] = []
    for ip in sorted(expected.keys() | cache.keys(), key=_ip_order):
        want, got = expected.get(ip), cache.get(ip)
        if want == got:
            continue
        if got is None:
            assert want is not None
            found.append(("I7", ip, f"missing: the agent of {node} does not name {ip} {_named(want)}; the API "
                                    "server and the operator do"))
        elif want is None:
            found.append(("I7", ip, f"stale: the agent of {node} names {ip} {_named(got)}; no pod with an "
                                    f"identity holds {ip} now"))
        else:
            found.append(("I7", ip, f"stale: the agent of {node} names {ip} {_named(got)}; the API server "
                                    f"and the operator say {_named(want)}"))
    return found


# --- flows seen by two agents ----------------------------------------------------------------------------


def _drainer(direction: str, point: str, source_node: str, destination_node: str) -> str:
    """The node whose agent must have drained the records of one direction at one point: ``from-pod`` is
    seen where the packet left a pod, ``to-pod`` where it entered one."""
    leaving, entering = (source_node, destination_node) if direction == "forward" else (destination_node, source_node)
    return leaving if point == FROM_POD else entering


def check_cross_flow(expect: Expectation, by_node: Mapping[str, Sequence[Record]], pod_nodes: Mapping[str, str],
                     identities: Mapping[str, int | None]) -> dict[str, Any]:
    """One exchange between pods of two nodes (or of one), against the records of every agent that has
    some (``by_node``: node -> that agent's records of the exchange's two keys). ``pod_nodes``: ``ns/name``
    -> the node the pod runs on; ``identities``: ``ns/name`` -> the identity the operator held for it when
    the exchange began (None: not known). The result is :func:`check_flow`'s, its problems extended, plus
    ``identities`` (pod -> node -> the identities its records carry) and ``records_by_node``."""
    union = [r for records in by_node.values() for r in records]
    verdict = check_flow(expect, union)
    problems: list[str] = verdict["problems"]
    source, destination = expect.holders[0].end.pod, expect.destination.pod
    source_node, destination_node = pod_nodes.get(source, "?"), pod_nodes.get(destination, "?")
    seen: dict[str, dict[str, set[int | None]]] = {}
    extra: list[str] = []
    for node, records in sorted(by_node.items()):
        for record in records:
            direction = "forward" if key_of(record) == expect.key else "reverse"
            point = str(record.get("observation"))
            want = _drainer(direction, point, source_node, destination_node)
            if node != want or record.get("node") != want:
                verb = "leave" if point == FROM_POD else "enter"
                extra.append(f"a {direction} {point} record drained by {record.get('node')!r} (from the agent of "
                             f"{node}): only {want}'s agent sees the packets {verb} a pod there")
            for role in ("source", "destination"):
                end = record[role]
                name = end_name(end)
                if name == WORLD:
                    continue  # check_flow names it
                placed, truth = end.get("node"), pod_nodes.get(name)
                if truth is not None and placed != truth:
                    extra.append(f"the agent of {node} places {name} on node {placed!r}, not {truth}")
                seen.setdefault(name, {}).setdefault(node, set()).add(end.get("identity"))
    for pod, per_node in sorted(seen.items()):
        values: set[int | None] = set().union(*per_node.values())
        text = ", ".join(f"{n}: {' '.join(str(i) for i in sorted(ids, key=str))}"
                         for n, ids in sorted(per_node.items()))
        if None in values:
            extra.append(f"{pod} is named without an identity ({text})")
        if len(values - {None}) > 1:
            extra.append(f"the agents disagree on the identity of {pod} ({text})")
        want_id = identities.get(pod)
        if want_id is not None and values - {None, want_id}:
            extra.append(f"{pod} is named with identity {text}, the operator holds {want_id}")
    for node in sorted({source_node, destination_node}):
        if not by_node.get(node):
            extra.append(f"the agent of {node} has no record of {source} -> {destination}")
    problems.extend(dict.fromkeys(extra))  # each problem once, in order
    verdict["ok"] = not problems
    verdict["identities"] = {pod: {n: sorted(ids, key=str) for n, ids in per.items()} for pod, per in seen.items()}
    verdict["records_by_node"] = {node: len(records) for node, records in sorted(by_node.items())}
    return verdict


def node_matrix(records: Iterable[Record]) -> dict[tuple[str, str], list[int]]:
    """(source node, destination node) -> [packets, bytes, flows] of the records (every agent's together),
    each packet counted once: where it left a pod (``from-pod``), or entering one when no agent saw it
    leave (a source outside the lab's nodes)."""
    records = list(records)
    left = {key_of(r) for r in records if r.get("observation") == FROM_POD}
    cells: dict[tuple[str, str], list[int]] = {}
    flows: dict[tuple[str, str], set[tuple[str, str, int, str, int]]] = {}
    for record in records:
        point = record.get("observation")
        if point != FROM_POD and not (point == TO_POD and key_of(record) not in left):
            continue
        ends = []
        for role in ("source", "destination"):
            end = record[role]
            ends.append(WORLD if end_name(end) == WORLD else str(end.get("node") or "?"))
        cell = (ends[0], ends[1])
        total = cells.setdefault(cell, [0, 0, 0])
        total[0] += int(record.get("packets", 0))
        total[1] += int(record.get("bytes", 0))
        flows.setdefault(cell, set()).add(key_of(record))
    for cell, keys in flows.items():
        cells[cell][2] = len(keys)
    return cells
