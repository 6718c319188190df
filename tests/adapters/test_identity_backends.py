"""Identity backends: memory, and etcd against a real etcd server (Debian's etcd-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import pytest

from etcd_server import EtcdServer, etcd
from podmeter.adapters.identity.base import IdentityBackendError
from podmeter.adapters.identity.etcd import EtcdIdentityBackend, parse_endpoint
from podmeter.adapters.identity.memory import MemoryIdentityBackend
from podmeter.model.identity import IdentityExhausted, IdentityKey

__all__ = ["etcd"]

TTL = 3  # etcd's minimum lease TTL with the fixture's election timeout is about 1 s


def key(i: int, ns: str = "ns") -> IdentityKey:
    return IdentityKey(ns, ("app", f"a{i}"))


async def test_memory_backend_lowest_free_and_idempotent() -> None:
    b = MemoryIdentityBackend(first=300, last=302)
    assert [await b.acquire(key(i)) for i in range(3)] == [300, 301, 302]
    assert await b.acquire(key(1)) == 301
    with pytest.raises(IdentityExhausted):
        await b.acquire(key(9))
    await b.release(key(0))
    await b.release(key(0))
    assert await b.acquire(key(9)) == 300
    assert await b.identities() == {300: key(9), 301: key(1), 302: key(2)}
    for k in (key(1), key(2), key(9)):
        await b.release(k)
    assert (dict(b.held()), await b.gc()) == ({}, 0)


def test_parse_endpoint() -> None:
    assert parse_endpoint("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_endpoint("etcd:4001") == ("etcd", 4001)
    assert parse_endpoint("https://etcd:2379") == ("etcd", 2379)  # TLS: tests/runtime/test_identity_etcd_tls.py
    with pytest.raises(ValueError, match="expected https://HOST:PORT"):
        parse_endpoint("ftp://etcd:2379")


@pytest.fixture
async def backends(etcd: EtcdServer) -> AsyncIterator[Callable[..., EtcdIdentityBackend]]:
    made: list[EtcdIdentityBackend] = []

    def make(**kw: object) -> EtcdIdentityBackend:
        b = EtcdIdentityBackend([etcd.endpoint], lease_ttl=TTL, timeout=3, **kw)  # type: ignore[arg-type]
        made.append(b)
        return b

    yield make
    for b in made:
        await b.close()


async def test_etcd_allocate_release_and_two_round_gc(backends: Callable[..., EtcdIdentityBackend]) -> None:
    a = backends(owner="a")
    await a.start()
    assert [await a.acquire(key(i)) for i in range(3)] == [256, 257, 258]
    assert await a.acquire(key(1)) == 257
    await a.release(key(1))
    assert await a.identities() == {256: key(0), 257: key(1), 258: key(2)}
    assert await a.gc() == 0  # first round only marks
    assert await a.gc() == 1  # second round removes the unreferenced master
    assert await a.identities() == {256: key(0), 258: key(2)}
    assert await a.acquire(key(7)) == 257  # lowest free first
    assert await a.references() == {key(0): {"a"}, key(2): {"a"}, key(7): {"a"}}


async def test_etcd_gc_spares_a_master_referenced_between_rounds(
    backends: Callable[..., EtcdIdentityBackend],
) -> None:
    a, b = backends(owner="a"), backends(owner="b")
    await a.start()
    await b.start()
    ident = await a.acquire(key(1))
    await a.release(key(1))
    assert await a.gc() == 0
    assert await b.acquire(key(1)) == ident  # referenced again before the second round
    assert await a.gc() == 0
    assert await a.gc() == 0
    assert await a.identities() == {ident: key(1)}


async def test_etcd_exhaustion_is_an_error_not_a_crash(backends: Callable[..., EtcdIdentityBackend]) -> None:
    a = backends(owner="a", first=1000, last=1001)
    await a.start()
    await a.acquire(key(1))
    await a.acquire(key(2))
    with pytest.raises(IdentityExhausted, match="1000-1001"):
        await a.acquire(key(3))
    await a.release(key(1))
    await a.gc()
    await a.gc()
    assert await a.acquire(key(3)) == 1000


async def test_two_operators_allocate_consistently(backends: Callable[..., EtcdIdentityBackend]) -> None:
    a, b = backends(owner="a"), backends(owner="b")
    await asyncio.gather(a.start(), b.start())
    keys = [key(i) for i in range(40)]

    async def run(backend: EtcdIdentityBackend, order: list[IdentityKey]) -> dict[IdentityKey, int]:
        return {k: await backend.acquire(k) for k in order}

    # Same keys in opposite orders and disjoint keys at the same time.
    got_a, got_b, only_a, only_b = await asyncio.gather(
        run(a, keys),
        run(b, keys[::-1]),
        run(a, [key(i, "x") for i in range(20)]),
        run(b, [key(i, "y") for i in range(20)]),
    )
    assert got_a == got_b  # one ID per key
    every = {**got_a, **only_a, **only_b}
    assert len(set(every.values())) == len(every) == 80  # never one ID for two keys
    assert await a.identities() == {v: k for k, v in every.items()}
    assert sorted(every.values()) == list(range(256, 336))  # no gaps left by races


HOLDER = """
import asyncio, sys
from podmeter.adapters.identity.etcd import EtcdIdentityBackend
from podmeter.model.identity import IdentityKey
async def main():
    b = EtcdIdentityBackend([sys.argv[1]], owner="victim", lease_ttl=int(sys.argv[2]))
    await b.start()
    for i in range(5):
        await b.acquire(IdentityKey("ns", ("app", f"a{i}")))
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_sigkilled_operator_references_expire(
    backends: Callable[..., EtcdIdentityBackend], etcd: EtcdServer
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, etcd.endpoint, str(TTL)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "ready"
        survivor = backends(owner="survivor")
        await survivor.start()
        assert await survivor.acquire(key(0)) == 256
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at = time.monotonic()
        refs = await survivor.references()
        assert refs[key(3)] == {"victim"}
        while await survivor.references() != {key(0): {"survivor"}}:
            assert time.monotonic() - killed_at < TTL + 3, "the victim's references did not expire"
            await asyncio.sleep(0.2)
        assert await survivor.gc() == 0
        assert await survivor.gc() == 4
        assert await survivor.identities() == {256: key(0)}
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def retry(backend: EtcdIdentityBackend, k: IdentityKey, seconds: float = 15.0) -> int:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await backend.acquire(k)
        except IdentityBackendError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_etcd_restart_mid_run(backends: Callable[..., EtcdIdentityBackend], etcd: EtcdServer) -> None:
    a, b = backends(owner="a"), backends(owner="b")
    await asyncio.gather(a.start(), b.start())
    before = {key(i): await a.acquire(key(i)) for i in range(10)}
    etcd.stop()
    with pytest.raises(IdentityBackendError):
        await b.acquire(key(0))
    etcd.start()
    # Both recover: existing keys keep their IDs, new keys get fresh ones, nothing is duplicated.
    for i in range(20):
        ident = await retry(b, key(i))
        if key(i) in before:
            assert ident == before[key(i)]
    after = {k: await retry(a, k) for k in [key(i) for i in range(20)]}
    assert {k: after[k] for k in before} == before
    assert len(set(after.values())) == 20
    assert await a.identities() == {v: k for k, v in after.items()}
    refs = await a.references()
    assert all(refs[k] == {"a", "b"} for k in after)


async def test_lost_lease_is_recovered(backends: Callable[..., EtcdIdentityBackend]) -> None:
    a = backends(owner="a")
    await a.start()
    ident = await a.acquire(key(1))
    await a._client.revoke_lease(a._lease_id)  # as if the store had expired it
    assert await a.references() == {}
    deadline = time.monotonic() + TTL + 3
    while await a.references() != {key(1): {"a"}}:
        assert time.monotonic() < deadline, "references were not re-registered"
        await asyncio.sleep(0.2)
    assert (a.leases_lost, a.ids_changed, dict(a.held())) == (1, 0, {key(1): ident})


async def test_bad_entries_in_the_store_are_counted_and_skipped(
    backends: Callable[..., EtcdIdentityBackend],
) -> None:
    a = backends(owner="a")
    await a.start()
    await a._client.put(b"/podmeter/identities/key/garbage", b"not-a-number")
    assert await a.acquire(key(1)) == 256
    assert await a.identities() == {256: key(1)}
    assert a.store_corrupt() == {"bad_key": 1}


async def test_a_corrupt_master_is_repaired_not_a_key_pending_forever(
    backends: Callable[..., EtcdIdentityBackend],
) -> None:
    a = backends(owner="a")
    await a.start()
    await a._client.put(b"/podmeter/identities/key/" + key(1).encode().encode(), b"oops")
    assert await a.acquire(key(1)) == 256  # the corrupt master is removed and the key gets a sound ID
    assert await a.acquire(key(2)) == 257  # other keys are unaffected
    assert a.store_corrupt() == {"not_a_number": 1}
    assert await a.identities() == {256: key(1), 257: key(2)}
