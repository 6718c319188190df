"""Continuous checks of invariants I1-I6 against truth the lab computes itself.

Truth is never the agent's belief: the pods, namespaces and MetricsConfiguration come from the API server
over HTTP, the desired filter is computed from them with the model's own records and interest functions
(:class:`~podmeter.model.view.NodeView`, a from-scratch recompute), and the kernel's filter is read from
the pinned map by this process (``EbpfDatapath.open_pinned``). Only in memory mode, where there is no
kernel map, the agent's datapath contents come from its ``/debug/state``.

A violation is a (invariant, subject) pair seen in a sample. It becomes a **failure** when it persists
longer than the settle time; transient ones (an event in flight) are counted, not failed. While the lab
holds the checks (the agent is deliberately down, a watch deliberately stalled), violations do not age:
their clock restarts when the hold ends, so only a failure to converge *after* a fault fails the run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from podmeter.lab.kube import KubeClient
from podmeter.model.configuration import DEFAULT_NAME, decode_configuration
from podmeter.model.deltas import CONFIGURATIONS, NAMESPACES, PODS, Replace, Upsert
from podmeter.model.identity import IdentityKey, LabelFilter, key_of_flat
from podmeter.model.interest import holds_identity
from podmeter.model.records import DecodeError, Pod, decode_namespace, decode_pod
from podmeter.model.view import NodeView
from podmeter.runtime.doctor import NOT_OBSERVED, why_not_counted

MCONF_PATH = "/apis/podmeter.io/v1alpha1/metricsconfigurations"


# --- truth -------------------------------------------------------------------------------------------


@dataclass
class Truth:
    """What the API server says, and what follows from it by the model's rules."""

    node_pods: dict[str, Pod]  # uid -> pod bound to the node
    desired: dict[str, frozenset[str]]  # ip -> uids of observed pods holding it
    identity_keys: set[IdentityKey]  # label sets of every pod that holds an identity (cluster-wide)
    pod_names: set[tuple[str, str]]  # (namespace, name) of the node's pods

    def holders(self, ip: str) -> list[Pod]:
        """Every pod of the node whose status carries ``ip`` (observed or not, live or finished)."""
        return [p for p in self.node_pods.values() if ip in p.ips]


def read_truth(client: KubeClient, node_name: str, label_filter: LabelFilter) -> Truth:
    """One consistent-enough snapshot: namespaces and configuration first, then pods."""
    view = NodeView(node_name)
    namespaces = [decode_namespace(ns) for ns in client.list("/api/v1/namespaces").get("items") or []]
    view.apply(Replace(NAMESPACES, namespaces))
    config = client.get(f"{MCONF_PATH}/{DEFAULT_NAME}")
    if config is not None:
        # An invalid object: the agent keeps the last valid one; we judge as without one (annotations).
        with contextlib.suppress(DecodeError):
            view.apply(Upsert(CONFIGURATIONS, decode_configuration(config)))
    pods = [decode_pod(p) for p in client.list("/api/v1/pods").get("items") or []]
    node_pods = {p.uid: p for p in pods if p.node_name == node_name}
    view.apply(Replace(PODS, list(node_pods.values())))
    keys = {key_of_flat(p.namespace, p.labels, label_filter) for p in pods if holds_identity(p)}
    return Truth(node_pods, view.recompute(), keys, {(p.namespace, p.name) for p in node_pods.values()})


# --- metrics -------------------------------------------------------------------------------------------


Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str | None) -> Samples:
    """Prometheus text -> sample name -> [(labels, value)]; empty when the endpoint did not answer."""
    result: Samples = {}
    if not text:
        return result
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            result.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return result


def metric_sum(samples: Samples, name: str, **labels: str) -> float | None:
    rows = samples.get(name)
    if rows is None:
        return None
    return sum(v for lab, v in rows if all(lab.get(k) == want for k, want in labels.items()))


# --- violations ----------------------------------------------------------------------------------------


@dataclass
class Violation:
    invariant: str  # "I1" .. "I6"
    subject: str  # an IP, a pod, a counter name
    detail: str
    first_seen: float  # restarted when a hold ends (only time after a fault counts toward the settle time)
    last_seen: float
    appeared: float | None = None  # when it was first seen (never restarted): None means first_seen
    during_hold: bool = False  # the checks were held at some sample while it was open


@dataclass
class Transients:
    """The violations of one invariant that cleared within the settle time, and the longest of them: of those
    the checks saw running freely, and of those open during a hold (a deliberate outage, such as an agent
    SIGKILL: the settle clock stops, the violation does not)."""

    count: int = 0  # all of them, held ones included
    longest_s: float = 0.0  # outside holds: from the first sample that saw it to the first that did not
    subject: str = ""
    detail: str = ""
    held_count: int = 0  # open at some sample while the checks were held
    held_longest_s: float = 0.0
    held_subject: str = ""
    held_detail: str = ""

    def add(self, violation: Violation, cleared: float) -> None:
        self.count += 1
        lasted = cleared - (violation.first_seen if violation.appeared is None else violation.appeared)
        if violation.during_hold:
            self.held_count += 1
            if self.held_count == 1 or lasted > self.held_longest_s:
                self.held_longest_s, self.held_subject, self.held_detail = lasted, violation.subject, violation.detail
        elif self.count - self.held_count == 1 or lasted > self.longest_s:
            self.longest_s, self.subject, self.detail = lasted, violation.subject, violation.detail

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "longest_s": round(self.longest_s, 2), "subject": self.subject,
                "detail": self.detail, "held_count": self.held_count,
                "held_longest_s": round(self.held_longest_s, 2), "held_subject": self.held_subject,
                "held_detail": self.held_detail}


