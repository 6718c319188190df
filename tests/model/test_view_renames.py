"""``NodeView.apply`` reports the addresses a delta hands over, as the store reports its changes.

An address is handed over when it had a holder and its holders change: a pod of this node deleted,
finished or given other IPs, a second pod given a held IP; a far end whose endpoint in the PodSlices is
another one or none. The agent drains the flows counted so far whenever an address is handed over, named
with the view as it was before (``NodeView.take_handover``); a change that hands nothing over must not cost
a drain. The property: the report of each delta equals the difference of the holder maps computed from
scratch before and after it, and the names kept for the drain are the names of the view before.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_namespace, make_pod, with_changes
from podmeter.model.configuration import NO_CONFIGURATION, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, POD_SLICES, PODS, Delete, Replace, Upsert
from podmeter.model.endpoint_slices import PodSlice, decode_slice
from podmeter.model.endpoints import AddressBook, ChainedNames, Endpoint, Names
from podmeter.model.interest import holds_address
from podmeter.model.records import Pod
from podmeter.model.view import NodeView, ViewDelta

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


def _slice(name: str, *pods: tuple[str, str], identity: int = 300) -> PodSlice:
    endpoints = [{"uid": f"u-{pod}", "namespace": "shop", "name": pod, "ips": [ip], "identity": identity}
                 for pod, ip in pods]
    return decode_slice({"metadata": {"name": name, "resourceVersion": "1"}, "spec": {"endpoints": endpoints}})


def handed(view: NodeView, delta: ViewDelta) -> set[str]:
    """Apply ``delta``; the addresses it handed over (each reported once)."""
    report: list[str] = []
    view.apply(delta, report.append)
    assert len(report) == len(set(report)), report
    return set(report)


def test_a_pod_hands_an_address_over_when_it_gives_it_up_or_another_pod_takes_it() -> None:
    view = NodeView("node-a", track_handovers=True)
    web = make_pod("web", "shop", ips=("10.0.0.1",))
    assert handed(view, Upsert(PODS, web)) == set()  # a free address: nobody to name differently
    assert handed(view, Upsert(PODS, make_pod("new", "shop", ips=("10.0.0.2",)))) == set()
    reuser = make_pod("reuser", "shop", ips=("10.0.0.1",))
    assert handed(view, Upsert(PODS, reuser)) == {"10.0.0.1"}  # web still holds it
    assert handed(view, Delete(PODS, reuser.uid)) == {"10.0.0.1"}
    assert handed(view, Upsert(PODS, with_changes(web, labels=(("app", "other"),)))) == set()
    assert handed(view, Upsert(PODS, with_changes(web, phase="Succeeded"))) == {"10.0.0.1"}  # finished: free
    assert handed(view, Upsert(PODS, with_changes(web, ips=("10.0.0.3",)))) == set()  # it named nothing
    assert handed(view, Delete(PODS, "unknown")) == set()
    assert handed(view, Replace(PODS, [])) == {"10.0.0.2", "10.0.0.3"}  # a relist: what vanished
    host = make_pod("host", "shop", ips=("192.168.0.1",), host_network=True)
    assert handed(view, Upsert(PODS, host)) == set()
    assert handed(view, Delete(PODS, host.uid)) == set()  # a host-network pod's IP never named it


def test_a_slice_hands_over_the_addresses_it_names_otherwise_and_other_collections_never_do() -> None:
    view = NodeView("node-a", track_handovers=True)
    first = _slice("pods-1-0", ("a", "10.1.0.1"))
    assert handed(view, Upsert(POD_SLICES, first)) == set()  # the first list names free addresses
    assert handed(view, Upsert(POD_SLICES, first)) == set()
    assert handed(view, Upsert(POD_SLICES, _slice("pods-1-0", ("a", "10.1.0.1"), ("b", "10.1.0.2")))) == set()
    assert handed(view, Upsert(POD_SLICES, _slice("pods-1-0", ("c", "10.1.0.1"), ("b", "10.1.0.2")))) == {
        "10.1.0.1"}
    assert handed(view, Upsert(POD_SLICES, _slice("pods-1-0", ("c", "10.1.0.1"), ("b", "10.1.0.2"),
                                                  identity=301))) == {"10.1.0.1", "10.1.0.2"}
    assert handed(view, Delete(POD_SLICES, "pods-9-9")) == set()
    assert handed(view, Upsert(POD_SLICES, _slice("pods-2-1"))) == set()
    assert handed(view, Delete(POD_SLICES, "pods-2-1")) == set()  # an empty slice named nobody
    assert handed(view, Replace(POD_SLICES, [])) == {"10.1.0.1", "10.1.0.2"}
    assert handed(view, Upsert(NAMESPACES, make_namespace("shop", observe=True))) == set()
    assert handed(view, Replace(NAMESPACES, [])) == set()
    config = MetricsConfiguration("default", "1", 1, NO_CONFIGURATION)
    assert handed(view, Upsert(CONFIGURATIONS, config)) == set()
    assert handed(view, Delete(CONFIGURATIONS, "default")) == set()


def test_the_handover_keeps_the_names_as_they_were_until_it_is_taken() -> None:
    view = NodeView("node-a", track_handovers=True)
    old = make_pod("old", "shop", ips=("10.0.0.7",))
    view.apply(Upsert(PODS, old))
    view.apply(Upsert(POD_SLICES, _slice("pods-1-0", ("far", "10.1.0.1"))))
    assert view.take_handover() is None  # nothing was handed over
    view.apply(Delete(PODS, old.uid))
    view.apply(Upsert(PODS, make_pod("new", "shop", ips=("10.0.0.7",))))
    view.apply(Upsert(POD_SLICES, _slice("pods-1-0", ("other", "10.1.0.1"))))
    handover = view.take_handover()
    assert handover is not None and handover.addresses == {"10.0.0.7", "10.1.0.1"}
    assert [pod.uid for pod in handover.pods] == [old.uid]
    far = handover.cluster.endpoint("10.1.0.1")
    assert far is not None and far.pod == "far"
    assert view.take_handover() is None


def test_the_view_hands_over_the_moved_addresses_once() -> None:
    view = NodeView("node-a", track_moves=True)
    view.apply(Upsert(PODS, make_pod("web", "shop", ips=("10.0.0.1",), observe=True)))
    assert view.take_moved() == ["10.0.0.1"] and view.take_moved() == []


# --- the property: the report is the difference of the holder maps, recomputed -------------------------

IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::1"]
PODS_NAMES = ["p0", "p1", "p2", "p3"]
SLICE_NAMES = ["pods-2-0", "pods-2-1"]
_uids = itertools.count()

pod_states = st.fixed_dictionaries({
    "ips": st.lists(st.sampled_from(IPS), max_size=2, unique=True).map(tuple),
    "phase": st.sampled_from(["Pending", "Running", "Running", "Succeeded"]),
    "host_network": st.sampled_from([False, False, False, True]),
})
pods = st.builds(lambda name, state, fresh: (name, state, fresh), st.sampled_from(PODS_NAMES), pod_states,
                 st.booleans())
slice_rows = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(IPS), st.sampled_from([300, 301])),
                      max_size=3, unique_by=lambda row: row[1])
steps = st.lists(st.one_of(
    st.tuples(st.just("upsert-pod"), pods),
    st.tuples(st.just("delete-pod"), st.sampled_from(PODS_NAMES)),
    st.tuples(st.just("relist-pods"), st.lists(pods, max_size=3)),
    st.tuples(st.just("upsert-slice"), st.tuples(st.sampled_from(SLICE_NAMES), slice_rows)),
    st.tuples(st.just("delete-slice"), st.sampled_from(SLICE_NAMES)),
    st.tuples(st.just("relist-slices"), st.lists(st.tuples(st.sampled_from(SLICE_NAMES), slice_rows), max_size=2)),
), max_size=30)


def local_holders(view: NodeView) -> dict[str, frozenset[str]]:
    """IP -> UIDs of the stored pods whose IP names them, from scratch."""
    holders: dict[str, set[str]] = {}
    for pod in view.pods.values():
        if holds_address(pod):
            for ip in pod.ips:
                holders.setdefault(ip, set()).add(pod.uid)
    return {ip: frozenset(uids) for ip, uids in holders.items()}


def far_holders(view: NodeView) -> dict[str, Endpoint]:
    return dict(view.cluster.items())


def difference(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The addresses that had a holder and whose holder changed."""
    return {ip for ip, holder in before.items() if after.get(ip) != holder}


