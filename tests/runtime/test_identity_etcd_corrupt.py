"""Forged and corrupt entries in a real etcd: detected, counted once, repaired or ignored, never trusted.

Every forgery is written directly by a foreign writer (etcd's JSON gateway, as ``etcdctl put`` would), not
through the backend. The promise checked: no operator ever holds two keys under one ID, two operators end
up with one numbering, and a key whose entry was corrupt still gets a sound ID (nothing stays pending).
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from etcd_server import EtcdServer, etcd
from lab_server import LabServer
from operator_support import OperatorProcess
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.adapters.identity.etcd_audit import KINDS, Entry, Layout, audit, parse_id, parse_key
from podmeter.adapters.metrics.operator_state import OperatorSnapshot, OperatorStateCollector
from podmeter.model.identity import IdentityKey
from waiting import wait_for

__all__ = ["etcd"]

P = b"/podmeter/identities/"


def key(i: int) -> IdentityKey:
    return IdentityKey("ns", ("app", f"a{i}"))


def enc(k: IdentityKey) -> bytes:
    return k.encode().encode()


@pytest.fixture
async def backends(etcd: EtcdServer) -> AsyncIterator[Callable[..., EtcdIdentityBackend]]:
    made: list[EtcdIdentityBackend] = []

    def make(**kw: object) -> EtcdIdentityBackend:
        b = EtcdIdentityBackend([etcd.endpoint], lease_ttl=3, timeout=3, **kw)  # type: ignore[arg-type]
        made.append(b)
        return b

    yield make
    for b in made:
        await b.close()


def injective(held: dict[IdentityKey, int]) -> bool:
    return len(set(held.values())) == len(held)


# -- the reported cases ---------------------------------------------------------------------------------------


async def test_one_foreign_write_cannot_give_two_label_sets_one_id(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    a, b = backends(owner="a"), backends(owner="b")
    await a.start()
    await b.start()
    assert await a.acquire(key(1)) == 256
    etcd.put(P + b"key/" + enc(key(2)), b"256")  # the probe's write: key 2 "has" ID 256
    assert await b.acquire(key(2)) == 257  # not 256: id/256 names key 1, so key 2's master is a forgery
    assert await a.acquire(key(2)) == 257
    assert b.store_corrupt() == {"duplicate_id": 1}
    assert await a.identities() == {256: key(1), 257: key(2)}
    assert await a.gc() == 0 and a.store_corrupt() == {}  # repaired already by b: nothing left for a to find


async def test_a_non_numeric_id_does_not_leave_a_key_pending(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    a = backends(owner="a")
    await a.start()
    for i, forged in enumerate([b"abc", b"0257", b" 257", b"+257", b"2_57", b"257\n", b"", b"9" * 30]):
        etcd.put(P + b"key/" + enc(key(i)), forged)
        assert await asyncio.wait_for(a.acquire(key(i)), 5) == 256 + i, forged
    assert a.store_corrupt() == {"not_a_number": 8}
    assert await a.identities() == {256 + i: key(i) for i in range(8)}


async def test_a_complete_forged_pair_moves_the_victim_to_a_new_id(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    """A forger rewrites both masters so that ID 256 of key 1 is paired with key 2 instead. Key 2 then
    owns 256 (the store's only pair for it); key 1 must move: at once in an operator that acquires key 2
    while holding key 1, and at the leader's next GC round in the others."""
    a, b = backends(owner="a"), backends(owner="b")
    await a.start()
    await b.start()
    assert await a.acquire(key(1)) == 256
    assert await b.acquire(key(1)) == 256
    etcd.put(P + b"id/256", enc(key(2)))
    etcd.put(P + b"key/" + enc(key(2)), b"256")
    assert await b.acquire(key(2)) == 256
    assert dict(b.held()) == {key(2): 256, key(1): 257}  # b never holds two keys under one ID
    assert b.ids_changed == 1
    assert b.store_corrupt() == {"duplicate_id": 1}  # key 1's master, which b removed
    assert dict(a.held()) == {key(1): 256}  # a has not looked yet
    assert await a.gc() == 0  # the leader's round: a's key 1 is no pair of the store any more: it moves
    assert dict(a.held()) == {key(1): 257} and a.ids_changed == 1
    assert await a.identities() == {256: key(2), 257: key(1)}


async def test_the_leaders_gc_finds_and_removes_a_forged_away_master(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    a = backends(owner="a")
    await a.start()
    assert await a.acquire(key(1)) == 256
    etcd.put(P + b"id/256", enc(key(2)))
    etcd.put(P + b"key/" + enc(key(2)), b"256")
    assert await a.gc() == 0
    assert a.store_corrupt() == {"duplicate_id": 1} and dict(a.held()) == {key(1): 257}
    assert await a.identities() == {256: key(2), 257: key(1)}
    assert (await a.gc(), await a.gc()) == (1, 0)  # nobody references the forged pair: collected
    assert await a.identities() == {257: key(1)}


async def test_ids_out_of_range_and_undecodable_keys_are_ignored_then_removed(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    a = backends(owner="a", first=256, last=300)
    await a.start()
    etcd.put(P + b"id/70000", enc(key(1)))  # a pair outside the range
    etcd.put(P + b"key/" + enc(key(1)), b"70000")
    etcd.put(P + b"id/256", b"\xff\xfe not a key")  # an ID naming garbage: 256 is not offered until removed
    etcd.put(P + b"key/[not json", b"257")
    spaced = b'["ns", ["app", "a2"]]'  # key 2 in a non-canonical encoding: it would be a second master
    etcd.put(P + b"key/" + spaced, b"258")
    etcd.put(P + b"id/258", spaced)
    etcd.put(P + b"id/abc", enc(key(3)))
    assert await a.identities() == {}
    found = dict(a.store_corrupt())
    assert found == {"out_of_range": 2, "bad_key": 4, "not_a_number": 1}
    await a.identities()
    assert a.store_corrupt() == found  # counted once per entry, however often it is read
    assert await a.acquire(key(1)) == 257  # 256 and 258 are still named by id/ entries: not offered
    assert await a.acquire(key(2)) == 259
    assert await a.gc() == 0  # the leader removes every corrupt entry
    assert await a.identities() == {257: key(1), 259: key(2)}
    assert [await a.acquire(key(3)), await a.acquire(key(4))] == [256, 258]  # free again
    raw = await a._c.get_prefix(P)
    assert sorted(kv.key for kv in raw if not kv.key.startswith(P + b"ref/")) == sorted(
        [P + b"id/" + str(n).encode() for n in (256, 257, 258, 259)]
        + [P + b"key/" + enc(key(i)) for i in (1, 2, 3, 4)])


async def test_an_orphan_id_is_not_offered_and_a_leaseless_reference_does_not_pin_an_id(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    a = backends(owner="a")
    etcd.put(P + b"id/256", enc(key(9)))  # the ID's master without its reverse
    await a.start()
    assert await asyncio.wait_for(a.acquire(key(1)), 5) == 257  # before: 32 failed claims of 256, no ID
    etcd.put(P + b"ref/" + enc(key(1)) + b"/ghost", b"257")  # a reference no lease will ever expire
    await a.release(key(1))
    assert await a.gc() == 0  # removes the orphan and the ghost, marks 257
    assert await a.gc() == 1  # and 257 goes: the ghost held it no longer
    assert a.store_corrupt() == {"unpaired": 1, "bad_reference": 1}
    assert await a.identities() == {}


async def test_two_operators_stay_one_numbering_through_random_forgeries(
    etcd: EtcdServer, backends: Callable[..., EtcdIdentityBackend]
) -> None:
    rng = random.Random(19)
    a, b = backends(owner="a"), backends(owner="b")
    await asyncio.gather(a.start(), b.start())
    keys = [key(i) for i in range(30)]
    await asyncio.gather(*(a.acquire(k) for k in keys[:10]))
    for _ in range(40):  # forge while both are allocating
        i, n = rng.randrange(40), rng.randrange(256, 300)
        choice = rng.randrange(5)
        if choice == 0:
            etcd.put(P + b"key/" + enc(key(i)), str(n).encode())
        elif choice == 1:
            etcd.put(P + b"id/" + str(n).encode(), enc(key(i)))
        elif choice == 2:
            etcd.put(P + b"key/" + enc(key(i)), rng.choice([b"x", b"-1", b"070000", b"99999999"]))
        elif choice == 3:
            etcd.put(P + b"id/" + str(n).encode(), rng.choice([b"[]", b"{", enc(key(i))[:-1]]))
        else:
            etcd.put(P + b"id/" + str(n).encode(), enc(key(i)))
            etcd.put(P + b"key/" + enc(key(i)), str(n).encode())
        await asyncio.gather(a.acquire(rng.choice(keys)), b.acquire(rng.choice(keys)))
    for k in keys:
        await a.acquire(k)
        await b.acquire(k)
        assert injective(dict(a.held())) and injective(dict(b.held()))
    for _ in range(2):  # each operator's audit: the numbering of both follows the store's pairs
        await a.gc()
        await b.gc()
    assert dict(a.held()) == dict(b.held()) and injective(dict(a.held())) and len(a.held()) == 30
    store = await a.identities()
    assert {k: store_id for store_id, k in store.items() if k in a.held()} == dict(a.held())
    assert sum(a.store_corrupt().values()) + sum(b.store_corrupt().values()) > 0


# -- the audit itself -------------------------------------------------------------------------------------------


def test_the_audit_names_each_corrupt_entry_once() -> None:
    layout = Layout(P)
    e1, e2, e3 = enc(key(1)), enc(key(2)), enc(key(3))
    ids = [Entry(P + b"id/256", e1, 5), Entry(P + b"id/257", e3, 6), Entry(P + b"id/0258", e2, 7)]
    keys = [Entry(P + b"key/" + e1, b"256", 5), Entry(P + b"key/" + e2, b"256", 8)]
    refs = [Entry(P + b"ref/" + e1 + b"/a", b"256", 5, lease=7), Entry(P + b"ref/" + e2 + b"/b", b"256", 9)]
    found = audit(layout, ids, keys, refs, first=256, last=65535)
    assert {e: (p.ident, p.key) for e, p in found.pairs.items()} == {e1: (256, key(1))}
    assert found.taken == {256, 257}
    assert sorted((c.kind, c.entry.key) for c in found.corrupt) == sorted([
        ("not_a_number", P + b"id/0258"), ("duplicate_id", P + b"key/" + e2), ("unpaired", P + b"id/257"),
        ("bad_reference", P + b"ref/" + e2 + b"/b")])
    assert found.references == {e1: {"a"}}
    assert [parse_id(x) for x in (b"0", b"7", b"65535", b"-1", b"1e3", b"\xd9\xa3")] == [0, 7, 65535, None, None, None]
    assert parse_key(e1) == key(1) and parse_key(b'["ns",["b","1","a","2"]]') is None  # unsorted: not canonical


def test_the_corrupt_counter_is_exported_by_kind() -> None:
    registry = CollectorRegistry()
    registry.register(OperatorStateCollector(lambda: OperatorSnapshot(store_corrupt={"duplicate_id": 2,
                                                                                     "not_a_number": 1})))
    text = generate_latest(registry).decode()
    assert 'podmeter_identity_store_corrupt_total{kind="duplicate_id"} 2.0' in text
    assert 'podmeter_identity_store_corrupt_total{kind="not_a_number"} 1.0' in text
    assert 'podmeter_identity_store_corrupt_total{kind="unpaired"} 0.0' in text  # known kinds exist at 0


def test_a_healthy_operator_exports_its_error_counters_at_zero() -> None:
    """A dashboard's panel of errors shows 0 for a healthy operator, not "No data": every label value
    known in advance has its series before the first error."""
    registry = CollectorRegistry()
    registry.register(OperatorStateCollector(OperatorSnapshot))
    text = generate_latest(registry).decode()
    for kind in KINDS:
        assert f'podmeter_identity_store_corrupt_total{{kind="{kind}"}} 0.0' in text
    for op, reason in (("acquire", "backend"), ("acquire", "exhausted"), ("release", "backend"),
                       ("key", "bad_labels"), ("start", "backend"), ("gc", "backend")):
        assert f'podmeter_identity_errors_total{{op="{op}",reason="{reason}"}} 0.0' in text


def test_the_operator_counts_a_forged_entry_in_its_metrics(
    lab_apiserver: LabServer, etcd: EtcdServer, tmp_path: Path
) -> None:
    web = IdentityKey("shop", ("app", "web"))
    etcd.put(P + b"key/" + enc(web), b"999")  # forged before the pod exists: no id/999
    op = OperatorProcess(lab_apiserver, tmp_path, "op", ["--identity-backend", "etcd", "--etcd-endpoints",
                                                          etcd.endpoint, "--etcd-lease-ttl", "3"])
    try:
        lab_apiserver.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                            "metadata": {"name": "shop"}})
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-1", "labels": {"app": "web"}},
               "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "busybox"}]}}
        assert lab_apiserver.request("POST", "/api/v1/namespaces/shop/pods", pod)[0] == 201

        def corrupt() -> str:
            found = re.search(r'^podmeter_identity_store_corrupt_total\{kind="unpaired"\} (\S+)$',
                              op.get("/metrics"), re.M)
            return found.group(1) if found else ""

        wait_for(lambda: op.label_sets() == {"web"}, what="web's identity", describe=op.log.read_text)
        assert {d["labels"]["app"]: d["id"] for d in op.debug()["identities"]} == {"web": 256}
        assert corrupt() == "1.0"
        assert "corrupt entry" in op.log.read_text() and "(unpaired)" in op.log.read_text()
    finally:
        op.stop()