@dataclass
class Observation:
    """One sample: truth, the kernel filter (None: not readable now), and the processes' metrics."""

    at: float
    truth: Truth
    kernel: set[str] | None
    capacity: int | None
    agent: Samples
    operator: Samples | None
    agent_up: bool
    agent_pods: set[str] | None = None  # UIDs in the agent's store (its /debug/state), None: not read
    operator_keys: set[IdentityKey] | None = None  # identities the operator holds (/debug/identities)


@dataclass
class Checker:
    """Turns samples into violations and failures (see the module docstring)."""

    settle: float
    metrics_grace: float = 5.0  # I5: the last scrape may still see a gone pod's final value
    clock: Callable[[], float] = time.monotonic
    open: dict[tuple[str, str, str], Violation] = field(default_factory=dict)
    failures: list[Violation] = field(default_factory=list)
    transient: int = 0
    transients: dict[str, Transients] = field(default_factory=dict)  # invariant -> cleared violations
    checked: set[str] = field(default_factory=set)  # invariants some sample could check (the report's table)
    overflow_seen: int = 0
    last_holder: dict[str, str] = field(default_factory=dict)  # ip -> "ns/name" of its last holder
    traffic_pods: set[str] = field(default_factory=set)  # "ns/name" of pods the lab sent traffic from/to
    _held: int = 0
    _failed_keys: set[tuple[str, str, str]] = field(default_factory=set)
    _graced: set[tuple[str, str, str]] = field(default_factory=set)  # gone pods' series: settle + metrics_grace

    # --- holds ----------------------------------------------------------------------------------

    def hold(self) -> None:
        self._held += 1

    def release(self) -> None:
        self._held = max(0, self._held - 1)
        if not self._held:
            now = self.clock()
            for violation in self.open.values():
                violation.first_seen = max(violation.first_seen, now)

    @property
    def held(self) -> bool:
        return self._held > 0

    # --- one sample -----------------------------------------------------------------------------

    def observe(self, obs: Observation) -> list[Violation]:
        """Check one sample; returns the violations open now (failed ones included)."""
        for pod in obs.truth.node_pods.values():
            for ip in pod.ips:
                self.last_holder[ip] = pod.key
        found: dict[tuple[str, str, str], tuple[str, str, str]] = {}
        for invariant, subject, detail in self._violations(obs):
            found[_identity(invariant, subject, detail)] = (invariant, subject, detail)
        self.checked |= _checked_by(obs) | {invariant for invariant, _, _ in found.values()}
        now = self.clock()
        for key in [k for k in self.open if k not in found]:
            if key not in self._failed_keys:
                self.transient += 1
                self.transients.setdefault(key[0], Transients()).add(self.open[key], now)
            del self.open[key]
            self._graced.discard(key)
        for key, (invariant, subject, detail) in found.items():
            violation = self.open.get(key)
            if violation is None:
                violation = self.open[key] = Violation(invariant, subject, detail, now, now, appeared=now)
            violation.last_seen, violation.detail = now, detail
            violation.during_hold = violation.during_hold or self.held
            allowed = self.settle + (self.metrics_grace if key in self._graced else 0.0)
            if not self.held and now - violation.first_seen > allowed and key not in self._failed_keys:
                self._failed_keys.add(key)
                self.failures.append(violation)
        return list(self.open.values())

    def _violations(self, obs: Observation) -> list[tuple[str, str, str]]:
        found = self._filter_violations(obs) if obs.kernel is not None else []
        if obs.agent_up:
            found += self._store_violations(obs) + self._metric_violations(obs)
        if obs.operator_keys is not None:
            found += self._identity_violations(obs)
        return found

    def _filter_violations(self, obs: Observation) -> list[tuple[str, str, str]]:
        """I2 (both directions, capacity rule) and I3 (ineligible pods never count)."""
        assert obs.kernel is not None
        truth, kernel, found = obs.truth, obs.kernel, []
        for ip in sorted(kernel - truth.desired.keys()):
            holders = truth.holders(ip)
            if holders:
                who = ", ".join(f"{p.key} ({why_not_counted(p)})" for p in holders)
                invariant = "I3" if any(why_not_counted(p) != NOT_OBSERVED for p in holders) else "I2"
                found.append((invariant, ip, f"{ip} is in the kernel filter but its pods do not count: {who}"))
            else:
                last = self.last_holder.get(ip, "no pod seen by the lab")
                found.append(("I2", ip, f"leaked: {ip} is in the kernel filter but no pod holds it "
                                        f"(last held by {last})"))
        missing = sorted(truth.desired.keys() - kernel)
        full = obs.capacity is not None and len(kernel) >= obs.capacity and kernel <= truth.desired.keys()
        if missing and full:
            self.overflow_seen = max(self.overflow_seen, len(missing))
            return found
        for ip in missing:
            owners = ", ".join(sorted(truth.node_pods[u].key for u in truth.desired[ip]))
            found.append(("I2", ip, f"missing: {ip} of observed {owners} is not in the kernel filter"))
        return found

    def _store_violations(self, obs: Observation) -> list[tuple[str, str, str]]:
        """I1: the agent's store holds exactly the node's pods. Compared pod by pod, not by counts: under
        churn two counts read a moment apart always differ, while one pod missing (or kept) past the settle
        time is a real fault."""
        if obs.agent_pods is None:
            return []
        truth = obs.truth.node_pods
        found = [("I1", truth[uid].key, f"missing: the agent's store lacks {truth[uid].key} (uid {uid})")
                 for uid in sorted(truth.keys() - obs.agent_pods)]
        found += [("I1", uid, f"kept: the agent's store holds uid {uid}, which the API server does not have "
                              "on the node") for uid in sorted(obs.agent_pods - truth.keys())]
        return found

    def _metric_violations(self, obs: Observation) -> list[tuple[str, str, str]]:
        """I5: a per-pod series exists only for a pod of the node (after a short grace period), and a pod
        the lab sent no traffic to or from has no bytes: anything there came from an earlier owner of its
        IP (failure mode F21 in docs/design.md)."""
        found: list[tuple[str, str, str]] = []
        for labels, value in obs.agent.get("podmeter_pod_bytes_total", []):
            pod = (labels.get("namespace", ""), labels.get("pod", ""))
            key = f"{pod[0]}/{pod[1]}"
            if pod not in obs.truth.pod_names:
                self._graced.add(("I5", key, ""))
                found.append(("I5", key, f"series podmeter_pod_bytes_total of {key}, a pod that is gone"))
            elif value > 0 and key not in self.traffic_pods:
                found.append(("I5", f"{key}/{labels.get('direction')}",
                              f"{key} shows {value:.0f} {labels.get('direction')} bytes but the lab sent it "
                              f"nothing: traffic of an earlier owner of its IP?"))
        return found

    def _identity_violations(self, obs: Observation) -> list[tuple[str, str, str]]:
        """I4: identities held == label sets of live pods, set by set (see I1 on why not by counts)."""
        assert obs.operator_keys is not None
        want = obs.truth.identity_keys
        found = [("I4", key.encode(), f"missing: no identity for the label set {key.encode()} of live pods")
                 for key in sorted(want - obs.operator_keys, key=IdentityKey.encode)]
        found += [("I4", key.encode(), f"leaked: identity {key.encode()} is held but no live pod has it")
                  for key in sorted(obs.operator_keys - want, key=IdentityKey.encode)]
        return found

    def summary(self) -> dict[str, Any]:
        return {"failures": [_violation_json(v) for v in self.failures], "transient": self.transient,
                "transients": {inv: t.as_json() for inv, t in sorted(self.transients.items())},
                "checked": sorted(self.checked),
                "overflow_max_waiting": self.overflow_seen}