class Endpoints:
    """A copy of the cluster's endpoints (the names a drain would have read)."""

    def __init__(self, endpoints: dict[str, Endpoint]) -> None:
        self.endpoints = endpoints

    def endpoint(self, ip: str) -> Endpoint | None:
        return self.endpoints.get(ip)

    def is_local(self, ip: str) -> bool:
        return False


def names(pods: list[Pod], cluster: Names) -> ChainedNames:
    """What a drain names with (``runtime.flow_drain``): this node's pods first, then the cluster."""
    return ChainedNames(AddressBook(pods, cluster), cluster)


class Model:
    def __init__(self) -> None:
        self.uids = {name: f"{name}-{next(_uids)}" for name in PODS_NAMES}

    def pod(self, spec: tuple[str, dict[str, Any], bool]) -> Pod:
        name, state, fresh = spec
        if fresh:  # a pod of the same name recreated: another UID
            self.uids[name] = f"{name}-{next(_uids)}"
        return make_pod(name, "shop", uid=self.uids[name], **state)

    def delta(self, step: tuple[str, Any]) -> ViewDelta:
        kind, arg = step
        if kind == "upsert-pod":
            return Upsert(PODS, self.pod(arg))
        if kind == "delete-pod":
            return Delete(PODS, self.uids[arg])
        if kind == "relist-pods":
            return Replace(PODS, [self.pod(spec) for spec in arg])
        if kind == "upsert-slice":
            return Upsert(POD_SLICES, self.slice(*arg))
        if kind == "delete-slice":
            return Delete(POD_SLICES, arg)
        return Replace(POD_SLICES, [self.slice(name, rows) for name, rows in dict(arg).items()])

    @staticmethod
    def slice(name: str, rows: list[tuple[str, str, int]]) -> PodSlice:
        endpoints = [{"uid": f"u-{pod}", "namespace": "shop", "name": pod, "ips": [ip], "identity": identity}
                     for pod, ip, identity in rows]
        return decode_slice({"metadata": {"name": name, "resourceVersion": "1"}, "spec": {"endpoints": endpoints}})


