"""The names of flow ends: which pod (namespace, name, workload, node) an IP belonged to.

A flow's ends are IPs; :class:`AddressBook` turns them into :class:`Endpoint` records. The agent builds one
address book per drain from its node view, and drains *before* it applies any change of who holds an
address (a pod deleted, an IP reused, a pod finishing): so every drained flow is named by the pod that
held the IP while its packets were counted, never by the next holder.

The seam for cluster-wide endpoints: :class:`Names` is what naming needs; the local address book is one,
and a cache of the other nodes' pods plugs in behind it (:class:`ChainedNames`). An IP that no source
names is ``world``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import msgspec

from podmeter.model.interest import holds_address
from podmeter.model.records import Pod
from podmeter.model.workloads import workload_of


class Endpoint(msgspec.Struct, frozen=True, gc=False):
    """A named flow end: a pod. ``identity`` is the operator's numeric identity when known."""

    namespace: str
    pod: str
    workload_kind: str
    workload: str
    node: str
    uid: str = ""
    identity: int | None = None


def pod_endpoint(pod: Pod) -> Endpoint:
    kind, name = workload_of(pod)
    return Endpoint(pod.namespace, pod.name, kind, name, pod.node_name, pod.uid)


class Names(Protocol):
    """Who an IP is (None: no pod this source knows of holds it)."""

    def endpoint(self, ip: str) -> Endpoint | None: ...

    def is_local(self, ip: str) -> bool:
        """Whether the IP is a pod of this node (its packets are seen leaving it here)."""
        ...


class AddressBook:
    """IP -> the endpoint of the pod holding it, for a set of pods (one node's store, as of one moment).

    Invariant: an IP maps to a pod iff that pod holds addresses (:func:`holds_address`) and has the IP;
    when two pods claim one IP (the old one's delete not seen yet), the pod stored last wins, the one the
    IP was given to most recently.
    """

    def __init__(self, pods: Iterable[Pod], published: Names | None = None) -> None:
        """``published``: the cluster's endpoints, to give the node's pods their identities."""
        self._by_ip: dict[str, Endpoint] = {}
        for pod in pods:
            if holds_address(pod):
                endpoint = pod_endpoint(pod)
                if published is not None:
                    endpoint = _with_identity(endpoint, published.endpoint(pod.ips[0]))
                for ip in pod.ips:
                    self._by_ip[ip] = endpoint

    def __len__(self) -> int:
        return len(self._by_ip)

    def endpoint(self, ip: str) -> Endpoint | None:
        return self._by_ip.get(ip)

    def is_local(self, ip: str) -> bool:
        return ip in self._by_ip


def _with_identity(endpoint: Endpoint, published: Endpoint | None) -> Endpoint:
    if published is None or published.identity is None or (published.namespace, published.pod) != (
            endpoint.namespace, endpoint.pod):
        return endpoint
    return msgspec.structs.replace(endpoint, identity=published.identity)


class ChainedNames:
    """The local address book first, then the others (e.g. the cluster's endpoints); only the local
    book's IPs are local."""

    def __init__(self, local: Names, *others: Names) -> None:
        self._local = local
        self._others = others

    def endpoint(self, ip: str) -> Endpoint | None:
        found = self._local.endpoint(ip)
        for other in self._others:
            if found is not None:
                break
            found = other.endpoint(ip)
        return found

    def is_local(self, ip: str) -> bool:
        return self._local.is_local(ip)
