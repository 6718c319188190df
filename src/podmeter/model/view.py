"""The agent's view of its node: the stored objects and the desired filter derived from them.

This is the level-triggered core. The store mirrors the API server (pods by UID, namespaces by name, the
interest configuration); the desired filter is a pure function of the store, maintained incrementally:
each change re-evaluates only the pods it can affect (one pod; the pods of one namespace; all pods for a
configuration change) and :meth:`NodeView.recompute` rebuilds it from scratch for checks.

Nothing here depends on the history of events: a delete needs only the UID, a duplicate upsert of an
identical record is a no-op, and a relist (:meth:`NodeView.replace_pods`) turns vanished objects into
deletes and leaves unchanged ones alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TypeVar

from podmeter.model.compaction import PeakTracker
from podmeter.model.configuration import NO_CONFIGURATION, Interest
from podmeter.model.desired import DesiredFilter
from podmeter.model.interest import observed
from podmeter.model.records import Namespace, Pod

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplaceResult:
    """What a relist changed: objects added, updated (new resourceVersion) and deleted (vanished)."""

    added: int = 0
    updated: int = 0
    deleted: int = 0


class NodeView:
    """Stored pods and namespaces, the interest configuration, and the desired filter.

    Invariant: a stored pod holds exactly ``pod.ips`` in the desired filter iff it is observed under the
    current namespaces and interest, and holds nothing otherwise; so ``desired`` == :meth:`recompute`.

    No per-pod bookkeeping besides the store itself: whether a pod counted *before* a change is
    recomputed from the state before the change (the old record, the old namespace, the old interest),
    which is what keeps a stored pod under a kilobyte. The price: a namespace's annotation flip
    re-evaluates every stored pod (a scan of one node's pods, rare), not an index of that namespace.
    """

    def __init__(self, node_name: str | None = None, track_moves: bool = False) -> None:
        self.node_name = node_name
        self.pods: dict[str, Pod] = {}
        self.namespaces: dict[str, Namespace] = {}
        self.interest: Interest = NO_CONFIGURATION
        self.desired = DesiredFilter(track_moves)
        self._pods_peak = PeakTracker()

    # --- pods ---------------------------------------------------------------------------------

    def upsert_pod(self, pod: Pod) -> bool:
        """Store ``pod``; False (and no work) if an identical record is already stored."""
        old = self.pods.get(pod.uid)
        if old == pod:
            return False
        held = old.ips if old is not None and self.is_observed(old) else ()
        self.pods[pod.uid] = pod
        self._pods_peak.grew_to(len(self.pods))
        self.desired.move(pod.uid, held, pod.ips if self.is_observed(pod) else ())
        return True

    def delete_pod(self, uid: str) -> bool:
        """Forget the pod with ``uid``; False if it was not stored."""
        pod = self.pods.pop(uid, None)
        if pod is None:
            return False
        if self.is_observed(pod):
            self.desired.move(uid, pod.ips, ())
        if self._pods_peak.should_rebuild(len(self.pods)):
            self.pods = dict(self.pods)
        return True

    def replace_pods(self, pods: Iterable[Pod], keep: Collection[str] = ()) -> ReplaceResult:
        """Make the stored pods exactly ``pods`` (a relist): vanished ones are deleted. UIDs in ``keep``
        were listed but could not be decoded: their last good state stays."""
        listed = {pod.uid: pod for pod in pods}
        return _replace(lambda: self.pods, listed, keep, self.upsert_pod, self.delete_pod)

    # --- namespaces and configuration ---------------------------------------------------------

    def upsert_namespace(self, namespace: Namespace) -> bool:
        old = self.namespaces.get(namespace.name)
        if old == namespace:
            return False
        if old is not None and old.observe == namespace.observe:
            self.namespaces[namespace.name] = namespace  # nothing interest depends on changed
        else:
            self._reevaluate(lambda: self.namespaces.__setitem__(namespace.name, namespace), namespace.name)
        return True

    def delete_namespace(self, name: str) -> bool:
        if name not in self.namespaces:
            return False
        self._reevaluate(lambda: self.namespaces.__delitem__(name), name)
        return True

    def replace_namespaces(self, namespaces: Iterable[Namespace], keep: Collection[str] = ()) -> ReplaceResult:
        listed = {ns.name: ns for ns in namespaces}
        return _replace(lambda: self.namespaces, listed, keep, self.upsert_namespace, self.delete_namespace)

    def set_interest(self, interest: Interest) -> bool:
        """Apply a new (already validated) configuration; re-evaluates every pod when it changed."""
        if interest == self.interest:
            return False
        self._reevaluate(lambda: setattr(self, "interest", interest))
        return True

    # --- derived state ------------------------------------------------------------------------

    def is_observed(self, pod: Pod) -> bool:
        return observed(pod, self.namespaces.get(pod.namespace), self.interest, self.node_name)

    def recompute(self) -> dict[str, frozenset[str]]:
        """The desired filter computed from scratch: IP -> UIDs of the observed pods holding it."""
        result: dict[str, set[str]] = {}
        for pod in self.pods.values():
            if self.is_observed(pod):
                for ip in pod.ips:
                    result.setdefault(ip, set()).add(pod.uid)
        return {ip: frozenset(uids) for ip, uids in result.items()}

    def owner(self, ip: str) -> Pod | None:
        """The pod the IP's traffic belongs to: its newest holder (an older one is a pod whose IP was
        reused before its delete arrived)."""
        uids = self.desired.uids(ip)
        return self.pods.get(uids[-1]) if uids else None

    def owners(self, ip: str) -> list[Pod]:
        """The stored pods that hold ``ip`` in the desired filter."""
        return [self.pods[uid] for uid in self.desired.uids(ip) if uid in self.pods]

    # --- internals ----------------------------------------------------------------------------

    def _reevaluate(self, change: Callable[[], None], namespace: str | None = None) -> None:
        """Apply ``change`` (to namespaces or interest) and move each affected pod from what it held
        before the change to what it holds after it."""
        affected = [p for p in self.pods.values() if namespace is None or p.namespace == namespace]
        before = [self.is_observed(p) for p in affected]
        change()
        for pod, was in zip(affected, before, strict=True):
            now = self.is_observed(pod)
            if was != now:
                self.desired.move(pod.uid, pod.ips if was else (), pod.ips if now else ())


def _replace(stored: Callable[[], dict[str, T]], listed: dict[str, T], keep: Collection[str],
             upsert: Callable[[T], bool], delete: Callable[[str], bool]) -> ReplaceResult:
    """A relist as a diff: delete what vanished (unless kept), upsert the rest; unchanged ones are no-ops.
    ``stored`` is read afresh each time: a delete may rebuild the container (see compaction)."""
    vanished = [key for key in stored() if key not in listed and key not in keep]
    for key in vanished:
        delete(key)
    added = updated = 0
    for key, item in listed.items():
        known = key in stored()
        if upsert(item):
            updated += known
            added += not known
    return ReplaceResult(added, updated, len(vanished))
