"""The agent's view of its node: the stored objects and the desired filter derived from them.

This is the level-triggered core. One :class:`~podmeter.model.store.Store` per collection mirrors the API
server (pods by UID, namespaces and MetricsConfigurations by name); :meth:`NodeView.apply` hands a delta
to its collection's store and moves the desired filter by the changes the store reports. Each change
re-evaluates only the pods it can affect (one pod; the pods of one namespace; all pods when the
``default`` configuration changes); :meth:`NodeView.recompute` rebuilds the filter from scratch for checks.

Nothing here depends on the history of events: a delete needs only the key, a duplicate upsert of an
identical record is a no-op, and a relist turns vanished objects into deletes and leaves unchanged ones
alone.

With ``track_handovers`` (the agent, for the drains of flows and drops) the view also knows who each
address names: this node's pods whose IPs name them (:func:`~podmeter.model.interest.holds_address`,
observed or not) and the cluster's endpoints (the PodSlices). :meth:`NodeView.apply` then reports, as the
store reports its changes, every address a delta *hands over*: one that had a holder and now has other
holders or none (a pod deleted, finished or given other IPs, a second pod given a held IP, a slice that
names an address differently); and the view keeps the names as they were before the first handover since
the last :meth:`NodeView.take_handover`, so that the flows counted before it are named as they were
(invariant I8). A view without it (a recompute, a benchmark of the core) pays for none of this.

Next stage: the writer (``runtime.writer``) pushes the desired filter's crossings to the datapath.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from podmeter.model.configuration import DEFAULT_NAME, NO_CONFIGURATION, Interest, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, POD_SLICES, PODS, Collection, Delta, Replace
from podmeter.model.desired import DesiredFilter
from podmeter.model.endpoint_slices import ClusterEndpoints, PodSlice, unpack_ip
from podmeter.model.endpoints import Endpoint, Names
from podmeter.model.interest import holds_address, observed
from podmeter.model.records import Namespace, Pod
from podmeter.model.refs import Refs
from podmeter.model.store import Store

# A delta of any collection the view stores.
ViewDelta = Delta[Pod] | Delta[Namespace] | Delta[MetricsConfiguration] | Delta[PodSlice]
# Called with each address a delta handed over (see the module docstring).
HandedOver = Callable[[str], None]

R = TypeVar("R")


def _ignore(ip: str) -> None:
    return None


@dataclass(frozen=True, slots=True)
class _Route(Generic[R]):
    """Where a collection's deltas go: its store, and what follows each change the store reports."""

    store: Store[R]
    changed: Callable[[R | None, R | None], None]


@dataclass(frozen=True, slots=True)
class Handover:
    """The view's names as they were before addresses were handed over (:meth:`NodeView.take_handover`):
    a drain owed at a change of hands names what was counted before it with these.

    ``addresses``: those handed over; ``pods``: this node's stored pods as they were, in the store's order
    (as a drain's address book reads them); ``cluster``: the cluster's endpoints as they were for the far
    ends handed over, as they are for every other address."""

    addresses: frozenset[str]
    pods: list[Pod]
    cluster: Names


class _EndpointsBefore:
    """The cluster's endpoints, with those of some addresses as they were (a :class:`Names`)."""

    def __init__(self, cluster: ClusterEndpoints, before: dict[str, Endpoint | None]) -> None:
        self._cluster, self._before = cluster, before

    def endpoint(self, ip: str) -> Endpoint | None:
        before = self._before
        return before[ip] if ip in before else self._cluster.endpoint(ip)

    def is_local(self, ip: str) -> bool:
        return False  # as the cache: the node's own pods are named by its store


