"""The agent's core without the agent: a view, the writer and a datapath, driven with typed deltas.

Tests of the model and the writer read as stories ("a pod is upserted, its namespace loses the
annotation, the pod is deleted"); each step here is one delta handed to ``NodeView.apply``, exactly as
the agent's writer task hands the reflectors' deltas over, followed by explicit flushes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from podmeter.model.configuration import DEFAULT_NAME, Interest, MetricsConfiguration
from podmeter.model.datapath import Datapath
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Delete, Replace, Upsert
from podmeter.model.records import Namespace, Pod
from podmeter.model.view import NodeView, ViewDelta
from podmeter.runtime.writer import Pushed, Writer


class Core:
    """``view`` + ``writer`` over ``datapath``; store steps return whether anything changed, and keep in
    ``handed_over`` the addresses their delta handed over (``deltas`` counts the steps; the view's
    handover is taken at each step, as the agent takes it after each batch)."""

    def __init__(self, datapath: Datapath, node_name: str = "node-a", track_moves: bool = False) -> None:
        self.datapath = datapath
        self.view = NodeView(node_name, track_moves=track_moves, track_handovers=True)
        self.writer = Writer(self.view.desired, datapath)
        self.handed_over: set[str] = set()
        self.deltas = 0

    # --- store steps (one delta each) ---

    def apply(self, delta: ViewDelta) -> int:
        self.handed_over, self.deltas = set(), self.deltas + 1
        changed = self.view.apply(delta, self.handed_over.add)
        self.view.take_handover()
        return changed

    def upsert_pod(self, pod: Pod) -> bool:
        return self.apply(Upsert(PODS, pod)) > 0

    def delete_pod(self, uid: str) -> bool:
        return self.apply(Delete(PODS, uid)) > 0

    def replace_pods(self, pods: Iterable[Pod], keep: Iterable[str] = ()) -> int:
        return self.apply(Replace(PODS, list(pods), frozenset(keep)))

    def upsert_namespace(self, namespace: Namespace) -> bool:
        return self.apply(Upsert(NAMESPACES, namespace)) > 0

    def delete_namespace(self, name: str) -> bool:
        return self.apply(Delete(NAMESPACES, name)) > 0

    def replace_namespaces(self, namespaces: Iterable[Namespace]) -> int:
        return self.apply(Replace(NAMESPACES, list(namespaces)))

    def configure(self, interest: Interest | None) -> bool:
        """The ``default`` MetricsConfiguration now says ``interest`` (None: it was deleted)."""
        if interest is None:
            return self.apply(Delete(CONFIGURATIONS, DEFAULT_NAME)) > 0
        return self.apply(Upsert(CONFIGURATIONS, MetricsConfiguration(DEFAULT_NAME, "1", 1, interest))) > 0

    # --- the writer's steps ---

    def flush(self) -> Pushed:
        return self.writer.flush()

    def resync(self) -> Pushed:
        return self.writer.resync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)  # installed, pending, overflow, stats, blocked, dirty ...
