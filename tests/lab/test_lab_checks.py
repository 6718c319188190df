"""The lab's checker: what counts as a violation, when one becomes a failure, and holds during faults."""

from __future__ import annotations

from typing import Any

from podmeter.lab.checks import Checker, Observation, Truth, parse_metrics
from podmeter.model.identity import IdentityKey
from podmeter.model.records import decode_pod


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pod(name: str, ip: str, phase: str = "Running", host: bool = False) -> Any:
    return decode_pod({"metadata": {"uid": f"u-{name}", "name": name, "namespace": "web"},
                       "spec": {"nodeName": "n", "hostNetwork": host}, "status": {"phase": phase, "podIP": ip}})


def _truth(desired: dict[str, str], *others: Any) -> Truth:
    pods = {p.uid: p for p in [_pod(name, ip) for ip, name in desired.items()] + list(others)}
    return Truth(pods, {ip: frozenset({f"u-{name}"}) for ip, name in desired.items()}, set(),
                 {(p.namespace, p.name) for p in pods.values()})


def _obs(truth: Truth, kernel: set[str], capacity: int = 16, agent: str = "", agent_pods: set[str] | None = None,
         operator_keys: set[IdentityKey] | None = None) -> Observation:
    return Observation(0.0, truth, kernel, capacity, parse_metrics(agent), None, agent_up=bool(agent),
                       agent_pods=agent_pods, operator_keys=operator_keys)


def test_a_violation_fails_only_after_the_settle_time() -> None:
    clock = Clock()
    checker = Checker(settle=2.0, clock=clock)
    truth = _truth({"10.0.0.1": "a"})
    checker.observe(_obs(truth, {"10.0.0.1", "10.0.0.9"}))
    clock.now = 1.5
    checker.observe(_obs(truth, {"10.0.0.1", "10.0.0.9"}))
    assert checker.failures == []
    clock.now = 2.5
    checker.observe(_obs(truth, {"10.0.0.1", "10.0.0.9"}))
    [failure] = checker.failures
    assert (failure.invariant, failure.subject) == ("I2", "10.0.0.9")
    assert "leaked" in failure.detail and "no pod seen by the lab" in failure.detail


def test_a_transient_violation_is_counted_not_failed() -> None:
    clock = Clock()
    checker = Checker(settle=2.0, clock=clock)
    truth = _truth({"10.0.0.1": "a"})
    checker.observe(_obs(truth, set()))
    clock.now = 1.0
    checker.observe(_obs(truth, {"10.0.0.1"}))
    assert checker.failures == [] and checker.transient == 1 and not checker.open


def test_a_leaked_ip_is_named_with_its_last_holder_and_ineligible_holders_are_i3() -> None:
    clock = Clock()
    checker = Checker(settle=0.5, clock=clock)
    checker.observe(_obs(_truth({"10.0.0.5": "gone"}), {"10.0.0.5"}))
    done = _pod("job", "10.0.0.6", phase="Succeeded")
    clock.now = 1.0
    checker.observe(_obs(_truth({}, done), {"10.0.0.5", "10.0.0.6"}))
    clock.now = 2.0
    checker.observe(_obs(_truth({}, done), {"10.0.0.5", "10.0.0.6"}))
    found = {f.subject: (f.invariant, f.detail) for f in checker.failures}
    assert found["10.0.0.5"] == ("I2", "leaked: 10.0.0.5 is in the kernel filter but no pod holds it "
                                       "(last held by web/gone)")
    assert found["10.0.0.6"][0] == "I3" and "web/job (Succeeded)" in found["10.0.0.6"][1]


def test_missing_ips_fail_unless_the_map_is_full_of_desired_ips() -> None:
    clock = Clock()
    checker = Checker(settle=0.5, clock=clock)
    truth = _truth({"10.0.0.1": "a", "10.0.0.2": "b", "10.0.0.3": "c"})
    for clock.now in (0.0, 1.0):
        checker.observe(_obs(truth, {"10.0.0.1", "10.0.0.2"}, capacity=2))
    assert checker.failures == [] and checker.overflow_seen == 1
    for clock.now in (2.0, 3.0):
        checker.observe(_obs(truth, {"10.0.0.1"}, capacity=16))
    assert {(f.invariant, f.subject) for f in checker.failures} == {("I2", "10.0.0.2"), ("I2", "10.0.0.3")}


