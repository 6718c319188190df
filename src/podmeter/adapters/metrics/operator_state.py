"""The operator's metrics, computed at scrape time by a custom collector (no gauges kept in sync).

Series names are documented in docs/operator.md. The operator hands the collector a function that takes an
:class:`OperatorSnapshot` from its reconciler, backend, election and reflector as they are at the scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from podmeter.adapters.identity.etcd_audit import KINDS as CORRUPT_KINDS
from podmeter.adapters.metrics.agent_state import watch_families
from podmeter.adapters.metrics.families import by_one, counter, gauge, with_zeros

# The (op, reason) pairs of identity errors known in advance (runtime.operator): exported from the start
# as 0. A failed status write's reason is the exception's type, known only when it happens.
IDENTITY_ERRORS = (("acquire", "backend"), ("acquire", "exhausted"), ("release", "backend"), ("key", "bad_labels"),
                   ("start", "backend"), ("gc", "backend"))


@dataclass(frozen=True)
class OperatorSnapshot:
    """What the collector exports. Counters only grow; gauges are current values."""

    identities: int = 0
    pending: int = 0
    exhausted: bool = False
    leader: bool = False
    configuration_valid: bool = True  # no MetricsConfiguration at all is valid (annotations only)
    ready: bool = False
    acquired: int = 0
    released: int = 0
    gc_released: int = 0
    store_gc_removed: int = 0
    store_corrupt: Mapping[str, int] = field(default_factory=dict)  # kind (etcd_audit.KINDS)
    errors: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (op, reason)
    drift_repaired: Mapping[str, int] = field(default_factory=dict)  # kind
    watch_events: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (resource, type)
    relists: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (resource, reason)
    decode_errors: Mapping[str, int] = field(default_factory=dict)  # resource
    store_objects: Mapping[str, int] = field(default_factory=dict)  # resource
    published_endpoints: int = 0
    published_slices: int = 0
    slice_writes: Mapping[str, int] = field(default_factory=dict)  # op: create | replace | delete
    slice_conflicts: int = 0
    slice_errors: int = 0
    slice_writes_pending: int = 0
    task_failures: Mapping[str, int] = field(default_factory=dict)  # task name


class OperatorStateCollector(Collector):
    def __init__(self, snapshot: Callable[[], OperatorSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield gauge("podmeter_identities", "Identities this operator holds.", s.identities)
        yield gauge("podmeter_identity_pending", "Keys whose identity awaits a retry.", s.pending)
        yield gauge("podmeter_identity_exhausted", "1 while the ID range is exhausted.", int(s.exhausted))
        yield gauge("podmeter_leader", "1 while this operator leads.", int(s.leader))
        yield gauge("podmeter_configuration_valid",
                    "0 while the default MetricsConfiguration is invalid (1 when valid or absent).",
                    int(s.configuration_valid))
        yield gauge("podmeter_ready", "1 once the first pod list is applied.", int(s.ready))
        yield counter("podmeter_identity_acquired", "Identities acquired (0->1).", value=s.acquired)
        yield counter("podmeter_identity_released", "Identities released (1->0).", value=s.released)
        yield counter("podmeter_identity_gc_released", "Identities released by the sweep: no live pod.",
                      value=s.gc_released)
        yield counter("podmeter_identity_store_gc_removed", "Unreferenced IDs removed from the store.",
                      value=s.store_gc_removed)
        yield counter("podmeter_identity_store_corrupt", "Corrupt identity store entries found (never used).",
                      ("kind",), by_one(with_zeros(s.store_corrupt, CORRUPT_KINDS)))
        yield counter("podmeter_identity_errors", "Identity operations that failed.", ("op", "reason"),
                      with_zeros(s.errors, IDENTITY_ERRORS))
        yield counter("podmeter_drift_repaired", "Differences a periodic resync repaired.", ("kind",),
                      by_one(s.drift_repaired))
        yield counter("podmeter_task_failures", "Long-running tasks that died of an unexpected error.", ("task",),
                      by_one(s.task_failures))
        yield from watch_families(s.watch_events, s.relists, s.decode_errors, s.store_objects)
        yield gauge("podmeter_published_endpoints", "Endpoints in the desired PodSlices (the leader's).",
                    s.published_endpoints)
        yield gauge("podmeter_published_slices", "PodSlices desired (the leader's).", s.published_slices)
        yield counter("podmeter_slice_writes", "PodSlice writes.", ("op",), by_one(s.slice_writes))
        yield counter("podmeter_slice_conflicts", "PodSlice writes that met a newer version.",
                      value=s.slice_conflicts)
        yield counter("podmeter_slice_errors", "PodSlice writes that failed.", value=s.slice_errors)
        yield gauge("podmeter_slice_writes_pending", "PodSlice writes left to the next sync (rate limit).",
                    s.slice_writes_pending)
