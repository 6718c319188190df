"""The agent's endpoint cache in columns: addresses round-trip through their packed form, a slice's rows
name the right pod, and what a slice cannot carry is refused with the path that is wrong."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from podmeter.model.deltas import POD_SLICES, Delete, Upsert
from podmeter.model.endpoint_slices import ClusterEndpoints, PodSlice, decode_slice, lookup_key, pack_ip, unpack_ip
from podmeter.model.records import DecodeError
from podmeter.model.store import Store

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

addresses = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))


@given(addresses)
def test_an_address_round_trips_and_a_flow_end_finds_it(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    text = str(address)
    assert lookup_key(text) == pack_ip(text) == address.packed
    assert unpack_ip(pack_ip(text)) == text


@pytest.mark.parametrize("text", ["", "10.0.0", "10.0.0.256", "10.0.0.1.2", "fe80::1%eth0", "pod-a", "::g"])
def test_what_is_no_address_finds_nothing(text: str) -> None:
    assert lookup_key(text) is None
    assert ClusterEndpoints().endpoint(text) is None


def _spec(*endpoints: dict[str, object]) -> dict[str, object]:
    return {"metadata": {"name": "pods-1-0", "resourceVersion": "7"}, "spec": {"endpoints": list(endpoints)}}


def _endpoint(name: str, *ips: str, identity: int | None = 300, kind: str = "Deployment") -> dict[str, object]:
    return {"uid": f"u-{name}", "namespace": "shop", "name": name, "ips": list(ips), "node": "n1",
            "workloadKind": kind, "workload": "web", "identity": identity}


def test_a_slice_names_every_address_of_its_pods() -> None:
    decoded = decode_slice(_spec(_endpoint("web-1", "10.0.0.2", "fd00::2"), _endpoint("web-2", "10.0.0.1",
                                                                                      identity=None)))
    cache = ClusterEndpoints()
    cache.changed(None, decoded)
    one, two, six = cache.endpoint("10.0.0.2"), cache.endpoint("10.0.0.1"), cache.endpoint("fd00::2")
    assert one is not None and two is not None and six is not None
    assert (one.namespace, one.pod, one.workload_kind, one.workload, one.node, one.identity) == (
        "shop", "web-1", "Deployment", "web", "n1", 300)
    assert six == one and two.pod == "web-2" and two.identity is None
    assert dict(cache.items()) == dict(decoded.endpoints()) and len(cache) == 3


def test_an_address_listed_twice_belongs_to_the_pod_listed_last() -> None:
    decoded = decode_slice(_spec(_endpoint("old", "10.0.0.9"), _endpoint("new", "10.0.0.9")))
    assert [(ip, e.pod) for ip, e in decoded.endpoints()] == [("10.0.0.9", "new")]


@pytest.mark.parametrize(("endpoint", "path"), [
    (_endpoint("web-1", "10.0.0.1", "fe80::1%eth0"), "$.spec.endpoints[0].ips[1]"),
    (_endpoint("web-1", "not-an-ip"), "$.spec.endpoints[0].ips[0]"),
    (_endpoint("web-1", "10.0.0.1", kind="Deploy/ment"), "$.spec.endpoints[0]"),
])
def test_what_a_slice_cannot_carry_is_refused_with_its_path(endpoint: dict[str, object], path: str) -> None:
    with pytest.raises(DecodeError) as raised:
        decode_slice(_spec(endpoint))
    assert path in str(raised.value)


def test_a_slice_that_moves_an_address_gives_it_back_when_it_goes() -> None:
    store: Store[PodSlice] = Store(POD_SLICES)
    cache = ClusterEndpoints()
    first = decode_slice(_spec(_endpoint("a", "10.0.0.1")))
    second = decode_slice({**_spec(_endpoint("b", "10.0.0.1")), "metadata": {"name": "pods-2-1"}})
    store.apply(Upsert(POD_SLICES, first), cache.changed)
    store.apply(Upsert(POD_SLICES, second), cache.changed)
    assert getattr(cache.endpoint("10.0.0.1"), "pod", None) == "b"
    store.apply(Delete(POD_SLICES, "pods-2-1"), cache.changed)
    assert getattr(cache.endpoint("10.0.0.1"), "pod", None) == "a"
    assert not cache.renames(first, first) and cache.renames(first, second) and cache.renames(None, first)


def _labelled(name: str, identities: dict[int, dict[str, str]]) -> PodSlice:
    spec = _spec(*(_endpoint(f"{name}-{ident}", f"10.1.{ident % 250}.{len(name)}", identity=ident)
                   for ident in identities))
    spec["spec"]["identities"] = {str(i): {"namespace": "shop", "labels": labels}  # type: ignore[index]
                                  for i, labels in identities.items()}
    spec["metadata"] = {"name": name, "resourceVersion": "1"}
    return decode_slice(spec)


def test_an_identity_s_labels_are_shared_by_the_slices_and_go_with_the_last_of_them() -> None:
    store: Store[PodSlice] = Store(POD_SLICES)
    cache = ClusterEndpoints()
    first = _labelled("pods-2-0", {300: {"app": "web"}})
    second = _labelled("pods-2-1", {300: {"app": "web"}, 301: {"app": "db"}})
    assert first.labels[0] is second.labels[0]  # one object however many slices carry it
    store.apply(Upsert(POD_SLICES, first), cache.changed)
    store.apply(Upsert(POD_SLICES, second), cache.changed)
    assert cache.labels(300) == ("app", "web") and cache.labels(301) == ("app", "db")
    store.apply(Delete(POD_SLICES, "pods-2-1"), cache.changed)
    assert cache.labels(300) == ("app", "web") and cache.labels(301) == ()
    store.apply(Upsert(POD_SLICES, _labelled("pods-2-0", {302: {"app": "api"}})), cache.changed)
    assert cache.labels(300) == () and cache.labels(302) == ("app", "api")
    store.apply(Delete(POD_SLICES, "pods-2-0"), cache.changed)
    assert cache._labels == {} and cache._label_holders == {} and len(cache) == 0


def test_a_remote_end_is_labelled_by_its_identity_and_a_local_one_by_its_pod() -> None:
    from podmeter.model.endpoint_slices import endpoint_labels
    from podmeter.model.endpoints import pod_endpoint
    from podmeter.model.records import Pod

    cache = ClusterEndpoints()
    cache.changed(None, _labelled("pods-2-0", {300: {"app": "web"}}))
    remote = cache.endpoint("10.1.50.8")  # _labelled puts the name's length last
    assert remote is not None and endpoint_labels(remote, {}, cache) == ("app", "web")
    local = Pod(uid="u1", namespace="shop", name="web-0", node_name="n1", ips=("10.9.0.1",), host_network=False,
                phase="Running", deleting=False, observe=True, labels=("app", "web", "tier", "front"),
                resource_version="1")
    assert endpoint_labels(pod_endpoint(local), {"u1": local}, cache) == ("app", "web", "tier", "front")
    assert endpoint_labels(pod_endpoint(local), {}, ClusterEndpoints()) == ()


def test_shared_label_sets_go_with_the_last_slice_that_holds_them() -> None:
    import gc

    from podmeter.model import endpoint_slices

    store: Store[PodSlice] = Store(POD_SLICES)
    cache = ClusterEndpoints()
    for round_ in range(3):
        for n in range(20):
            labelled = _labelled(f"pods-64-{n}", {900_000 + round_ * 100 + n: {"app": f"a{n}"}})
            store.apply(Upsert(POD_SLICES, labelled), cache.changed)
        del labelled
        for n in range(20):
            store.apply(Delete(POD_SLICES, f"pods-64-{n}"), cache.changed)
    gc.collect()
    assert not [key for key in endpoint_slices._label_sets if key[0] >= 900_000]  # nothing outlives the slices
    assert cache._labels == {} and cache._label_holders == {} and not store.objects


@pytest.mark.parametrize(("name", "taken"), [
    ("pods-1-0", True), ("pods-4-3", True), ("pods-4096-4095", True), ("pods-4-4", False), ("pods-3-0", False),
    ("pods-8192-0", False), ("pods-01-0", False), ("pods-1-00", False), ("evil", False), ("pods-\u00b2-0", False),
    ("pods-1-0-x", False), ("pods--1-0", False),
])
def test_an_agent_takes_only_the_slice_names_the_operator_gives(name: str, taken: bool) -> None:
    """A writer of PodSlices cannot make an agent hold more than the operator's own names allow."""
    obj = {**_spec(_endpoint("web-1", "10.0.0.1")), "metadata": {"name": name, "resourceVersion": "1"}}
    if taken:
        assert decode_slice(obj).name == name
    else:
        with pytest.raises(DecodeError, match=r"\$\.metadata\.name"):
            decode_slice(obj)