class NodeView:
    """Stored pods, namespaces and configurations, and the desired filter.

    Invariant: a stored pod holds exactly ``pod.ips`` in the desired filter iff it is observed under the
    current namespaces and interest, and holds nothing otherwise; so ``desired`` == :meth:`recompute`.
    ``interest`` is the interest of the stored configuration named ``default`` (none: annotations only).

    No per-pod bookkeeping besides the store and the holders of each address: whether a pod counted
    *before* a change is recomputed from the state before the change (the old record, the old namespace,
    the old interest), which is what keeps a stored pod under a kilobyte. The price: a namespace's
    annotation flip re-evaluates every stored pod (a scan of one node's pods, rare), not an index of that
    namespace. With ``track_handovers``, ``addresses`` holds, per IP, the UIDs of the stored pods whose IP
    names them (what a change is judged against to know whether it hands an address over); the caller
    takes :meth:`take_handover` regularly (what it keeps lasts until then).
    """

    def __init__(self, node_name: str | None = None, track_moves: bool = False,
                 track_handovers: bool = False) -> None:
        self.node_name = node_name
        self.pod_store: Store[Pod] = Store(PODS)
        self.namespace_store: Store[Namespace] = Store(NAMESPACES)
        self.configuration_store: Store[MetricsConfiguration] = Store(CONFIGURATIONS)
        self.interest: Interest = NO_CONFIGURATION
        self.desired = DesiredFilter(track_moves)
        # The cluster's pods as the operator publishes them (names of the far ends of flows).
        self.slice_store: Store[PodSlice] = Store(POD_SLICES)
        self.cluster = ClusterEndpoints()
        self.addresses: Refs[str] = Refs()  # IP -> UIDs of the stored pods it names (holds_address)
        # Each collection's route: its store and the handler of the changes it reports.
        self._routes: dict[Collection[Any], _Route[Any]] = {
            PODS: _Route(self.pod_store, self._pod_changed),
            NAMESPACES: _Route(self.namespace_store, self._namespace_changed),
            CONFIGURATIONS: _Route(self.configuration_store, self._configuration_changed),
            POD_SLICES: _Route(self.slice_store, self._slice_changed),
        }
        # The addresses the delta being applied touched, each with what it named before the delta: for this
        # node's pods whether any pod held it, for the cluster its endpoint (None: none). An upsert or a
        # delete changes one object, so only a relist (``_relist``) notes the free addresses it touches, for
        # a later change of the same relist; ``_far`` is off for a delta that finds no endpoint stored
        # (nothing to hand over: the first list).
        self._held: dict[str, bool] = {}
        self._named: dict[str, Endpoint | None] = {}
        self._relist = False
        self._far = False
        # With track_handovers, since the last take_handover: what was handed over, the pods before the
        # first pod delta, the endpoint each far address touched named before the first delta that touched
        # it; ``_far_emptied``: a slice delta found no endpoint stored, so an address first touched after it
        # named nobody before the first delta.
        self._track_handovers = track_handovers
        self._handed: dict[str, None] = {}
        self._pods_before: list[Pod] | None = None
        self._far_before: dict[str, Endpoint | None] = {}
        self._far_emptied = False

    def apply(self, delta: ViewDelta, handed_over: HandedOver = _ignore) -> int:
        """Apply one delta to its collection's store, the desired filter and the names of addresses; how
        many objects changed. With ``track_handovers``, ``handed_over(ip)`` is called once for each address
        the delta handed over (see the module docstring), after the delta is applied."""
        if self._track_handovers:
            self._before(delta)
        route = self._routes[delta.collection]
        changed = route.store.apply(delta, route.changed)
        if self._held or self._named:
            for ip in self._handed_over():
                handed_over(ip)
        return changed

    def _before(self, delta: ViewDelta) -> None:
        """What the names were, kept before a delta changes them: this node's pods before the first pod
        delta since the last take; whether the cluster's endpoints are worth noting (some are stored)."""
        self._relist = isinstance(delta, Replace)
        if delta.collection is PODS and self._pods_before is None:
            self._pods_before = list(self.pods.values())
        elif delta.collection is POD_SLICES:
            self._far = len(self.cluster) > 0
            self._far_emptied = self._far_emptied or not self._far

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

    def take_handover(self) -> Handover | None:
        """The names as they were before the addresses handed over since the last call, or None if none
        was (always None without ``track_handovers``). The agent takes it after each batch: a drain then
        names what was counted before the batch's changes of hands as it was counted."""
        handed, pods, far = self._handed, self._pods_before, self._far_before
        self._handed, self._pods_before, self._far_before, self._far_emptied = {}, None, {}, False
        if not handed:
            return None
        return Handover(frozenset(handed), list(self.pods.values()) if pods is None else pods,
                        _EndpointsBefore(self.cluster, {ip: far[ip] for ip in handed if ip in far}))

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

    # --- how each change moves the desired filter and the names -----------------------------

    def _pod_changed(self, old: Pod | None, new: Pod | None) -> None:
        namespaces, interest, node = self.namespace_store.objects, self.interest, self.node_name
        uid = new.uid if new is not None else old.uid if old is not None else ""
        held: tuple[str, ...] = ()
        holds: tuple[str, ...] = ()
        if old is not None and observed(old, namespaces.get(old.namespace), interest, node):
            held = old.ips
        if new is not None and observed(new, namespaces.get(new.namespace), interest, node):
            holds = new.ips
        if held or holds:
            self.desired.move(uid, held, holds)
        if self._track_handovers:
            named = old.ips if old is not None and holds_address(old) else ()
            names = new.ips if new is not None and holds_address(new) else ()
            if named != names:
                self._rename(uid, named, names)

    def _rename(self, uid: str, named: tuple[str, ...], names: tuple[str, ...]) -> None:
        """The pod ``uid``'s IPs named it (``named``) and now name it (``names``). Each address touched
        notes, the first time in a delta, whether a pod held it before: one that had a holder is handed
        over (a pod is touched once per delta, so its holders then differ from what they were)."""
        addresses, held = self.addresses, self._held
        for ip in named:
            if ip not in names:
                held.setdefault(ip, True)
                addresses.discard(ip, uid)
        for ip in names:
            if ip not in named:
                if ip in addresses:
                    held.setdefault(ip, True)
                elif self._relist:
                    held.setdefault(ip, False)
                addresses.add(ip, uid)

    def _slice_changed(self, old: PodSlice | None, new: PodSlice | None) -> None:
        """Each address a slice lists or listed notes, the first time in a delta, the endpoint it named
        before; the cache follows the change (``ClusterEndpoints.changed``)."""
        if self._far and not (old is not None and new is not None and old.same_rows(new)):
            named, cluster = self._named, self.cluster
            for packed in (*(old.ips if old is not None else ()), *(new.ips if new is not None else ())):
                ip = unpack_ip(packed)
                if ip not in named:
                    named[ip] = cluster.endpoint(ip)
        self.cluster.changed(old, new)

    def _handed_over(self) -> list[str]:
        """The addresses the delta just applied handed over: of this node's pods those that had a holder
        (their holders changed), of the cluster's those whose endpoint is not the one they named."""
        held, named = self._held, self._named  # one of them: a delta is of one collection
        handed = [ip for ip, had in held.items() if had]
        held.clear()
        if named:
            endpoint = self.cluster.endpoint
            handed.extend(ip for ip, before in named.items() if before is not None and endpoint(ip) != before)
            first, emptied = self._far_before, self._far_emptied
            for ip, before in named.items():
                first.setdefault(ip, None if emptied else before)
            named.clear()
        self._handed.update(dict.fromkeys(handed))
        return handed

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
