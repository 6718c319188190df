"""Which pods count: eligibility (can the pod be in the filter at all) and interest (did users ask).

observed(pod) = eligible(pod) and not excluded(ns) and (included(ns) or annotated(pod) or annotated(ns))

* eligible: not hostNetwork (its IP is the node's), has at least one IP, not terminal
  (Succeeded/Failed: its IP may already belong to another pod), and bound to this node when the view is
  node-scoped. A pod that is being deleted (deletionTimestamp set) still runs and still sends traffic, so
  it stays eligible until it is gone.
* annotated: ``podmeter.io/observe: "true"`` on the pod or its namespace, counted only while the
  MetricsConfiguration allows annotations (``spec.annotations``, default true; true without any object).
* included / excluded: the ``default`` MetricsConfiguration's include list, or with an empty include list
  its exclude list (every namespace but these). Both lists empty: only annotations count.
"""

from __future__ import annotations

from podmeter.model.configuration import Interest
from podmeter.model.records import TERMINAL_PHASES, Namespace, Pod


def observed(pod: Pod, namespace: Namespace | None, interest: Interest, node_name: str | None) -> bool:
    # eligible (see the module docstring)
    if pod.host_network or not pod.ips or pod.phase in TERMINAL_PHASES:
        return False
    if node_name is not None and pod.node_name != node_name:
        return False
    ns = pod.namespace
    if ns in interest.exclude:
        return False
    if ns in interest.include or (interest.exclude and not interest.include):
        return True
    if not interest.annotations:
        return False
    return pod.observe or (namespace is not None and namespace.observe)


def holds_identity(pod: Pod) -> bool:
    """Whether a pod has an endpoint of its own, so an identity: not host-network, not finished. (Unlike
    the filter, a pod without an IP yet holds one: its identity is ready when the IP comes.)"""
    return not pod.host_network and pod.phase not in TERMINAL_PHASES


def holds_address(pod: Pod) -> bool:
    """Whether the pod's IPs name it (a flow end): it has IPs of its own (not host-network) and runs
    (a finished pod's IP may already belong to another pod)."""
    return bool(pod.ips) and not pod.host_network and pod.phase not in TERMINAL_PHASES
