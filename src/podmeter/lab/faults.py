"""Test-only faults planted in a real agent process, to show that the lab's checks can fail.

``drop-deletes``: the agent ignores every pod DELETE its watch delivers (the pod stays in its store, so
its IP stays in the kernel filter): failure modes F1, F2 and F7 of docs/design.md. Relists still work,
as in the agents that had this bug; the lab's scenario for it avoids relists.

The fault is installed by ``python -m podmeter.cli.lab --faulty-agent KIND agent ...`` before the agent
starts; the product itself has no switch for it.
"""

from __future__ import annotations

from typing import Final

from podmeter.model.deltas import PODS, Delete
from podmeter.model.view import NodeView, ViewDelta

FAULTS: Final = ("drop-deletes",)


def install(kind: str) -> None:
    if kind not in FAULTS:
        raise ValueError(f"unknown agent fault {kind!r} (known: {', '.join(FAULTS)})")

    apply = NodeView.apply

    def drop_pod_deletes(self: NodeView, delta: ViewDelta) -> int:
        if isinstance(delta, Delete) and delta.collection is PODS:
            return 0  # the seeded bug: a pod's delete is lost, its IPs stay desired
        return apply(self, delta)

    NodeView.apply = drop_pod_deletes  # type: ignore[method-assign]