def _identity(invariant: str, subject: str, detail: str) -> tuple[str, str, str]:
    """What makes two samples' violations *the same* one. A filter violation is about an IP *and* its
    pods: under churn an IP passes from pod to pod in seconds (lowest free IP first), and a new pod's IP
    in flight is a new transient, not the continuation of the last pod's. I1 and I4 subjects are a pod
    or a label set, which churn does not reuse. I7 (an agent's endpoint cache, :mod:`podmeter.lab.endpointcheck`)
    is about an IP and the pod the cache names or lacks for it: its detail up to the first ``;`` (after it
    comes who holds the IP now, which churn changes while one stale entry stays)."""
    if invariant == "I7":
        return (invariant, subject, detail.partition(";")[0])
    return (invariant, subject, detail if invariant in ("I2", "I3") else "")


def _checked_by(obs: Observation) -> set[str]:
    """The invariants one sample can check: I2 and I3 with the kernel filter read, I1 and I5 with the agent
    up (I1 with its store read), I4 with the operator's identities read. A check added to :meth:`Checker.
    _violations` adds its invariant here, else the report shows it as not checked until it finds a violation."""
    checked = {"I2", "I3"} if obs.kernel is not None else set()
    if obs.agent_up:
        checked |= {"I5"} | ({"I1"} if obs.agent_pods is not None else set())
    if obs.operator_keys is not None:
        checked.add("I4")
    return checked


def _violation_json(v: Violation) -> dict[str, Any]:
    return {"invariant": v.invariant, "subject": v.subject, "detail": v.detail,
            "lasted_s": round(v.last_seen - v.first_seen, 2)}
