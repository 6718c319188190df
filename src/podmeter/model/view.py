"""The agent's view of its node: the stored objects and the desired filter derived from them.

This is the level-triggered core. One :class:`~podmeter.model.store.Store` per collection mirrors the API
server (pods by UID, namespaces and MetricsConfigurations by name); :meth:`NodeView.apply` hands a delta
to its collection's store and moves the desired filter by the changes the store reports. Each change
re-evaluates only the pods it can affect (one pod; the pods of one namespace; all pods when the
``default`` configuration changes); :meth:`NodeView.recompute` rebuilds the filter from scratch for checks.

Nothing here depends on the history of events: a delete needs only the key, a duplicate upsert of an
identical record is a no-op, and a relist turns vanished objects into deletes and leaves unchanged ones
alone.

Next stage: the writer (``runtime.writer``) pushes the desired filter's crossings to the datapath.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from podmeter.model.configuration import DEFAULT_NAME, NO_CONFIGURATION, Interest, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, POD_SLICES, PODS, Collection, Delete, Delta, Replace
from podmeter.model.desired import DesiredFilter
from podmeter.model.endpoint_slices import ClusterEndpoints, PodSlice
from podmeter.model.interest import holds_address, observed
from podmeter.model.records import Namespace, Pod
from podmeter.model.store import Store

# A delta of any collection the view stores.
ViewDelta = Delta[Pod] | Delta[Namespace] | Delta[MetricsConfiguration] | Delta[PodSlice]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Route(Generic[R]):
    """Where a collection's deltas go: its store, what follows each change the store reports, and whether
    a change ``(old, new)`` would take an address from the one it names now (None: the collection names
    no address, so none of its changes renames)."""

    store: Store[R]
    changed: Callable[[R | None, R | None], None]
    renames: Callable[[R | None, R | None], bool] | None = None


class NodeView:
    """Stored pods, namespaces and configurations, and the desired filter.

    Invariant: a stored pod holds exactly ``pod.ips`` in the desired filter iff it is observed under the
    current namespaces and interest, and holds nothing otherwise; so ``desired`` == :meth:`recompute`.
    ``interest`` is the interest of the stored configuration named ``default`` (none: annotations only).

    No per-pod bookkeeping besides the store itself: whether a pod counted *before* a change is
    recomputed from the state before the change (the old record, the old namespace, the old interest),
    which is what keeps a stored pod under a kilobyte. The price: a namespace's annotation flip
    re-evaluates every stored pod (a scan of one node's pods, rare), not an index of that namespace.
    """

    def __init__(self, node_name: str | None = None, track_moves: bool = False) -> None:
        self.node_name = node_name
        self.pod_store: Store[Pod] = Store(PODS)
        self.namespace_store: Store[Namespace] = Store(NAMESPACES)
        self.configuration_store: Store[MetricsConfiguration] = Store(CONFIGURATIONS)
        self.interest: Interest = NO_CONFIGURATION
        self.desired = DesiredFilter(track_moves)
        # The cluster's pods as the operator publishes them (names of the far ends of flows).
        self.slice_store: Store[PodSlice] = Store(POD_SLICES)
        self.cluster = ClusterEndpoints()
        # Each collection's route: its store, the handler of the changes it reports, its renaming rule.
        self._routes: dict[Collection[Any], _Route[Any]] = {
            PODS: _Route(self.pod_store, self._pod_changed, self._pod_renames),
            NAMESPACES: _Route(self.namespace_store, self._namespace_changed),
            CONFIGURATIONS: _Route(self.configuration_store, self._configuration_changed),
            POD_SLICES: _Route(self.slice_store, self.cluster.changed, self.cluster.renames),
        }

    def apply(self, delta: ViewDelta) -> int:
        """Apply one delta to its collection's store and the desired filter; how many objects changed."""
        route = self._routes[delta.collection]
        return route.store.apply(delta, route.changed)

    # --- what the stores hold (read-only views) ------------------------------------------------

    @property
    def pods(self) -> dict[str, Pod]:
        return self.pod_store.objects

    @property
    def namespaces(self) -> dict[str, Namespace]:
        return self.namespace_store.objects

    @property
    def configuration(self) -> MetricsConfiguration | None:
        """The configuration in force: the stored object named ``default``, if any."""
        return self.configuration_store.get(DEFAULT_NAME)

    # --- derived state ------------------------------------------------------------------------

    def is_observed(self, pod: Pod) -> bool:
        return observed(pod, self.namespace_store.objects.get(pod.namespace), self.interest, self.node_name)

    def renames(self, delta: ViewDelta) -> bool:
        """Whether ``delta`` would take an address from the one that holds it now (a pod deleted, finished
        or with other IPs, a new pod given an IP another stored pod still holds, a slice that lists other
        endpoints): flows counted before it must be named with the view as it is now. Each collection's
        route says it for one change; a relist of a collection that names addresses may rename any."""
        route = self._routes[delta.collection]
        if route.renames is None:
            return False
        if isinstance(delta, Replace):
            return True
        store = route.store
        if isinstance(delta, Delete):
            old = store.get(delta.key)
            return old is not None and route.renames(old, None)
        return route.renames(store.get(store.collection.key(delta.item)), delta.item)

    def take_moved(self) -> list[str]:
        """IPs whose holders changed since the last call (the view tracks them only if asked to): the
        traffic and drop ledgers give each of them to its new owner."""
        return self.desired.take_moved()

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

    # --- how each change moves the desired filter ---------------------------------------------

    def _pod_changed(self, old: Pod | None, new: Pod | None) -> None:
        namespaces, interest, node = self.namespace_store.objects, self.interest, self.node_name
        held: tuple[str, ...] = ()
        holds: tuple[str, ...] = ()
        if old is not None and observed(old, namespaces.get(old.namespace), interest, node):
            held = old.ips
        if new is not None and observed(new, namespaces.get(new.namespace), interest, node):
            holds = new.ips
        if held or holds:
            self.desired.move(new.uid if new is not None else old.uid if old is not None else "", held, holds)

    def _pod_renames(self, old: Pod | None, new: Pod | None) -> bool:
        """A pod gives up an address it held, or takes one another stored pod still holds. A pod given a
        free address takes nothing from anyone."""
        before = set(old.ips) if old is not None and holds_address(old) else set()
        after = set(new.ips) if new is not None and holds_address(new) else set()
        if before - after:
            return True
        gained = after - before
        return new is not None and bool(gained) and any(
            p.uid != new.uid and holds_address(p) and not gained.isdisjoint(p.ips) for p in self.pods.values())

    def _namespace_changed(self, old: Namespace | None, new: Namespace | None) -> None:
        if old is not None and new is not None and old.observe == new.observe:
            return  # nothing interest depends on changed
        name = new.name if new is not None else old.name if old is not None else ""
        node, interest = self.node_name, self.interest
        self._reevaluate([p for p in self.pods.values() if p.namespace == name],
                         lambda pod: observed(pod, old, interest, node), lambda pod: observed(pod, new, interest, node))

    def _configuration_changed(self, old: MetricsConfiguration | None, new: MetricsConfiguration | None) -> None:
        name = new.name if new is not None else old.name if old is not None else ""
        if name != DEFAULT_NAME:
            return  # only the object named "default" counts
        interest = new.interest if new is not None else NO_CONFIGURATION
        if interest == self.interest:
            return
        before, self.interest = self.interest, interest
        node, namespaces = self.node_name, self.namespaces
        self._reevaluate(list(self.pods.values()),
                         lambda pod: observed(pod, namespaces.get(pod.namespace), before, node),
                         lambda pod: observed(pod, namespaces.get(pod.namespace), interest, node))

    def _reevaluate(self, pods: list[Pod], was: Callable[[Pod], bool], now: Callable[[Pod], bool]) -> None:
        """Move each of ``pods`` from what it held before a change (``was``) to what it holds after it."""
        for pod in pods:
            before, after = was(pod), now(pod)
            if before != after:
                self.desired.move(pod.uid, pod.ips if before else (), pod.ips if after else ())
