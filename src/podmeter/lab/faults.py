"""Test-only faults planted in a real agent process, to show that the lab's checks can fail.

``drop-deletes``: the agent ignores every pod DELETE its watch delivers (the pod stays in its store, so
its IP stays in the kernel filter): failure modes F1, F2 and F7 of docs/design.md. Relists still work,
as in the agents that had this bug; the lab's scenario for it avoids relists.

``stale-endpoints``: the agent's cluster-wide endpoint cache never forgets an IP: when a PodSlice drops an
endpoint (its pod deleted, or moved to another slice) the IP keeps naming the old pod until another
endpoint claims it. Entries of deleted pods that stay are the leak of the identity caches of the field;
the multi-node lab's I7 check must fail on it, naming the IPs (tests/lab/test_lab_cluster.py).

The fault is installed by ``python -m podmeter.cli.lab --faulty-agent KIND agent ...`` before the agent
starts; the product itself has no switch for it.
"""

from __future__ import annotations

from typing import Final

from podmeter.model.deltas import PODS, Delete
from podmeter.model.endpoint_slices import ClusterEndpoints, PodSlice
from podmeter.model.view import HandedOver, NodeView, ViewDelta

FAULTS: Final = ("drop-deletes", "stale-endpoints")


def install(kind: str) -> None:
    if kind not in FAULTS:
        raise ValueError(f"unknown agent fault {kind!r} (known: {', '.join(FAULTS)})")
    if kind == "stale-endpoints":
        _keep_dropped_endpoints()
        return

    apply = NodeView.apply

    def drop_pod_deletes(self: NodeView, delta: ViewDelta, handed_over: HandedOver = lambda ip: None) -> int:
        if isinstance(delta, Delete) and delta.collection is PODS:
            return 0  # the seeded bug: a pod's delete is lost, its IPs stay desired
        return apply(self, delta, handed_over)

    NodeView.apply = drop_pod_deletes  # type: ignore[method-assign]


def _keep_dropped_endpoints() -> None:
    changed = ClusterEndpoints.changed

    def keep(self: ClusterEndpoints, old: PodSlice | None, new: PodSlice | None) -> None:
        before = dict(self._by_ip)
        changed(self, old, new)
        for packed, owner in before.items():
            self._by_ip.setdefault(packed, owner)  # the seeded bug: what a slice dropped stays named

    ClusterEndpoints.changed = keep  # type: ignore[method-assign]
