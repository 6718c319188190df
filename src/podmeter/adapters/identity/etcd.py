"""The ``etcd`` identity backend: IDs shared by every operator of a cluster, through an etcd v3 store.

Client: ``aetcd`` (asyncio, gRPC, maintained, works with etcd 3.4 and current protobuf/grpcio).

Layout under a prefix (default ``/podmeter/identities/``)::

    id/<N>                     -> encoded key   master: ID N belongs to the key       (no lease)
    key/<encoded key>          -> N             reverse master: the key has ID N      (no lease)
    ref/<encoded key>/<owner>  -> N             one operator's reference              (owner's lease)

Both masters are created in one transaction that requires both to be absent, so one ID is never handed
out for two keys and one key never gets two IDs, whichever operators race. A reference is created in a
transaction that requires ``key/<k>`` to still hold N, so it can never point at a collected ID. References
are bound to the operator's lease: when an operator dies its references expire by themselves. The
garbage collector removes a master pair without references in two rounds: a pair is marked on one round
and removed on the next only if it is still unreferenced and unchanged (compared inside the deleting
transaction, so a reference taken in between wins).

An encoded key is a complete JSON value, so ``ref/<k>/`` never prefixes the references of another key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.utils

from podmeter.adapters.identity.base import IdentityBackendError
from podmeter.model.compaction import PeakTracker
from podmeter.model.identity import (
    DEFAULT_FIRST_ID,
    DEFAULT_LAST_ID,
    BadIdentityKey,
    IdentityExhausted,
    IdentityKey,
    IdPool,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/podmeter/identities/"
MAX_ATTEMPTS = 32
T = TypeVar("T")

# Reconnect quickly after the store comes back (gRPC's default backoff grows to two minutes).
GRPC_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
}


def default_owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http://host:port`` or ``host:port`` -> (host, port); anything else is a clear error."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.scheme not in ("http", "") or not parts.hostname:
        raise ValueError(f"etcd endpoint {url!r}: expected http://HOST:PORT (TLS is not supported)")
    return parts.hostname, parts.port or 2379


@dataclass(frozen=True, slots=True)
class _Master:
    ident: int
    mod_revision: int


class EtcdIdentityBackend:
    """Identities in etcd; this object holds one operator's references (see the module docstring).

    Invariants: a key is in ``held()`` iff this operator created ``ref/<k>/<owner>`` under its current
    lease and has not released it; when the lease is found lost, every held key is re-referenced under a
    new lease (re-allocated if its ID was collected meanwhile; ``ids_changed`` counts those). ``_pool``
    marks every ID this operator knows to be allocated in the store; it may lag other operators' GC and
    is refreshed from the store before an allocation is declared exhausted.
    """

    name = "etcd"

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        owner: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        lease_ttl: int = 10,
        first: int = DEFAULT_FIRST_ID,
        last: int = DEFAULT_LAST_ID,
        timeout: float = 5.0,
    ) -> None:
        if not endpoints:
            raise ValueError("the etcd backend needs at least one endpoint")
        self._endpoints = [parse_endpoint(e) for e in endpoints]
        self._endpoint = 0
        self.owner = owner or default_owner()
        self._prefix = prefix.encode()
        self.lease_ttl = lease_ttl
        self._timeout = timeout
        self._first, self._last = first, last
        self._pool = IdPool(first, last)
        self._held: dict[IdentityKey, int] = {}
        self._peak = PeakTracker()
        self._lease_id = 0
        self._lock = asyncio.Lock()
        self._client: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._gc_marked: dict[bytes, _Master] = {}
        self._rng = random.Random()
        self.ids_changed = 0
        self.leases_lost = 0
        self.bad_entries = 0

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, take a lease, learn the allocated IDs; may be retried after IdentityBackendError."""
        if self._client is None:
            self._client = self._new_client()
        if not self._lease_id:
            await self._call(self._grant_lease)
        await self._call(self._refresh_pool)
        if self._keepalive is None:
            self._keepalive = asyncio.create_task(self._keep_lease(), name=f"etcd-lease-{self.owner}")

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        if self._client is not None:
            with contextlib.suppress(aetcd.exceptions.ClientError, OSError):
                await self._client.revoke_lease(self._lease_id)  # clean exit: references go at once
            await self._client.close()
            self._client = None

    def _new_client(self) -> Any:
        host, port = self._endpoints[self._endpoint]
        return aetcd.Client(host=host, port=port, timeout=int(max(1, self._timeout)), options=GRPC_OPTIONS)

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one store operation; an unreachable store becomes IdentityBackendError (next endpoint)."""
        try:
            return await fn()
        except aetcd.exceptions.ClientError as exc:
            if isinstance(exc, aetcd.exceptions.ConnectionFailedError) and len(self._endpoints) > 1:
                await self._client.close()
                self._endpoint = (self._endpoint + 1) % len(self._endpoints)
                self._client = self._new_client()
            raise IdentityBackendError(f"etcd: {type(exc).__name__}: {exc}") from exc

    # -- keys --------------------------------------------------------------------------------------

    def _k(self, *parts: bytes) -> bytes:
        return self._prefix + b"/".join(parts)

    def _id_key(self, ident: int) -> bytes:
        return self._k(b"id", str(ident).encode())

    def _master_key(self, enc: bytes) -> bytes:
        return self._k(b"key", enc)

    def _ref_prefix(self, enc: bytes) -> bytes:
        return self._k(b"ref", enc) + b"/"

    def _ref_key(self, enc: bytes) -> bytes:
        return self._ref_prefix(enc) + self.owner.encode()

    # -- the protocol --------------------------------------------------------------------------------

    def held(self) -> Mapping[IdentityKey, int]:
        return self._held

    async def acquire(self, key: IdentityKey) -> int:
        async with self._lock:
            ident = self._held.get(key)
            if ident is None:
                ident = await self._call(lambda: self._acquire(key))
                self._held[key] = ident
                self._peak.grew_to(len(self._held))
            return ident

    async def release(self, key: IdentityKey) -> None:
        async with self._lock:
            if key not in self._held:
                return
            enc = key.encode().encode()
            await self._call(lambda: self._client.delete(self._ref_key(enc)))
            del self._held[key]
            if self._peak.should_rebuild(len(self._held)):
                self._held = dict(self._held)

    async def identities(self) -> dict[int, IdentityKey]:
        masters = await self._call(self._masters)
        out: dict[int, IdentityKey] = {}
        for enc, master in masters.items():
            with contextlib.suppress(BadIdentityKey):
                out[master.ident] = IdentityKey.decode(enc.decode())
        return out

    async def references(self) -> dict[IdentityKey, set[str]]:
        """Every reference in the store: key -> owners (for tests and /debug)."""
        out: dict[IdentityKey, set[str]] = {}
        for enc, owner in await self._call(self._refs):
            with contextlib.suppress(BadIdentityKey):
                out.setdefault(IdentityKey.decode(enc.decode()), set()).add(owner)
        return out

    async def gc(self) -> int:
        async with self._lock:
            return await self._call(self._gc)

    # -- allocation --------------------------------------------------------------------------------------

    async def _acquire(self, key: IdentityKey) -> int:
        enc = key.encode().encode()
        refreshed = False
        for attempt in range(MAX_ATTEMPTS):
            if attempt:  # a lost race: jitter, so that two operators do not collide in lockstep again
                await asyncio.sleep(self._rng.uniform(0, 0.002 * attempt))
            existing = await self._client.get(self._master_key(enc))
            if existing is not None:
                ident = self._parse_id(existing.value)
                if ident is None:
                    raise IdentityBackendError(f"etcd: the master of {key} holds no ID; repair the store")
                if await self._reference(enc, ident):
                    return ident
                continue
            try:
                candidate = self._pool.take()
            except IdentityExhausted:
                if refreshed:
                    raise
                await self._refresh_pool()
                refreshed = True
                continue
            if await self._claim(enc, candidate):
                return candidate
        raise IdentityBackendError(f"etcd: no ID for {key} after {MAX_ATTEMPTS} attempts (contention)")

    async def _reference(self, enc: bytes, ident: int) -> bool:
        """Reference an existing ID; False if its master changed in between (collected)."""
        t = self._client.transactions
        ok, _ = await self._client.transaction(
            compare=[t.value(self._master_key(enc)) == str(ident).encode()],
            success=[t.put(self._ref_key(enc), str(ident).encode(), lease=self._lease_id)],
            failure=[],
        )
        if ok:
            self._mark_taken(ident)
        return bool(ok)

    async def _claim(self, enc: bytes, ident: int) -> bool:
        """Create both masters and our reference at once; False if the ID or the key was taken."""
        t = self._client.transactions
        value = str(ident).encode()
        ok, _ = await self._client.transaction(
            compare=[t.create(self._id_key(ident)) == 0, t.create(self._master_key(enc)) == 0],
            success=[
                t.put(self._id_key(ident), enc),
                t.put(self._master_key(enc), value),
                t.put(self._ref_key(enc), value, lease=self._lease_id),
            ],
            failure=[],
        )
        if not ok:
            await self._refresh_pool()  # another operator took the ID or the key: learn all it took
        return bool(ok)

    def _mark_taken(self, ident: int) -> None:
        if self._first <= ident <= self._last and not self._pool.in_use(ident):
            self._pool.take_specific(ident)

    def _parse_id(self, raw: bytes) -> int | None:
        try:
            return int(raw)
        except ValueError:
            self.bad_entries += 1
            log.error("etcd identity store: master value %r is not an ID; skipped", raw[:40])
            return None

    async def _refresh_pool(self) -> None:
        pool = IdPool(self._first, self._last)
        for master in (await self._masters()).values():
            if self._first <= master.ident <= self._last and not pool.in_use(master.ident):
                pool.take_specific(master.ident)
        self._pool = pool

    async def _masters(self) -> dict[bytes, _Master]:
        base = self._k(b"key") + b"/"
        out: dict[bytes, _Master] = {}
        for kv in await self._client.get_prefix(base):
            ident = self._parse_id(kv.value)
            if ident is not None:
                out[kv.key[len(base) :]] = _Master(ident, kv.mod_revision)
        return out

    async def _refs(self) -> list[tuple[bytes, str]]:
        base = self._k(b"ref") + b"/"
        out = []
        for kv in await self._client.get_prefix(base, keys_only=True):
            enc, _, owner = kv.key[len(base) :].rpartition(b"/")
            out.append((enc, owner.decode(errors="replace")))
        return out

    # -- garbage collection ------------------------------------------------------------------------------

    async def _gc(self) -> int:
        masters = await self._masters()
        referenced = {enc for enc, _ in await self._refs()}
        unreferenced = {enc: m for enc, m in masters.items() if enc not in referenced}
        removed = 0
        for enc, master in unreferenced.items():
            if self._gc_marked.get(enc) == master and await self._remove_master(enc, master):
                removed += 1
        self._gc_marked = {e: m for e, m in unreferenced.items() if self._gc_marked.get(e) != m}
        return removed

    async def _remove_master(self, enc: bytes, master: _Master) -> bool:
        t = self._client.transactions
        refs = self._ref_prefix(enc)
        ok, _ = await self._client.transaction(
            compare=[
                t.mod(self._master_key(enc)) == master.mod_revision,
                t.create(refs, range_end=aetcd.utils.prefix_range_end(refs)) == 0,
            ],
            success=[t.delete(self._master_key(enc)), t.delete(self._id_key(master.ident))],
            failure=[],
        )
        if ok:
            self._pool.release(master.ident)
        return bool(ok)

    # -- the lease -------------------------------------------------------------------------------------

    async def _grant_lease(self) -> None:
        lease = await self._client.lease(self.lease_ttl)
        self._lease_id = lease.id

    async def _keep_lease(self) -> None:
        period = max(0.5, self.lease_ttl / 3)
        while True:
            await asyncio.sleep(period)
            try:
                reply = await self._client.refresh_lease(self._lease_id)
                if reply is None or reply.TTL <= 0:
                    await self._recover_lease()
            except aetcd.exceptions.ClientError as exc:
                log.warning("etcd lease %x keepalive failed: %s", self._lease_id, exc)
            except IdentityBackendError as exc:
                log.warning("etcd lease recovery failed, retrying: %s", exc)

    async def _recover_lease(self) -> None:
        """The lease expired (store unreachable for longer than its TTL): re-reference everything held."""
        async with self._lock:
            self.leases_lost += 1
            log.warning("etcd lease %x lost; re-registering %d references", self._lease_id, len(self._held))
            await self._call(self._grant_lease)
            for key, old in list(self._held.items()):
                new = await self._call(lambda key=key: self._acquire(key))  # type: ignore[misc]
                self._held[key] = new
                self.ids_changed += new != old
