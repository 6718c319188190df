"""The traffic ledger: exact attribution of per-IP kernel counters to pods (failure modes F20-F21 of docs/design.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_pod
from podmeter.model.datapath import Direction, Traffic
from podmeter.model.traffic import TrafficLedger
from podmeter.model.workloads import workload_of

pytestmark = pytest.mark.fast  # the pure tier: make test-fast

IN, OUT = Direction.INGRESS, Direction.EGRESS


def kernel(**values: tuple[int, int]) -> dict[tuple[str, Direction], Traffic]:
    """kernel(ip_10_0_0_1=(packets, bytes)) -> egress counters of that IP."""
    return {(name[3:].replace("_", "."), OUT): Traffic(*v) for name, v in values.items()}


def values(ledger: TrafficLedger, counters: dict[tuple[str, Direction], Traffic]) -> dict[tuple[str, str], Traffic]:
    return {(s.name, d.value): v for s, d, v in ledger.series_values(counters)}


def test_owner_sees_only_traffic_since_it_took_the_ip() -> None:
    ledger = TrafficLedger(grace=10)
    pod = make_pod("a", ips=("10.0.0.1",))
    ledger.assign("10.0.0.1", pod, kernel(ip_10_0_0_1=(5, 500)), now=0)  # left by a predecessor: baseline
    assert values(ledger, kernel(ip_10_0_0_1=(7, 700)))[("a", "egress")] == Traffic(2, 200)


def test_ip_reuse_after_the_ip_left_the_filter() -> None:
    ledger = TrafficLedger(grace=10)
    a, b = make_pod("a", ips=("10.0.0.1",)), make_pod("b", ips=("10.0.0.1",))
    ledger.assign("10.0.0.1", a, {}, now=0)
    ledger.release(["10.0.0.1"], kernel(ip_10_0_0_1=(3, 300)), now=1)  # final reading, entry removed
    ledger.assign("10.0.0.1", b, {}, now=2)
    now = values(ledger, kernel(ip_10_0_0_1=(1, 100)))
    assert now[("a", "egress")] == Traffic(3, 300)
    assert now[("b", "egress")] == Traffic(1, 100)


def test_ip_reuse_without_leaving_the_filter() -> None:
    """The new owner arrived before the old one's delete: the IP never left the kernel map."""
    ledger = TrafficLedger(grace=10)
    a, b = make_pod("a", ips=("10.0.0.1",)), make_pod("b", ips=("10.0.0.1",))
    ledger.assign("10.0.0.1", a, {}, now=0)
    ledger.assign("10.0.0.1", b, kernel(ip_10_0_0_1=(4, 400)), now=1)
    now = values(ledger, kernel(ip_10_0_0_1=(6, 650)))
    assert now[("a", "egress")] == Traffic(4, 400)
    assert now[("b", "egress")] == Traffic(2, 250)


def test_series_live_through_the_grace_period_then_go() -> None:
    ledger = TrafficLedger(grace=10)
    a = make_pod("a", ips=("10.0.0.1",))
    ledger.assign("10.0.0.1", a, {}, now=0)
    ledger.release(["10.0.0.1"], kernel(ip_10_0_0_1=(2, 200)), now=5)
    assert ledger.expire(now=14) == 0
    assert values(ledger, {})[("a", "egress")] == Traffic(2, 200)
    assert ledger.expire(now=15) == 1
    assert values(ledger, {}) == {}
    assert ledger.node_totals({})[OUT] == Traffic(2, 200)  # the node total keeps what the pod had
    assert not ledger.owners and not ledger.series


def test_observed_again_starts_a_new_series_from_zero() -> None:
    ledger = TrafficLedger(grace=10)
    a = make_pod("a", ips=("10.0.0.1",))
    ledger.assign("10.0.0.1", a, {}, now=0)
    ledger.release(["10.0.0.1"], kernel(ip_10_0_0_1=(2, 200)), now=1)
    ledger.assign("10.0.0.1", a, {}, now=2)
    assert values(ledger, {})[("a", "egress")] == Traffic()


def test_dual_stack_pod_sums_its_ips() -> None:
    ledger = TrafficLedger(grace=10)
    a = make_pod("a", ips=("10.0.0.1", "fd00::1"))
    ledger.assign("10.0.0.1", a, {}, now=0)
    ledger.assign("fd00::1", a, {}, now=0)
    counters = {("10.0.0.1", IN): Traffic(1, 10), ("fd00::1", IN): Traffic(2, 20)}
    assert values(ledger, counters)[("a", "ingress")] == Traffic(3, 30)


