"""``NodeView.renames``: each collection's route says whether a change takes an address from the one it names.

The agent drains the flows counted so far before such a change, so that they are named as the view is now;
a change that renames nothing must not cost a drain.
"""

from __future__ import annotations

import pytest

from factories import make_namespace, make_pod, with_changes
from podmeter.model.configuration import NO_CONFIGURATION, MetricsConfiguration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, POD_SLICES, PODS, Delete, Replace, Upsert
from podmeter.model.endpoint_slices import PodSlice, decode_slice
from podmeter.model.view import NodeView

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


def _slice(name: str, *pods: tuple[str, str]) -> PodSlice:
    endpoints = [{"uid": f"u-{pod}", "namespace": "shop", "name": pod, "ips": [ip], "identity": 300}
                 for pod, ip in pods]
    return decode_slice({"metadata": {"name": name, "resourceVersion": "1"}, "spec": {"endpoints": endpoints}})


def test_a_pod_renames_when_it_gives_up_an_address_or_takes_a_held_one() -> None:
    view = NodeView("node-a")
    web = make_pod("web", "shop", ips=("10.0.0.1",))
    view.apply(Upsert(PODS, web))
    assert not view.renames(Upsert(PODS, make_pod("new", "shop", ips=("10.0.0.2",))))  # a free address
    assert view.renames(Upsert(PODS, make_pod("reuser", "shop", ips=("10.0.0.1",))))  # web still holds it
    assert view.renames(Upsert(PODS, with_changes(web, phase="Succeeded")))  # finished: its IP is free
    assert view.renames(Upsert(PODS, with_changes(web, ips=("10.0.0.3",))))
    assert not view.renames(Upsert(PODS, with_changes(web, labels=(("app", "other"),))))
    assert view.renames(Delete(PODS, web.uid)) and not view.renames(Delete(PODS, "unknown"))
    assert view.renames(Replace(PODS, [web]))  # a relist may rename anything
    host = make_pod("host", "shop", ips=("192.168.0.1",), host_network=True)
    view.apply(Upsert(PODS, host))
    assert not view.renames(Delete(PODS, host.uid))  # a host-network pod's IP never named it


def test_a_slice_renames_when_its_rows_change_and_other_collections_never_do() -> None:
    view = NodeView("node-a")
    first = _slice("pods-1-0", ("a", "10.1.0.1"))
    view.apply(Upsert(POD_SLICES, first))
    assert not view.renames(Upsert(POD_SLICES, first))
    assert view.renames(Upsert(POD_SLICES, _slice("pods-1-0", ("b", "10.1.0.1"))))
    assert view.renames(Delete(POD_SLICES, "pods-1-0")) and not view.renames(Delete(POD_SLICES, "pods-9-9"))
    view.apply(Upsert(POD_SLICES, _slice("pods-2-1")))
    assert not view.renames(Delete(POD_SLICES, "pods-2-1"))  # an empty slice named nobody
    assert view.renames(Replace(POD_SLICES, []))
    assert not view.renames(Upsert(NAMESPACES, make_namespace("shop", observe=True)))
    assert not view.renames(Replace(NAMESPACES, []))
    config = MetricsConfiguration("default", "1", 1, NO_CONFIGURATION)
    assert not view.renames(Upsert(CONFIGURATIONS, config)) and not view.renames(Delete(CONFIGURATIONS, "default"))


def test_the_view_hands_over_the_moved_addresses_once() -> None:
    view = NodeView("node-a", track_moves=True)
    view.apply(Upsert(PODS, make_pod("web", "shop", ips=("10.0.0.1",), observe=True)))
    assert view.take_moved() == ["10.0.0.1"] and view.take_moved() == []
