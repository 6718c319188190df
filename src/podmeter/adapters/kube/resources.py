"""The kinds the agent and operator watch: where each lives on the API server and how it is decoded.

Each :class:`ResourceKind` wraps one model :class:`~podmeter.model.deltas.Collection`, so the deltas a
reflector produces are typed by the collection they belong to (next stage: ``podmeter.model.store``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Generic, TypeVar

from podmeter.model import deltas
from podmeter.model.configuration import MetricsConfiguration, decode_configuration
from podmeter.model.endpoint_slices import PodSlice, SliceDigest, decode_slice, decode_slice_digest
from podmeter.model.records import Namespace, Node, Pod, decode_namespace, decode_node, decode_pod, decode_pod_event
from podmeter.model.services import Service, ServiceBackends, decode_service, decode_service_backends

R = TypeVar("R")


@dataclass(frozen=True, eq=False)
class ResourceKind(Generic[R]):
    """A watched collection on the wire: its cluster-wide ``path`` and how its records are decoded.

    ``key_field`` ("uid" or "name") is read from the raw metadata when an object does not decode, so the
    reflector can still name it in a delete or in ``Replace.keep``.
    """

    collection: deltas.Collection[R]
    path: str
    decode: Callable[[bytes], R]
    key_field: str
    resource_version: Callable[[R], str]
    decode_event: Callable[[bytes], tuple[str, R]] | None = None  # one-pass fast path for watch lines

    @property
    def name(self) -> str:
        return self.collection.name

    def key(self, item: R) -> str:
        return self.collection.key(item)


_rv = attrgetter("resource_version")

PODS: ResourceKind[Pod] = ResourceKind(deltas.PODS, "/api/v1/pods", decode_pod, "uid", _rv, decode_pod_event)
NAMESPACES: ResourceKind[Namespace] = ResourceKind(
    deltas.NAMESPACES, "/api/v1/namespaces", decode_namespace, "name", _rv
)
METRICS_CONFIGURATIONS: ResourceKind[MetricsConfiguration] = ResourceKind(
    deltas.CONFIGURATIONS, "/apis/podmeter.io/v1alpha1/metricsconfigurations", decode_configuration, "name", _rv
)
_SLICES_PATH = "/apis/podmeter.io/v1alpha1/podslices"
# The agent reads slices into an endpoint cache; the publishing operator only needs each one's digest.
POD_SLICES: ResourceKind[PodSlice] = ResourceKind(deltas.POD_SLICES, _SLICES_PATH, decode_slice, "name", _rv)
SLICE_DIGESTS: ResourceKind[SliceDigest] = ResourceKind(
    deltas.SLICE_DIGESTS, _SLICES_PATH, decode_slice_digest, "name", _rv
)
# The cluster's nodes and their addresses: the peers the agent's Hubble API announces to Hubble Relay.
NODES: ResourceKind[Node] = ResourceKind(deltas.NODES, "/api/v1/nodes", decode_node, "name", _rv)
# The cluster's Services and their EndpointSlices: the names of flows to a Service (model.services).
SERVICES: ResourceKind[Service] = ResourceKind(deltas.SERVICES, "/api/v1/services", decode_service, "uid", _rv)
SERVICE_BACKENDS: ResourceKind[ServiceBackends] = ResourceKind(
    deltas.SERVICE_BACKENDS, "/apis/discovery.k8s.io/v1/endpointslices", decode_service_backends, "uid", _rv
)