def test_workload_of_a_deployment_pod() -> None:
    pod = make_pod("web-5d9f7-x", labels={"pod-template-hash": "5d9f7"})
    import msgspec

    pod = msgspec.structs.replace(pod, owner_kind="ReplicaSet", owner_name="web-5d9f7")
    assert workload_of(pod) == ("Deployment", "web")
    job = msgspec.structs.replace(pod, owner_kind="Job", owner_name="backup-1")
    assert workload_of(job) == ("Job", "backup-1")
    cron_run = msgspec.structs.replace(pod, owner_kind="Job", owner_name="backup-29300160")
    assert workload_of(cron_run) == ("CronJob", "backup")
    for kind in ("StatefulSet", "DaemonSet"):
        assert workload_of(msgspec.structs.replace(pod, owner_kind=kind, owner_name="db")) == (kind, "db")
    orphan_rs = msgspec.structs.replace(pod, owner_kind="ReplicaSet", owner_name="other-abc")
    assert workload_of(orphan_rs) == ("ReplicaSet", "other-abc")
    bare = msgspec.structs.replace(pod, owner_kind="", owner_name="")
    assert workload_of(bare) == ("Pod", "web-5d9f7-x")


IPS = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
PODS = [make_pod(f"p{i}", ips=()) for i in range(5)]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("traffic"), st.sampled_from(IPS), st.sampled_from(list(Direction)),
                  st.integers(1, 5), st.integers(1, 1500)),
        st.tuples(st.just("assign"), st.sampled_from(IPS), st.sampled_from([None, *range(len(PODS))])),
        st.tuples(st.just("release"), st.sampled_from(IPS)),
        st.tuples(st.just("expire"), st.integers(0, 3)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_attribution_is_exact_and_monotonic(ops: list[tuple[object, ...]]) -> None:
    """Every packet goes to the pod that owned its IP when it was counted; no series ever goes down."""
    ledger = TrafficLedger(grace=2)
    counters: dict[tuple[str, Direction], Traffic] = {}
    owner: dict[str, int] = {}
    truth: dict[tuple[int, str], Traffic] = {}  # (pod index, direction) -> what that pod really had
    seen: dict[tuple[str, str], Traffic] = {}
    ended: set[str] = set()
    clock = 0.0
    for op in ops:
        clock += 1
        if op[0] == "traffic":
            _, ip, direction, packets, size = op
            amount = Traffic(packets, packets * size)  # type: ignore[operator]
            key = (ip, direction)
            counters[key] = counters.get(key, Traffic()) + amount  # type: ignore[index]
            if ip in owner:
                t = (owner[ip], direction.value)  # type: ignore[union-attr,index]
                truth[t] = truth.get(t, Traffic()) + amount
        elif op[0] == "assign":
            _, ip, index = op
            pod = PODS[index] if index is not None else None  # type: ignore[index]
            ledger.assign(ip, pod, counters, clock)  # type: ignore[arg-type]
            owner.pop(ip, None)  # type: ignore[arg-type]
            if index is not None:
                owner[ip] = index  # type: ignore[index]
        elif op[0] == "release":
            ip = op[1]
            final = {k: v for k, v in counters.items() if k[0] == ip}
            for k in final:
                del counters[k]
            ledger.release([ip], final, clock)  # type: ignore[list-item]
            owner.pop(ip, None)  # type: ignore[arg-type]
        else:
            clock += op[1]  # type: ignore[operator]
            ledger.expire(clock)
        current = values(ledger, counters)
        for key, value in current.items():
            if key in seen and key[0] not in ended:  # an ended series may restart from zero as a new one
                assert value.bytes >= seen[key].bytes and value.packets >= seen[key].packets
        seen = dict(current)
        ended = {s.name for s in ledger.series.values() if s.ended_at is not None}
        # exact: live series + expired node totals == every pod's true traffic
        total_truth = sum((v.bytes for v in truth.values()), 0)
        total_node = sum((v.bytes for v in ledger.node_totals(counters).values()), 0)
        assert total_node == total_truth
        for (name, direction), value in current.items():
            index = int(name[1:])
            expected = truth.get((index, direction), Traffic())
            assert value.bytes <= expected.bytes  # a live series never shows more than its pod had
