"""The agent's DNS drain over a fake source (a unit seam; the kernel path is tests/adapters/test_bpf_dns.py):
a failing drain is counted and the agent goes on, entries go to their pods' series and to the DNS feed, and
the outstanding queries are swept by who is observed."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from podmeter.adapters.flow_serving import FlowFeed
from podmeter.model import dns
from podmeter.model.records import Pod
from podmeter.runtime.dns_drain import DnsDrainer

pytestmark = pytest.mark.fast

WEB = Pod("u1", "shop", "web", "node-a", ("10.0.0.2",), False, "Running", False, True, (), "1")


class FakeSource:
    def __init__(self) -> None:
        self.entries: list[dns.DnsEntry] = []
        self.fail = False
        self.swept_with: list[Callable[[str], bool]] = []

    def drain(self) -> dns.DnsDrain:
        if self.fail:
            raise OSError("EIO")
        taken, self.entries = self.entries, []
        return dns.DnsDrain(taken, undecodable=1)

    def counts(self) -> dict[dns.Verdict, int]:
        return {}

    def sweep(self, observed: Callable[[str], bool], now_ns: int | None = None) -> int:
        self.swept_with.append(observed)
        return 2


def _answer(rcode: int) -> dns.DnsEntry:
    key = dns.DnsKey("10.0.0.2", "10.96.0.10", dns.Direction.RESPONSE, "a.test.", 1, rcode, 17)
    return key, dns.DnsCounts(1)


def test_a_drain_credits_the_pods_publishes_records_and_sweeps() -> None:
    source, ledger, feed = FakeSource(), dns.DnsLedger(30), FlowFeed(16)
    ledger.assign("10.0.0.2", WEB, now=0)
    drainer = DnsDrainer(source, ledger, feed, "node-a")
    source.entries = [_answer(3), _answer(3), _answer(0)]
    assert drainer.drain([WEB])
    assert ledger.series["u1"].responses == {3: 2, 0: 1}
    records = feed.ring.last(10)
    assert sorted((r.dns.rcode, r.dns.count) for r in records if r.dns) == [(0, 1), (3, 2)]
    assert all(r.destination.endpoint is not None and r.destination.endpoint.pod == "web" for r in records)
    assert (drainer.stats.drains, drainer.stats.undecodable, drainer.stats.swept) == (1, 1, 2)
    observed = source.swept_with[-1]
    assert observed("10.0.0.2") and not observed("10.0.0.9")


def test_a_failing_drain_is_counted_and_the_next_one_works() -> None:
    source, ledger = FakeSource(), dns.DnsLedger(30)
    drainer = DnsDrainer(source, ledger, FlowFeed(16), "node-a")
    source.fail = True
    assert not drainer.drain([WEB]) and drainer.stats.errors == 1
    source.fail = False
    source.entries = [_answer(0)]
    assert drainer.drain([WEB], sweep=False) and ledger.unattributed == 1  # no series: nobody owned it
    assert source.swept_with == []
