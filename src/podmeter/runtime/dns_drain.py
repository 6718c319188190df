"""Draining the datapath's DNS aggregates: drain -> credit the pods' series -> name -> publish to readers.

Runs in the agent's writer task at every flow drain, with the same pods (the view while the messages were
counted: at a change of hands, the view before it), so a message is credited to the pod that held the
address when it was sent or received. Then the outstanding queries of addresses no longer observed, and
those past their expiry, are swept from the kernel (a pod deleted between its query and the answer leaves
nothing behind).

Next stage: the ledger's series (``adapters.metrics.pod_dns``) and the DNS feed (``podmeter observe
--protocol dns``), whose taps (``runtime.agent``) add each drain's records to Hubble's DNS families
(``model.hubble_metrics.dns_events``) and Retina's DNS series (``model.retina_dns``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model.dns import DnsLedger, DnsSource, merge
from podmeter.model.endpoints import AddressBook, ChainedNames, Names
from podmeter.model.flow_records import EndpointCache, name_dns
from podmeter.model.interest import holds_address
from podmeter.model.records import Pod

log = logging.getLogger("podmeter.dns")


@dataclass
class DnsDrainStats:
    """The drainer's counters (exported as metrics); they only grow but ``last_*``."""

    drains: int = 0
    errors: int = 0
    entries: int = 0
    undecodable: int = 0
    swept: int = 0
    last_entries: int = 0


class DnsDrainer:
    """Drains ``source`` into ``ledger`` and ``feed``; ``others``: names of ends beyond this node."""

    def __init__(self, source: DnsSource, ledger: DnsLedger, feed: FlowFeed, node: str,
                 others: Sequence[Names] = ()) -> None:
        self.source, self.ledger, self.feed, self.node = source, ledger, feed, node
        self.others = list(others)
        self.stats = DnsDrainStats()

    def drain(self, pods: Iterable[Pod], others: Sequence[Names] | None = None, *, sweep: bool = True) -> bool:
        """One drain credited to ``pods`` (the holders while the messages were counted); False if it failed
        (counted and logged: the entries stay in the kernel for the next one). ``sweep`` False: keep the
        outstanding queries (at start-up, before the ledger knows who owns what)."""
        try:
            drained = self.source.drain()
        except Exception as exc:  # a kernel error: count it, keep running, try at the next drain
            self.stats.errors += 1
            log.warning("dns drain failed (will retry next interval): %s: %s", type(exc).__name__, exc)
            return False
        self.stats.drains += 1
        self.stats.undecodable += drained.undecodable
        pods = list(pods)
        entries = list(merge(drained.entries).items())
        if entries:
            holders = {ip: pod.uid for pod in pods if holds_address(pod) for ip in pod.ips}
            self.ledger.add(entries, holders)
            names = ChainedNames(AddressBook(pods), *(self.others if others is None else others))
            self.feed.publish(name_dns(entries, EndpointCache(names), self.node, time.time()))
        self.stats.entries += len(entries)
        self.stats.last_entries = len(entries)
        if sweep:
            self._sweep()
        return True

    def _sweep(self) -> None:
        owners = self.ledger.owners
        try:
            self.stats.swept += self.source.sweep(lambda ip: ip in owners)
        except Exception as exc:  # the LRU bounds the map anyway: log and go on
            log.warning("dns: sweeping the outstanding queries failed: %s: %s", type(exc).__name__, exc)
