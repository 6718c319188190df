"""The kinds the agent and operator watch, and how each is decoded and keyed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from podmeter.model.configuration import MetricsConfiguration, decode_configuration
from podmeter.model.records import Namespace, Pod, decode_namespace, decode_pod, decode_pod_event


@dataclass(frozen=True)
class ResourceKind:
    """A watched collection: ``name`` (metric label), its cluster-wide ``path``, and its record type.

    ``key`` identifies an object across its lifetime: the UID for pods (a pod recreated with the same
    name is a different pod), the name for cluster-scoped kinds.
    """

    name: str
    path: str
    decode: Callable[[bytes], Any]
    key: Callable[[Any], str]
    key_field: str  # "uid" or "name": read from the raw metadata when the object does not decode
    resource_version: Callable[[Any], str]
    decode_event: Callable[[bytes], tuple[str, Any]] | None = None  # one-pass fast path for watch lines


def _pod_key(pod: Pod) -> str:
    return pod.uid


def _pod_rv(pod: Pod) -> str:
    return pod.resource_version


def _ns_key(ns: Namespace) -> str:
    return ns.name


def _ns_rv(ns: Namespace) -> str:
    return ns.resource_version


def _config_key(config: MetricsConfiguration) -> str:
    return config.name


def _config_rv(config: MetricsConfiguration) -> str:
    return config.resource_version


PODS = ResourceKind("pods", "/api/v1/pods", decode_pod, _pod_key, "uid", _pod_rv, decode_pod_event)
NAMESPACES = ResourceKind("namespaces", "/api/v1/namespaces", decode_namespace, _ns_key, "name", _ns_rv)
METRICS_CONFIGURATIONS = ResourceKind(
    "metricsconfigurations",
    "/apis/podmeter.io/v1alpha1/metricsconfigurations",
    decode_configuration,
    _config_key,
    "name",
    _config_rv,
)
