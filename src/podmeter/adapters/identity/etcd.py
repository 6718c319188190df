"""The ``etcd`` identity backend: IDs shared by every operator of a cluster, through an etcd v3 store.

Client: ``aetcd`` (asyncio, gRPC; works with etcd 3.4 and current protobuf/grpcio), connected by
:mod:`podmeter.adapters.identity.etcd_access` (TLS with client certificates, an etcd user).

Layout under a prefix (default ``/podmeter/identities/``)::

    id/<N>                     -> encoded key   master: ID N belongs to the key       (no lease)
    key/<encoded key>          -> N             reverse master: the key has ID N      (no lease)
    ref/<encoded key>/<owner>  -> N             one operator's reference              (owner's lease)

Both masters are created in one transaction that requires both to be absent, so one ID is never handed
out for two keys and one key never gets two IDs, whichever operators race. A reference is created in a
transaction that requires the pair to still stand, both ways (``key/<k>`` unchanged since it was read and
``id/<N>`` naming ``k``), so it can never point at a collected ID, nor at an ID another key owns. References
are bound to the operator's lease: when an operator dies its references expire by themselves. The
garbage collector removes a master pair without references in two rounds: a pair is marked on one round
and removed on the next only if it is still unreferenced and unchanged (compared inside the deleting
transaction, so a reference taken in between wins).

Nothing read is trusted (:mod:`podmeter.adapters.identity.etcd_audit`): a master that is not half of a
consistent pair is corrupt; it is logged and counted once per entry (``store_corrupt()``), never used,
and removed guarded by its revision: by the operator that needs the key (so the key gets a sound ID at
once) and by the leader's GC (everything else). Locally ``held()`` never maps two keys to one ID: if the
store pairs an ID this operator holds for one key with another key, the first key gets a fresh ID.

An encoded key is a complete JSON value, so ``ref/<k>/`` never prefixes the references of another key.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.utils

from podmeter.adapters.identity.base import IdentityBackendError
from podmeter.adapters.identity.etcd_access import EtcdAccess, EtcdAccessError, explain, open_client
from podmeter.adapters.identity.etcd_access import parse_endpoint as parse_endpoint_url
from podmeter.adapters.identity.etcd_audit import (
    Audit,
    Corrupt,
    Entry,
    Layout,
    Pair,
    audit,
    id_problem,
    parse_id,
    parse_key,
)
from podmeter.model.compaction import PeakTracker
from podmeter.model.identity import (
    DEFAULT_FIRST_ID,
    DEFAULT_LAST_ID,
    IdentityError,
    IdentityExhausted,
    IdentityKey,
    IdPool,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/podmeter/identities/"
MAX_ATTEMPTS = 32
T = TypeVar("T")

GRPC_OPTIONS = {
    # Reconnect quickly after the store comes back (gRPC's default backoff grows to two minutes).
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
    # A scan of the store is one answer: 65,536 pairs with long label sets exceed gRPC's default 4 MiB.
    "grpc.max_receive_message_length": -1,
}


def default_owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http(s)://host:port`` or ``host:port`` -> (host, port); anything else is a clear error."""
    endpoint = parse_endpoint_url(url)
    return endpoint.host, endpoint.port


def _entry(kv: Any) -> Entry:
    return Entry(kv.key, kv.value, kv.mod_revision, kv.lease)


def _is_auth_refresh(exc: aetcd.exceptions.ClientError) -> bool:
    """etcd no longer accepts the connection's token (expired, or the auth store changed): authenticate again."""
    text = str(exc).lower()
    return isinstance(exc, aetcd.exceptions.UnauthenticatedError) or "auth store is old" in text


