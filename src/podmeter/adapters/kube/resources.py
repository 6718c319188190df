"""The kinds the agent and operator watch, and how each is decoded and keyed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from podmeter.model.configuration import decode_configuration
from podmeter.model.records import decode_namespace, decode_pod, decode_pod_event


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


_uid = attrgetter("uid")
_name = attrgetter("name")
_rv = attrgetter("resource_version")

PODS = ResourceKind("pods", "/api/v1/pods", decode_pod, _uid, "uid", _rv, decode_pod_event)
NAMESPACES = ResourceKind("namespaces", "/api/v1/namespaces", decode_namespace, _name, "name", _rv)
METRICS_CONFIGURATIONS = ResourceKind(
    "metricsconfigurations",
    "/apis/podmeter.io/v1alpha1/metricsconfigurations",
    decode_configuration,
    _name,
    "name",
    _rv,
)