@settings(max_examples=300, deadline=None)
@given(steps, st.integers(1, 4))
def test_the_handed_over_addresses_are_the_difference_of_the_holder_maps(plan: list[tuple[str, Any]],
                                                                         take_every: int) -> None:
    """After every delta, its report equals the holder maps recomputed before and after it, compared; the
    handover taken every few deltas holds every address reported since, each that had a holder named as the
    view named it before the first of those deltas (one that had none may be named as it is now: the flows
    counted before a free address was given are its new holder's)."""
    view, model = NodeView("node-a", track_handovers=True), Model()
    since: set[str] = set()
    before_names: ChainedNames | None = None
    for n, step in enumerate(plan):
        local, far = local_holders(view), far_holders(view)
        if before_names is None:
            before_names = names(list(view.pods.values()), Endpoints(far))
        report = handed(view, model.delta(step))
        assert report == difference(local, local_holders(view)) | difference(far, far_holders(view))
        since |= report
        if n % take_every == take_every - 1:
            handover = view.take_handover()
            if not since:
                assert handover is None
            else:
                assert handover is not None and handover.addresses == since
                kept = names(handover.pods, handover.cluster)
                for ip in handover.addresses:
                    if before_names.endpoint(ip) is not None:  # it had a holder when the handover began
                        assert kept.endpoint(ip) == before_names.endpoint(ip), ip
                        assert kept.is_local(ip) == before_names.is_local(ip), ip
            since, before_names = set(), None


def test_a_view_without_handovers_keeps_no_names_and_reports_none() -> None:
    """A recompute, a benchmark of the core: nothing is kept for the drains."""
    view = NodeView("node-a")
    web = make_pod("web", "shop", ips=("10.0.0.1",))
    view.apply(Upsert(PODS, web))
    assert handed(view, Delete(PODS, web.uid)) == set()
    assert len(view.addresses) == 0 and view.take_handover() is None
