"""The DNS maps of the TC programs (``bpf/podmeter_dns.h``): drained with the flows, swept of old queries.

* ``dns``: the aggregates, taken (read and deleted) with batched lookup-and-delete at each drain. A
  message a program adds to an entry at the instant the drain deletes it is lost (a window of one
  bucket lock; the flows' double buffer closes it for flows, whose counts are billed);
* ``dns_pending``: the outstanding queries, an LRU map (bounded: a flood of unanswered queries evicts the
  oldest). :meth:`DnsMaps.sweep` removes those older than the expiry or of a pod no longer observed, so
  a pod deleted between query and answer leaves nothing behind;
* ``dns_counts``: per-CPU counts of the messages aggregated and of every reason one was not
  (:class:`~podmeter.model.dns.Verdict`), since the map was created.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from podmeter.adapters.datapath.ebpf import layout
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError
from podmeter.adapters.datapath.ebpf.maps import BATCH_UNSUPPORTED, BpfMap
from podmeter.model import dns
from podmeter.model.dns import DnsDrain

log = logging.getLogger("podmeter.datapath.ebpf")

DNS_MAP = "dns"
DNS_PENDING_MAP = "dns_pending"
DNS_COUNTS_MAP = "dns_counts"
DNS_SCRATCH_MAP = "dns_scratch"
DNS_MAPS = (DNS_MAP, DNS_PENDING_MAP, DNS_COUNTS_MAP)  # what userspace keeps open
DNS_MAP_NAMES = (*DNS_MAPS, DNS_SCRATCH_MAP)
EXPIRE_NS = 5_000_000_000  # PM_DNS_EXPIRE_NS


def dns_map_sizes(dns_size: int, pending_size: int) -> dict[str, int]:
    return {DNS_MAP: dns_size, DNS_PENDING_MAP: pending_size, DNS_COUNTS_MAP: len(dns.Verdict),
            DNS_SCRATCH_MAP: 1}


class DnsMaps:
    """The open DNS maps (owns their descriptors). Calls may come from several threads; one task drains."""

    def __init__(self, aggregates: BpfMap, pending: BpfMap, counts: BpfMap) -> None:
        self.aggregates, self.pending, self.counts_map = aggregates, pending, counts

    @classmethod
    def of(cls, maps: Mapping[str, BpfMap]) -> DnsMaps | None:
        """The DNS maps among ``maps`` (None if any is missing: an object built without them)."""
        if not all(name in maps for name in DNS_MAPS):
            return None
        return cls(maps[DNS_MAP], maps[DNS_PENDING_MAP], maps[DNS_COUNTS_MAP])

    @property
    def capacity(self) -> int:
        return self.aggregates.shape.max_entries

    def drain(self) -> DnsDrain:
        """Take every aggregate (batched; key by key on a kernel without the batch operation). An error
        stops the drain with what was taken (logged); the rest is in the next one."""
        out = DnsDrain()
        texts = layout.AddressTexts()
        try:
            for keys, values, count in self.aggregates.take_batches():
                self._add(out, *layout.decode_dns(keys, values, count, texts))
        except BpfCallError as error:
            if error.errno not in BATCH_UNSUPPORTED:
                log.warning("dns drain stopped after %d entries (%s)", len(out.entries), error)
                return out
            for key, value in self.aggregates.take_each():
                self._add(out, *layout.decode_dns(key, value, 1, texts))
        if out.undecodable:
            log.warning("dns map: skipped %d entries podmeter did not write", out.undecodable)
        return out

    @staticmethod
    def _add(out: DnsDrain, entries: list[dns.DnsEntry], bad: int) -> None:
        out.entries.extend(entries)
        out.undecodable += bad

    def counts(self) -> dict[dns.Verdict, int]:
        """Messages aggregated and refused, by verdict, since the map was created (summed over CPUs)."""
        found = {}
        for verdict in dns.Verdict:
            raw = self.counts_map.lookup(layout.DNS_COUNT_KEY.pack(verdict))
            found[verdict] = 0 if raw is None else layout.sum_dns_counts(raw)
        return found

    def sweep(self, observed: Callable[[str], bool], now_ns: int | None = None) -> int:
        """Remove outstanding queries older than the expiry or of a pod that is not observed any more;
        returns how many. ``now_ns``: the programs' clock (CLOCK_MONOTONIC, Python's monotonic_ns)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        removed = 0
        for key, value in self.pending.collect_items():
            pod = layout.address_text(layout.DNS_PENDING_KEY.unpack(key)[0])
            (sent,) = layout.DNS_PENDING_VALUE.unpack(value)
            if (now - sent > EXPIRE_NS or not observed(pod)) and self.pending.delete(key):
                removed += 1
        return removed

    def pending_count(self) -> int:
        return len(self.pending.collect_keys())

    def close(self) -> None:
        for bpf_map in (self.aggregates, self.pending, self.counts_map):
            bpf_map.close()
