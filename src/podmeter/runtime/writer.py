"""The one writer: applies store changes to the view and pushes the difference to the datapath.

Only the writer mutates the view and the datapath's filter (the agent runs it in one task; tests drive it
directly). It is synchronous; the asyncio wrapping lives in the agent.

Capacity rule (documented in docs/agent.md): when more IPs are desired than the filter holds, the filter
holds desired IPs only, and the ones that wait (``pending``) are those that became desired last; an IP
that waits enters as soon as a slot frees, oldest waiter first. An insert is attempted only when the
writer counts a free slot, so an insert that cannot succeed is never retried in a loop; if the kernel
still says the map is full (entries the writer does not know about), inserts stop until the next resync
has removed those entries.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from podmeter.model.datapath import Datapath, DatapathError, Direction, FilterFull, Traffic
from podmeter.model.records import Namespace, Pod
from podmeter.model.view import NodeView, ReplaceResult

log = logging.getLogger("podmeter.writer")

# Called with the IPs that left the filter and their last counters (read and removed from the datapath).
ReleaseHook = Callable[[list[str], dict[tuple[str, Direction], Traffic]], None]


@dataclass
class WriterStats:
    """Counters exported as metrics; they only ever grow."""

    drift_repaired: Counter[str] = field(default_factory=Counter)  # kind: leaked | missing
    write_errors: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op, errno)
    inserts: int = 0
    deletes: int = 0
    resyncs: int = 0


@dataclass(frozen=True, slots=True)
class Repairs:
    """What one resync repaired: entries found in the kernel that nobody wants, and wanted ones missing."""

    leaked: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()


class Writer:
    """Keeps the datapath's filter equal to the view's desired filter (within capacity).

    Invariants, after :meth:`flush` returns without datapath errors:
    * ``installed`` is what the writer has written and not removed; it is a subset of the desired IPs;
    * ``pending`` holds exactly the desired IPs that are not installed, oldest first;
    * ``len(installed) == min(capacity, len(desired))`` unless the kernel refused an insert (``blocked``).
    """

    def __init__(self, view: NodeView, datapath: Datapath, on_release: ReleaseHook | None = None) -> None:
        self.view = view
        self.datapath = datapath
        self.installed: set[str] = set()
        self.pending: dict[str, None] = {}
        self.retry_deletes: dict[str, None] = {}
        self.blocked = False  # the kernel said full while we counted room: wait for a resync
        self.stats = WriterStats()
        self._on_release = on_release

    # --- store changes (delegated to the view; the flush pushes the result) -------------------

    def upsert_pod(self, pod: Pod) -> bool:
        return self.view.upsert_pod(pod)

    def delete_pod(self, uid: str) -> bool:
        return self.view.delete_pod(uid)

    def replace_pods(self, pods: Iterable[Pod], keep: Collection[str] = ()) -> ReplaceResult:
        return self.view.replace_pods(pods, keep)

    def upsert_namespace(self, namespace: Namespace) -> bool:
        return self.view.upsert_namespace(namespace)

    def delete_namespace(self, name: str) -> bool:
        return self.view.delete_namespace(name)

    def replace_namespaces(self, namespaces: Iterable[Namespace], keep: Collection[str] = ()) -> ReplaceResult:
        return self.view.replace_namespaces(namespaces, keep)

    # --- pushing to the datapath --------------------------------------------------------------

    @property
    def overflow(self) -> int:
        """Desired IPs that do not fit in the filter."""
        return len(self.pending)

    @property
    def dirty(self) -> bool:
        """True while some work is waiting for a flush."""
        return bool(self.view.desired.dirty or self.retry_deletes or (self.pending and self._room() > 0))

    def flush(self) -> bool:
        """Push every crossing since the last flush; True if the datapath took everything it was given."""
        to_delete = self._sort_dirty()
        ok = self._delete(to_delete)
        return self._fill() and ok

    def resync(self) -> Repairs:
        """Read what the datapath really holds and repair drift both ways; count the repairs."""
        self.stats.resyncs += 1
        self._delete(self._sort_dirty())  # inserts wait until we know what is there (a restart adopts)
        actual = self.datapath.contents()
        desired = self.view.desired
        leaked = tuple(sorted(ip for ip in actual if ip not in desired))
        missing = tuple(sorted(ip for ip in self.installed if ip not in actual))
        adopted = {ip for ip in actual if ip in desired and ip not in self.installed}
        self.installed = (self.installed - set(missing)) | adopted
        self.pending = dict.fromkeys(missing) | {ip: None for ip in self.pending if ip not in adopted}
        self.blocked = False
        self._count_repairs(leaked, missing)
        self.installed |= set(leaked)  # so that _delete treats them as ours to remove
        self._delete(list(leaked))
        self._fill()
        return Repairs(leaked, missing)

    # --- internals ----------------------------------------------------------------------------

    def _sort_dirty(self) -> list[str]:
        """Route each crossed IP: to delete if installed and undesired, to pending if desired and absent."""
        to_delete = list(self.retry_deletes)
        self.retry_deletes = {}
        desired = self.view.desired
        for ip in desired.take_dirty():
            if ip in desired:
                if ip not in self.installed:
                    self.pending[ip] = None
            else:
                self.pending.pop(ip, None)
                if ip in self.installed:
                    to_delete.append(ip)
        return to_delete

    def _delete(self, ips: list[str]) -> bool:
        while ips:
            result = self.datapath.delete(ips)
            done, ips = ips[: result.applied], ips[result.applied :]
            self._forget(done)
            if result.error is None:
                return True
            failed, ips = ips[0], ips[1:]
            if result.error.errno_name == "ENOENT":
                # Already gone (someone removed it behind our back): the goal is reached, but say so.
                log.info("filter delete of %s found nothing to delete", failed)
                self._forget([failed])
                continue
            self._record_error("delete", result.error)
            self.retry_deletes[failed] = None
            self.retry_deletes.update(dict.fromkeys(ips))
            return False
        return True

    def _forget(self, ips: list[str]) -> None:
        if not ips:
            return
        self.installed.difference_update(ips)
        self.stats.deletes += len(ips)
        final = self.datapath.take_counters(ips)
        if self._on_release is not None:
            self._on_release(ips, final)

    def _room(self) -> int:
        return 0 if self.blocked else self.datapath.capacity - len(self.installed)

    def _fill(self) -> bool:
        room = self._room()
        if room <= 0 or not self.pending:
            return True
        batch = [ip for ip, _ in zip(self.pending, range(room), strict=False)]
        result = self.datapath.insert(batch)
        self._installed(batch[: result.applied])
        if result.error is None:
            return True
        self._record_error("insert", result.error)
        if isinstance(result.error, FilterFull):
            self.blocked = True
        return False

    def _installed(self, ips: list[str]) -> None:
        for ip in ips:
            del self.pending[ip]
        self.installed.update(ips)
        self.stats.inserts += len(ips)

    def _record_error(self, op: str, error: DatapathError) -> None:
        self.stats.write_errors[(op, error.errno_name)] += 1
        log.warning("filter %s failed: %s (%s); will retry", op, error, error.errno_name)

    def _count_repairs(self, leaked: tuple[str, ...], missing: tuple[str, ...]) -> None:
        if leaked:
            self.stats.drift_repaired["leaked"] += len(leaked)
            log.warning("resync: %d leaked filter entries removed: %s", len(leaked), ", ".join(leaked[:20]))
        if missing:
            self.stats.drift_repaired["missing"] += len(missing)
            log.warning(
                "resync: %d missing filter entries restored: %s", len(missing), ", ".join(missing[:20])
            )