def test_a_hold_stops_the_clock_until_the_fault_ends() -> None:
    clock = Clock()
    checker = Checker(settle=1.0, clock=clock)
    truth = _truth({"10.0.0.1": "a"})
    checker.hold()
    for clock.now in (0.0, 5.0):
        checker.observe(_obs(truth, set()))
    checker.release()  # the clock of open violations restarts now (t=5)
    clock.now = 5.5
    checker.observe(_obs(truth, set()))
    assert checker.failures == []
    clock.now = 6.5
    checker.observe(_obs(truth, set()))
    assert [f.subject for f in checker.failures] == ["10.0.0.1"]


def test_store_series_and_misattributed_traffic_from_the_agent_metrics() -> None:
    clock = Clock()
    checker = Checker(settle=0.5, metrics_grace=1.0, clock=clock)
    truth = _truth({"10.0.0.1": "a", "10.0.0.2": "b"})
    checker.traffic_pods.add("web/a")
    metrics = "\n".join([
        'podmeter_pod_bytes_total{namespace="web",pod="a",direction="egress"} 100',
        'podmeter_pod_bytes_total{namespace="web",pod="b",direction="ingress"} 42',
        'podmeter_pod_bytes_total{namespace="web",pod="old",direction="ingress"} 0',
    ]) + "\n"
    for clock.now in (0.0, 1.0):
        checker.observe(_obs(truth, {"10.0.0.1", "10.0.0.2"}, agent=metrics, agent_pods={"u-a", "u-gone"}))
    assert {(f.invariant, f.subject) for f in checker.failures} == {("I1", "web/b"), ("I1", "u-gone"),
                                                                   ("I5", "web/b/ingress")}
    clock.now = 2.0  # past settle + grace: the gone pod's series fails too
    checker.observe(_obs(truth, {"10.0.0.1", "10.0.0.2"}, agent=metrics))
    assert ("I5", "web/old") in {(f.invariant, f.subject) for f in checker.failures}


def test_an_ip_passing_from_pod_to_pod_is_a_new_transient_each_time() -> None:
    clock = Clock()
    checker = Checker(settle=1.0, clock=clock)
    for step, owner in enumerate(["a", "b", "c", "d"]):
        clock.now = step * 0.8  # each pod's IP in flight for one sample, the IP missing throughout
        checker.observe(_obs(_truth({"10.0.0.1": owner}), set()))
    assert checker.failures == [] and checker.transient == 3
    clock.now = 4.0  # the same pod's IP still missing past the settle time: a failure
    checker.observe(_obs(_truth({"10.0.0.1": "d"}), set()))
    assert [f.detail for f in checker.failures] == ["missing: 10.0.0.1 of observed web/d is not in the kernel filter"]


def test_store_and_identities_are_compared_key_by_key_so_churn_is_transient() -> None:
    """Under churn the agent's store and the truth differ at every sample, by different pods each time:
    transients. One pod (or label set) that stays wrong past the settle time is a failure, named."""
    clock = Clock()
    checker = Checker(settle=1.0, clock=clock)
    for step in range(6):
        clock.now = step * 0.5
        truth = _truth({f"10.0.1.{step}": f"p{step}", f"10.0.1.{step + 1}": f"p{step + 1}"})
        truth.identity_keys = {IdentityKey("web", ("job", f"j{step}")), IdentityKey("web", ("job", f"j{step + 1}"))}
        checker.observe(_obs(truth, set(truth.desired), agent="x 1\n", agent_pods={f"u-p{step}"},
                             operator_keys={IdentityKey("web", ("job", f"j{step}"))}))
    assert checker.failures == []
    for step in range(3):
        clock.now = 3.0 + step
        truth = _truth({"10.0.2.1": "late"})
        truth.identity_keys = set()
        checker.observe(_obs(truth, {"10.0.2.1"}, agent="x 1\n", agent_pods=set(),
                             operator_keys={IdentityKey("web", ("job", "old"))}))
    assert {(f.invariant, f.detail) for f in checker.failures} == {
        ("I1", "missing: the agent's store lacks web/late (uid u-late)"),
        ("I4", 'leaked: identity ["web",["job","old"]] is held but no live pod has it'),
    }
