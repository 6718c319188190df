"""The one writer: pushes the desired filter's difference to the datapath, and nothing else.

Only the writer mutates the datapath's filter (the agent runs it in its one writer task; tests drive it
directly). It reads the desired filter, never the stores: what is desired is the view's business. It is
synchronous; the asyncio wrapping lives in the agent. Each :meth:`Writer.flush` and :meth:`Writer.resync`
returns a :class:`Pushed`: whether the datapath took everything, and the final counters of the IPs that
left the filter, which the agent hands to the traffic ledger (next stage: ``model.traffic``).

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
from dataclasses import dataclass, field

from podmeter.model.datapath import Datapath, DatapathError, Direction, FilterFull, Traffic
from podmeter.model.desired import DesiredFilter

log = logging.getLogger("podmeter.writer")


@dataclass
class WriterStats:
    """Counters exported as metrics; they only ever grow."""

    drift_repaired: Counter[str] = field(default_factory=Counter)  # kind: leaked | missing
    write_errors: Counter[tuple[str, str]] = field(default_factory=Counter)  # (op, errno)
    inserts: int = 0
    deletes: int = 0
    resyncs: int = 0


@dataclass(slots=True)
class Pushed:
    """What one flush or resync did.

    ``ok``: the datapath took everything it was given; ``released``: the IPs that left the filter, with
    ``final`` their last counters (read and removed from the datapath: the kernel starts over for the
    next holder); ``leaked`` / ``missing``: what a resync repaired (entries found in the kernel that
    nobody wants, and wanted ones that were gone).
    """

    ok: bool = True
    released: list[str] = field(default_factory=list)
    final: dict[tuple[str, Direction], Traffic] = field(default_factory=dict)
    leaked: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()


class Writer:
    """Keeps the datapath's filter equal to the view's desired filter (within capacity).

    Invariants, after :meth:`flush` returns without datapath errors:
    * ``installed`` is what the writer has written and not removed; it is a subset of the desired IPs;
    * ``pending`` holds exactly the desired IPs that are not installed, oldest first;
    * ``len(installed) == min(capacity, len(desired))`` unless the kernel refused an insert (``blocked``).
    """

    def __init__(self, desired: DesiredFilter, datapath: Datapath) -> None:
        self.desired = desired
        self.datapath = datapath
        self.installed: set[str] = set()
        self.pending: dict[str, None] = {}
        self.retry_deletes: dict[str, None] = {}
        self.blocked = False  # the kernel said full while we counted room: wait for a resync
        self.stats = WriterStats()
        self._pushed = Pushed()  # what the flush or resync under way has done so far

    # --- pushing to the datapath --------------------------------------------------------------

    @property
    def overflow(self) -> int:
        """Desired IPs that do not fit in the filter."""
        return len(self.pending)

    @property
    def dirty(self) -> bool:
        """True while some work is waiting for a flush."""
        return bool(self.desired.dirty or self.retry_deletes or (self.pending and self._room() > 0))

    def flush(self) -> Pushed:
        """Push every crossing since the last flush."""
        self._pushed = pushed = Pushed()
        deleted = self._delete(self._sort_dirty())
        pushed.ok = self._fill() and deleted
        return pushed

    def resync(self) -> Pushed:
        """Read what the datapath really holds and repair drift both ways; count the repairs."""
        self._pushed = pushed = Pushed()
        self.stats.resyncs += 1
        self._delete(self._sort_dirty())  # inserts wait until we know what is there (a restart adopts)
        actual = self.datapath.contents()
        desired = self.desired.ips()
        leaked = tuple(sorted(ip for ip in actual if ip not in desired))
        absent = [ip for ip in self.installed if ip not in actual]
        missing = tuple(sorted(ip for ip in absent if ip in desired))
        # Undesired entries whose delete failed and that are gone anyway: the goal is reached (their
        # counters are still taken, so no orphan counter entry keeps counting).
        self._forget([ip for ip in absent if ip not in desired])
        self.retry_deletes = {ip: None for ip in self.retry_deletes if ip in actual}
        adopted = {ip for ip in actual if ip in desired and ip not in self.installed}
        self.installed = (self.installed - set(missing)) | adopted
        self.pending = dict.fromkeys(missing) | {ip: None for ip in self.pending if ip not in adopted}
        self.blocked = False
        self._count_repairs(leaked, missing)
        self.installed |= set(leaked)  # so that _delete treats them as ours to remove
        deleted = self._delete(list(leaked))
        pushed.ok = self._fill() and deleted
        pushed.leaked, pushed.missing = leaked, missing
        return pushed

    # --- internals ----------------------------------------------------------------------------

    def _sort_dirty(self) -> list[str]:
        """Route each crossed IP: to delete if installed and undesired, to pending if desired and absent."""
        desired = self.desired.ips()
        # A delete that failed is retried only if the IP is still undesired (it may be wanted again).
        to_delete = [ip for ip in self.retry_deletes if ip not in desired]
        self.retry_deletes = {}
        for ip in self.desired.take_dirty():
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
        self._pushed.released.extend(ips)
        self._pushed.final.update(self.datapath.take_counters(ips))

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


