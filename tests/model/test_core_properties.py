"""Hypothesis: random event sequences against the core.

After every step the incremental desired filter equals a recompute from the store, and the addresses the
step's delta handed over (``NodeView.apply``'s report, which the agent drains at) are exactly those whose
holders, recomputed from the store before and after it, had a holder and changed; after the writer
quiesces the datapath holds exactly the desired IPs (or, over capacity, a full map of desired IPs only).
The event stream includes duplicates, lost events repaired by a relist, IPs drawn from a pool of 8 (so
reuse is constant), namespace and configuration flips, and drift injected into the datapath.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core_harness import Core
from factories import make_namespace, make_pod
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.configuration import Interest
from podmeter.model.datapath import DatapathError
from podmeter.model.interest import holds_address
from podmeter.model.records import Namespace, Pod
from podmeter.model.view import NodeView

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "fd00::1", "fd00::2", "fd00::3"]
NAMESPACES = ["a", "b", "c"]
NAMES = [f"p{i}" for i in range(10)]

pod_states = st.fixed_dictionaries(
    {
        "ips": st.lists(st.sampled_from(IPS), max_size=2, unique=True).map(tuple),
        "observe": st.booleans(),
        "phase": st.sampled_from(["Pending", "Running", "Running", "Running", "Succeeded", "Failed"]),
        "host_network": st.booleans().map(lambda b: b and False) | st.just(True),
        "node": st.sampled_from(["node-a", "node-a", "node-a", "node-b"]),
    }
)
interests = st.builds(
    lambda inc, exc, ann, mode: Interest(
        include=frozenset(inc) if mode == "include" else frozenset(),
        exclude=frozenset(exc) if mode == "exclude" else frozenset(),
        annotations=ann,
    ),
    st.sets(st.sampled_from(NAMESPACES)),
    st.sets(st.sampled_from(NAMESPACES)),
    st.booleans(),
    st.sampled_from(["include", "exclude", "none"]),
)


def address_holders(view: NodeView) -> dict[str, frozenset[str]]:
    """IP -> UIDs of the stored pods whose IP names them, from scratch."""
    holders: dict[str, set[str]] = {}
    for pod in view.pods.values():
        if holds_address(pod):
            for ip in pod.ips:
                holders.setdefault(ip, set()).add(pod.uid)
    return {ip: frozenset(uids) for ip, uids in holders.items()}


class CoreMachine(RuleBasedStateMachine):
    """``server`` is the API server's truth; the writer sees it through events that may be lost."""

    def __init__(self) -> None:
        super().__init__()
        self.server: dict[str, Pod] = {}
        self.server_namespaces: dict[str, Namespace] = {}
        self.generation = 0
        self.lost_events = False
        self.drifted = False
        self.holders: dict[str, frozenset[str]] = {}  # as recomputed after the last delta
        self.deltas = 0

    @initialize(capacity=st.integers(min_value=2, max_value=10))
    def start(self, capacity: int) -> None:
        self.datapath = MemoryDatapath(capacity)
        self.writer = Core(self.datapath)

    # --- pods -------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), ns=st.sampled_from(NAMESPACES), state=pod_states, lose=st.booleans())
    def upsert_pod(self, name: str, ns: str, state: dict[str, object], lose: bool) -> None:
        existing = next((p for p in self.server.values() if (p.namespace, p.name) == (ns, name)), None)
        uid = existing.uid if existing else f"{ns}-{name}-{self.generation}"
        self.generation += 1
        pod = make_pod(name, ns, uid=uid, **state)  # type: ignore[arg-type]
        self.server[uid] = pod
        self._deliver(lambda: self.writer.upsert_pod(pod), lose)

    @precondition(lambda self: bool(self.server))
    @rule(data=st.data(), lose=st.booleans())
    def delete_pod(self, data: st.DataObject, lose: bool) -> None:
        uid = data.draw(st.sampled_from(sorted(self.server)))
        del self.server[uid]
        self._deliver(lambda: self.writer.delete_pod(uid), lose)

    @precondition(lambda self: bool(self.writer.view.pods))
    @rule(data=st.data())
    def duplicate_event(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(sorted(self.writer.view.pods)))
        assert self.writer.upsert_pod(self.writer.view.pods[uid]) is False

    @rule()
    def relist(self) -> None:
        self.writer.replace_pods(list(self.server.values()))
        self.lost_events = False

    # --- namespaces, configuration ------------------------------------------------------------

    @rule(ns=st.sampled_from(NAMESPACES), observe=st.booleans())
    def upsert_namespace(self, ns: str, observe: bool) -> None:
        namespace = make_namespace(ns, observe=observe)
        self.server_namespaces[ns] = namespace
        self.writer.upsert_namespace(namespace)

    @rule(ns=st.sampled_from(NAMESPACES))
    def delete_namespace(self, ns: str) -> None:
        self.server_namespaces.pop(ns, None)
        self.writer.delete_namespace(ns)

    @rule()
    def relist_namespaces(self) -> None:
        self.writer.replace_namespaces(list(self.server_namespaces.values()))

    @rule(interest=interests | st.none())
    def set_interest(self, interest: Interest | None) -> None:
        self.writer.configure(interest)

    # --- the datapath ---------------------------------------------------------------------------

    @rule()
    def flush(self) -> None:
        self.writer.flush()

    @rule()
    def resync(self) -> None:
        self.writer.resync()
        self.drifted = False

    @rule(ip=st.sampled_from(IPS), plant=st.booleans())
    def drift(self, ip: str, plant: bool) -> None:
        if plant and len(self.datapath.entries) < self.datapath.capacity:
            self.datapath.entries.add(ip)
        else:
            self.datapath.entries.discard(ip)
        self.drifted = True

    @rule(errno=st.sampled_from(["EIO", "ENOMEM"]))
    def fault(self, errno: str) -> None:
        self.datapath.fail_next(DatapathError(errno, "injected"))

    # --- invariants -----------------------------------------------------------------------------

    @invariant()
    def incremental_equals_recompute(self) -> None:
        if not hasattr(self, "writer"):
            return
        view = self.writer.view
        recomputed = view.recompute()
        assert {ip: frozenset(view.desired.uids(ip)) for ip in view.desired} == recomputed

    @invariant()
    def the_handed_over_addresses_equal_the_recomputed_difference(self) -> None:
        if not hasattr(self, "writer"):
            return
        now = address_holders(self.writer.view)
        if self.writer.deltas == self.deltas:  # no delta since (a lost event, a flush, drift)
            assert now == self.holders
            return
        assert self.writer.deltas == self.deltas + 1  # one delta per step
        changed = {ip for ip, uids in self.holders.items() if now.get(ip) != uids}
        assert self.writer.handed_over == changed
        self.holders, self.deltas = now, self.writer.deltas

    @invariant()
    def store_mirrors_the_server_when_no_event_was_lost(self) -> None:
        if hasattr(self, "writer") and not self.lost_events:
            assert self.writer.view.pods == self.server

    @rule()
    def quiesce_and_check(self) -> None:
        """Let the writer finish (no more faults), then the datapath must equal the desired filter."""
        self.datapath._faults.clear()
        if self.drifted:
            self.writer.resync()
            self.drifted = False
        self.writer.flush()
        desired = set(self.writer.view.desired)
        entries = self.datapath.entries
        assert entries == self.writer.installed
        assert entries <= desired
        assert len(entries) == min(self.datapath.capacity, len(desired))
        assert self.writer.overflow == len(desired) - len(entries)

    def teardown(self) -> None:
        if hasattr(self, "writer"):
            self.quiesce_and_check()

    def _deliver(self, apply: object, lose: bool) -> None:
        if lose:
            self.lost_events = True
        else:
            apply()  # type: ignore[operator]


CoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCore = CoreMachine.TestCase
