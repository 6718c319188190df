"""An in-memory datapath with the kernel's semantics, for tests, the lab's memory mode and benchmarks.

Like the kernel's filter map it has a fixed capacity and fails an insert into a full map (FilterFull); like
the kernel's batch operations it applies elements in order, stops at the first error and reports how many
it applied. Faults can be injected (:meth:`MemoryDatapath.fail_next`) to exercise the writer's error paths,
and entries can be planted or removed behind the writer's back to simulate drift.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from podmeter.model.datapath import BatchResult, DatapathError, Direction, FilterFull, Traffic
from podmeter.model.flows import FlowCounts, FlowEntry, FlowKey


class MemoryDatapath:
    """Invariants: ``len(entries) <= capacity``; counters exist only for IPs that saw traffic; flow entries
    exist only for flows with an observed end, at most ``flow_capacity`` of them between two drains."""

    def __init__(self, capacity: int = 65536, flow_capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        self._flow_capacity = flow_capacity
        self.entries: set[str] = set()
        self.counters: dict[tuple[str, Direction], Traffic] = {}
        self.flows: dict[FlowKey, FlowCounts] = {}
        self.lost = 0
        self._faults: list[DatapathError] = []
        self.calls = 0  # batch operations performed, for tests that bound work

    @property
    def capacity(self) -> int:
        return self._capacity

    def fail_next(self, error: DatapathError, times: int = 1) -> None:
        """Make the next ``times`` element operations fail with ``error``."""
        self._faults.extend([error] * times)

    def insert(self, ips: Sequence[str]) -> BatchResult:
        self.calls += 1
        for applied, ip in enumerate(ips):
            error = self._fault() or self._insert_error(ip)
            if error is not None:
                return BatchResult(applied, error)
            self.entries.add(ip)
        return BatchResult(len(ips))

    def delete(self, ips: Sequence[str]) -> BatchResult:
        self.calls += 1
        for applied, ip in enumerate(ips):
            error = self._fault()
            if error is None and ip not in self.entries:
                error = DatapathError("ENOENT", f"{ip} is not in the filter")
            if error is not None:
                return BatchResult(applied, error)
            self.entries.discard(ip)
        return BatchResult(len(ips))

    def contents(self) -> set[str]:
        return set(self.entries)

    def read_counters(self) -> dict[tuple[str, Direction], Traffic]:
        return dict(self.counters)

    def read_counters_of(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        counters = self.counters
        return {(ip, d): counters[(ip, d)] for ip in ips for d in Direction if (ip, d) in counters}

    def take_counters(self, ips: Iterable[str]) -> dict[tuple[str, Direction], Traffic]:
        taken: dict[tuple[str, Direction], Traffic] = {}
        for ip in ips:
            for direction in Direction:
                value = self.counters.pop((ip, direction), None)
                if value is not None:
                    taken[(ip, direction)] = value
        return taken

    def count(self, ip: str, direction: Direction, packets: int, size: int) -> None:
        """Account traffic as the kernel program would: only for IPs in the filter."""
        if ip in self.entries:
            key = (ip, direction)
            self.counters[key] = self.counters.get(key, Traffic()) + Traffic(packets, size)

    # --- flows (podmeter.model.flows.FlowSource) ---

    @property
    def flow_capacity(self) -> int:
        return self._flow_capacity

    def record_flow(self, key: FlowKey, packets: int, size: int, now_ns: int, tcp_flags: int = 0) -> bool:
        """Aggregate traffic as the kernel program would: only with an observed end, within capacity
        (else the packets are counted as lost). True if recorded."""
        if key.source not in self.entries and key.destination not in self.entries:
            return False
        old = self.flows.get(key)
        if old is None:
            if len(self.flows) >= self._flow_capacity:
                self.lost += packets
                return False
            self.flows[key] = FlowCounts(packets, size, now_ns, now_ns, tcp_flags)
        else:
            self.flows[key] = FlowCounts(old.packets + packets, old.bytes + size, old.first_ns, now_ns,
                                         old.tcp_flags | tcp_flags)
        return True

    def drain_flows(self) -> list[FlowEntry]:
        drained, self.flows = list(self.flows.items()), {}
        return drained

    def flows_lost(self) -> int:
        return self.lost

    def _insert_error(self, ip: str) -> DatapathError | None:
        if ip not in self.entries and len(self.entries) >= self._capacity:
            return FilterFull()
        return None

    def _fault(self) -> DatapathError | None:
        return self._faults.pop(0) if self._faults else None