class EtcdIdentityBackend:
    """Identities in etcd; this object holds one operator's references (see the module docstring).

    Invariants: a key is in ``held()`` iff this operator created ``ref/<k>/<owner>`` under its current
    lease, for an ID whose pair stood when the reference was made, and has not released it; no two held
    keys share an ID (``_by_id`` is the inverse of ``_held``). When the lease is found lost, every held key
    is re-referenced under a new lease (re-allocated if its ID was collected meanwhile; ``ids_changed``
    counts those). ``_pool`` marks every ID this operator knows to be allocated in the store; it may lag
    other operators' GC and is refreshed from the store before an allocation is declared exhausted.
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
        access: EtcdAccess | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("the etcd backend needs at least one endpoint")
        self._access = access or EtcdAccess()
        parsed = self._access.endpoints(endpoints)  # EtcdAccessError (a ValueError) if inconsistent
        self._endpoints = [(e.host, e.port) for e in parsed]
        self._targets = parsed
        self._endpoint = 0
        self.owner = owner or default_owner()
        self._layout = Layout(prefix.encode())
        self.lease_ttl = lease_ttl
        self._timeout = timeout
        self._first, self._last = first, last
        self._pool = IdPool(first, last)
        self._held: dict[IdentityKey, int] = {}
        self._by_id: dict[int, IdentityKey] = {}
        self._peak = PeakTracker()
        self._lease_id = 0
        self._lock = asyncio.Lock()
        self._client: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # clients dropped, closed once their requests timed out
        self._gc_marked: dict[bytes, Pair] = {}
        self._rng = random.Random()
        self._seen_corrupt: dict[bytes, int] = {}  # store key -> mod_revision of corrupt entries counted
        self.corrupt: collections.Counter[str] = collections.Counter()  # kind -> entries found
        self.repaired = 0
        self._stale: set[IdentityKey] = set()  # held keys whose reference went with a lost lease
        self.ids_changed = 0
        self.leases_lost = 0

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, take a lease, learn the allocated IDs; may be retried after IdentityBackendError."""
        if not self._lease_id:
            await self._call(self._grant_lease)
        await self._call(self._refresh_pool)
        if self._keepalive is None:
            self._keepalive = asyncio.create_task(self._keep_lease(), name=f"etcd-lease-{self.owner}")

    @property
    def keepalive_task(self) -> asyncio.Task[None] | None:
        """The lease keepalive, once started: the operator supervises it (it retries every error itself,
        so it ends only if cancelled or hit by something no retry can help; then the references it keeps
        alive would expire unseen, failure mode F15)."""
        return self._keepalive

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        if self._client is not None:
            if self._lease_id:
                with contextlib.suppress(aetcd.exceptions.ClientError, OSError):
                    await self._client.revoke_lease(self._lease_id)  # clean exit: references go at once
            await self._client.close()
            self._client = None
        for task in list(self._closing):  # dropped clients: closed now, without waiting for their requests
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def _c(self) -> Any:
        """The client of the current endpoint, made (files read) when there is none."""
        if self._client is None:
            self._client = open_client(self._targets[self._endpoint], self._access, timeout=self._timeout,
                                       options=GRPC_OPTIONS)
        return self._client

    async def _drop_client(self, rotate: bool) -> None:
        """Forget the client: the next call connects again (re-reading the files, authenticating anew).

        The old client is closed only once every request still on it has timed out: closing a gRPC channel
        cancels its requests, and their callers would see a CancelledError, as if they were cancelled."""
        old, self._client = self._client, None
        if rotate:
            self._endpoint = (self._endpoint + 1) % len(self._targets)
        if old is not None:
            task = asyncio.create_task(self._close_later(old, self._timeout + 1), name="etcd-client-close")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_later(client: Any, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:  # also when cancelled by close(): the channel is closed at once then
            with contextlib.suppress(Exception):
                await client.close()

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one store operation; a failure becomes IdentityBackendError with words to act on.

        A token etcd no longer accepts is renewed and the operation tried once more; after a connection
        failure or a refused login the next call connects again (the next endpoint, if several)."""
        for attempt in (1, 2):
            try:
                return await fn()
            except aetcd.exceptions.ClientError as exc:
                target = self._targets[self._endpoint]
                if attempt == 1 and _is_auth_refresh(exc) and self._access.username:
                    log.info("etcd %s: authenticating again (%s)", target, exc)
                    await self._drop_client(rotate=False)
                    continue
                failed = isinstance(exc, aetcd.exceptions.ConnectionFailedError)
                if failed or _is_auth_refresh(exc) or isinstance(exc, aetcd.exceptions.InvalidArgumentError):
                    await self._drop_client(rotate=failed and len(self._targets) > 1)
                raise IdentityBackendError(explain(exc, target, self._access)) from exc
        raise AssertionError("unreachable")

    # -- the protocol --------------------------------------------------------------------------------

    def held(self) -> Mapping[IdentityKey, int]:
        return self._held

    def store_corrupt(self) -> Mapping[str, int]:
        return self.corrupt

    async def acquire(self, key: IdentityKey) -> int:
        async with self._lock:
            ident = self._held.get(key)
            if ident is None:
                ident = await self._call(lambda: self._acquire(key))
                await self._hold(key, ident)
                self._peak.grew_to(len(self._held))
            return ident

    async def release(self, key: IdentityKey) -> None:
        async with self._lock:
            if key not in self._held:
                return
            enc = key.encode().encode()
            await self._call(lambda: self._c.delete(self._layout.ref_key(enc, self.owner)))
            self._unrecord(key)
            if self._peak.should_rebuild(len(self._held)):
                self._held, self._by_id = dict(self._held), dict(self._by_id)

    async def identities(self) -> dict[int, IdentityKey]:
        """Every ID of a consistent pair in the store (all operators), with its key."""
        found = await self._call(lambda: self._scan(with_refs=False))
        return {pair.ident: pair.key for pair in found.pairs.values()}

    async def references(self) -> dict[IdentityKey, set[str]]:
        """Every valid reference in the store: key -> owners (for tests and /debug)."""
        found = await self._call(lambda: self._scan(with_refs=True))
        out: dict[IdentityKey, set[str]] = {}
        for enc, owners in found.references.items():
            key = parse_key(enc)
            if key is not None:
                out[key] = set(owners)
        return out

    async def gc(self) -> int:
        async with self._lock:
            return await self._call(self._gc)

    # -- what this operator holds ----------------------------------------------------------------------

    def _record(self, key: IdentityKey, ident: int) -> None:
        self._unrecord(key)
        self._held[key] = ident
        self._by_id[ident] = key

    def _unrecord(self, key: IdentityKey) -> None:
        self._stale.discard(key)
        old = self._held.pop(key, None)
        if old is not None and self._by_id.get(old) == key:
            del self._by_id[old]

    async def _hold(self, key: IdentityKey, ident: int) -> None:
        """Hold ``key`` as ``ident``, which the store just paired with it. A key this operator held as
        ``ident`` until now has lost its pair (the store was rewritten): it gets a fresh ID."""
        for _ in range(MAX_ATTEMPTS):
            other = self._by_id.get(ident)
            self._unrecord(key)
            if other is not None and other != key:
                self._by_id.pop(ident)  # `other` keeps its entry in _held until it is re-acquired below
            self._held[key], self._by_id[ident] = ident, key
            if other is None or other == key:
                return
            self.ids_changed += 1
            log.error("etcd identity store: ID %d is now paired with %s, but this operator held it for %s; "
                      "%s gets a new ID", ident, key, other, other)
            try:
                ident = await self._call(lambda other=other: self._acquire(other))  # type: ignore[misc]
            except IdentityError as exc:
                await self._forget(other, f"no sound ID now: {exc}")
                return
            key = other
        await self._forget(key, "its ID keeps moving (is something rewriting the store?)")

    async def _forget(self, key: IdentityKey, why: str) -> None:
        """Stop holding ``key`` (the operator's sweep acquires it again if a pod still wants it)."""
        log.warning("etcd identity store: %s dropped: %s", key, why)
        self._unrecord(key)
        with contextlib.suppress(aetcd.exceptions.ClientError, IdentityBackendError):
            await self._c.delete(self._layout.ref_key(key.encode().encode(), self.owner))

    async def _verify_held(self, found: Audit) -> None:
        """Every held key must still be its pair in the store; those that are not are acquired anew."""
        for key, ident in list(self._held.items()):
            if self._held.get(key) != ident:
                continue  # moved by an earlier step of this loop
            pair = found.pairs.get(key.encode().encode())
            if pair is not None and pair.ident == ident:
                continue
            log.error("etcd identity store: %s was held as %d, which the store no longer pairs with it; "
                      "acquiring it again", key, ident)
            try:
                new = await self._call(lambda key=key: self._acquire(key))  # type: ignore[misc]
            except IdentityError as exc:
                await self._forget(key, f"no sound ID now: {exc}")
                continue
            self.ids_changed += new != ident
            await self._hold(key, new)

    # -- allocation --------------------------------------------------------------------------------------

    async def _acquire(self, key: IdentityKey) -> int:
        """An ID the store pairs with ``key`` now, referenced by this operator."""
        enc = key.encode().encode()
        refreshed = False
        for attempt in range(MAX_ATTEMPTS):
            if attempt:  # a lost race: jitter, so that two operators do not collide in lockstep again
                await asyncio.sleep(self._rng.uniform(0, 0.002 * attempt))
            found = await self._c.get(self._layout.master_key(enc))
            if found is not None:
                master = _entry(found)
                problem = id_problem(master.value, self._first, self._last)
                if problem is not None:
                    await self._repair(Corrupt(problem[0], master, f"the master of {key}: {problem[1]}"))
                    continue
                outcome = await self._reference(key, enc, int(master.value), master)
                if isinstance(outcome, Corrupt):
                    await self._repair(outcome)
                elif outcome is not None:
                    return outcome
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

    async def _reference(self, key: IdentityKey, enc: bytes, ident: int, master: Entry) -> int | Corrupt | None:
        """Reference ``ident`` if its pair stands; the master as Corrupt if its partner does not name it
        (in one revision); None if the master changed since it was read (a race: read again)."""
        t = self._c.transactions
        id_key = self._layout.id_key(ident)
        ok, responses = await self._c.transaction(
            compare=[t.mod(master.key) == master.mod_revision, t.value(id_key) == enc],
            success=[t.put(self._layout.ref_key(enc, self.owner), str(ident).encode(), lease=self._lease_id)],
            failure=[t.get(master.key), t.get(id_key)],
        )
        if ok:
            self._mark_taken(ident)
            return ident
        masters, partners = responses
        if not masters or masters[0][1].mod_revision != master.mod_revision:
            return None
        if partners:
            named = parse_key(partners[0][0])
            return Corrupt("duplicate_id" if named is not None else "unpaired", master,
                           f"{key} claims ID {ident}, which id/{ident} gives to {named or partners[0][0][:60]!r}")
        return Corrupt("unpaired", master, f"{key} claims ID {ident}, which has no id/{ident}")

    async def _claim(self, enc: bytes, ident: int) -> bool:
        """Create both masters and our reference at once; False if the ID or the key was taken."""
        t = self._c.transactions
        value = str(ident).encode()
        id_key, master_key = self._layout.id_key(ident), self._layout.master_key(enc)
        ok, _ = await self._c.transaction(
            compare=[t.create(id_key) == 0, t.create(master_key) == 0],
            success=[
                t.put(id_key, enc),
                t.put(master_key, value),
                t.put(self._layout.ref_key(enc, self.owner), value, lease=self._lease_id),
            ],
            failure=[],
        )
        if not ok:
            await self._refresh_pool()  # another operator took the ID or the key: learn all it took
        return bool(ok)

    def _mark_taken(self, ident: int) -> None:
        if self._first <= ident <= self._last and not self._pool.in_use(ident):
            self._pool.take_specific(ident)

    async def _refresh_pool(self) -> None:
        pool = IdPool(self._first, self._last)
        for ident in sorted((await self._scan(with_refs=False)).taken):
            pool.take_specific(ident)
        self._pool = pool

    # -- reading without trusting --------------------------------------------------------------------------

    async def _scan(self, *, with_refs: bool) -> Audit:
        """Both masters (and the references) read in one transaction, so in one revision, and audited."""
        t = self._c.transactions
        layout = self._layout
        prefixes = [layout.ids, layout.keys, *([layout.refs] if with_refs else [])]
        _, responses = await self._c.transaction(
            compare=[], success=[t.get(p, aetcd.utils.prefix_range_end(p)) for p in prefixes], failure=[])
        entries = [[_entry(kv) for _, kv in found] for found in responses]
        found = audit(layout, entries[0], entries[1], entries[2] if with_refs else None,
                      first=self._first, last=self._last)
        for corrupt in found.corrupt:
            self._note(corrupt)
        seen = {c.entry.key for c in found.corrupt}
        if not with_refs:
            seen |= {k for k in self._seen_corrupt if k.startswith(layout.refs)}
        self._seen_corrupt = {k: v for k, v in self._seen_corrupt.items() if k in seen}
        return found

    def _note(self, corrupt: Corrupt) -> None:
        """Log and count a corrupt entry, once per entry and revision however often it is read."""
        entry = corrupt.entry
        if self._seen_corrupt.get(entry.key) == entry.mod_revision:
            return
        self._seen_corrupt[entry.key] = entry.mod_revision
        self.corrupt[corrupt.kind] += 1
        log.error("etcd identity store: corrupt entry %r (%s): %s; not used", entry.key[:120], corrupt.kind,
                  corrupt.why)

    async def _repair(self, corrupt: Corrupt) -> bool:
        """Remove a corrupt entry unless it changed since it was read (then it is judged again later)."""
        self._note(corrupt)
        t = self._c.transactions
        entry = corrupt.entry
        ok, _ = await self._c.transaction(
            compare=[t.mod(entry.key) == entry.mod_revision], success=[t.delete(entry.key)], failure=[])
        if ok:
            self.repaired += 1
            log.warning("etcd identity store: removed corrupt entry %r (%s)", entry.key[:120], corrupt.kind)
            if entry.key.startswith(self._layout.ids):  # no pair used that ID (a pair needs its id/N)
                ident = parse_id(entry.key[len(self._layout.ids):])
                if ident is not None and self._first <= ident <= self._last:
                    self._pool.release(ident)
        return bool(ok)

    # -- garbage collection ------------------------------------------------------------------------------

    async def _gc(self) -> int:
        found = await self._scan(with_refs=True)
        for corrupt in found.corrupt:
            await self._repair(corrupt)
        await self._verify_held(found)
        unreferenced = {enc: p for enc, p in found.pairs.items() if enc not in found.references}
        removed = 0
        for enc, pair in unreferenced.items():
            if self._gc_marked.get(enc) == pair and await self._remove_pair(enc, pair):
                removed += 1
        self._gc_marked = {e: p for e, p in unreferenced.items() if self._gc_marked.get(e) != p}
        return removed

    async def _remove_pair(self, enc: bytes, pair: Pair) -> bool:
        t = self._c.transactions
        refs = self._layout.ref_prefix(enc)
        master_key, id_key = self._layout.master_key(enc), self._layout.id_key(pair.ident)
        ok, _ = await self._c.transaction(
            compare=[
                t.mod(master_key) == pair.mod_revision,
                t.value(id_key) == enc,
                t.create(refs, range_end=aetcd.utils.prefix_range_end(refs)) == 0,
            ],
            success=[t.delete(master_key), t.delete(id_key)],
            failure=[],
        )
        if ok:
            self._pool.release(pair.ident)
        return bool(ok)

    # -- the lease -------------------------------------------------------------------------------------

    async def _grant_lease(self) -> None:
        lease = await self._c.lease(self.lease_ttl)
        self._lease_id = lease.id

    async def _keep_lease(self) -> None:
        period = max(0.5, self.lease_ttl / 3)
        while True:
            await asyncio.sleep(period)
            try:
                reply = await self._call(lambda: self._c.refresh_lease(self._lease_id))
                if reply is None or reply.TTL <= 0 or self._stale:
                    await self._recover_lease(lost=reply is None or reply.TTL <= 0)
            except EtcdAccessError as exc:
                log.warning("etcd lease %x keepalive: %s", self._lease_id, exc)
            except IdentityBackendError as exc:
                log.warning("etcd lease %x keepalive failed, retrying: %s", self._lease_id, exc)
            except Exception:  # this loop keeps the references alive: it must outlive any surprise
                log.exception("etcd lease %x keepalive: unexpected error, retrying", self._lease_id)

    async def _recover_lease(self, lost: bool) -> None:
        """The lease expired (store unreachable for longer than its TTL): re-reference everything held.

        If the store fails again half-way, the keys not yet re-referenced stay stale and the next keepalive
        continues with them, under the new lease."""
        async with self._lock:
            if lost:
                self.leases_lost += 1
                log.warning("etcd lease %x lost; re-registering %d references", self._lease_id, len(self._held))
                await self._call(self._grant_lease)
                self._stale = set(self._held)
            for key in list(self._stale):
                old = self._held.get(key)
                if old is None or key not in self._stale:
                    continue  # released or moved by an earlier step of this loop
                new = await self._call(lambda key=key: self._acquire(key))  # type: ignore[misc]
                self._stale.discard(key)
                await self._hold(key, new)
                self.ids_changed += new != old
