"""What a reflector hands to the store: typed deltas of one collection, carrying slim records only.

A delta names its :class:`Collection` (a typed token, not a string), so the view routes it to the store of
that collection without comparing names or testing record types. The three kinds are client-go's:

* :class:`Replace`: a (re)list; the collection is exactly ``items``, except keys in ``keep`` (listed but
  undecodable: their last good state stays);
* :class:`Upsert`: one object added or changed;
* :class:`Delete`: the object with ``key`` is gone (``last`` is its final state when it decoded).

Next stage: :class:`podmeter.model.store.Store` applies a delta and returns the changes it made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Generic, TypeVar

import msgspec

from podmeter.model.configuration import MetricsConfiguration
from podmeter.model.endpoint_slices import PodSlice, SliceDigest
from podmeter.model.records import Namespace, Node, Pod
from podmeter.model.services import Service, ServiceBackends

R = TypeVar("R")


@dataclass(frozen=True, eq=False)
class Collection(Generic[R]):
    """One watched collection: ``name`` (the metric label) and how a record is keyed. The key names an
    object across its lifetime: the UID for pods (a pod recreated under the same name is another pod),
    the name for cluster-scoped kinds. Compared by identity: each collection is one module constant."""

    name: str
    key: Callable[[R], str]

    def __repr__(self) -> str:
        return f"Collection({self.name})"


PODS: Collection[Pod] = Collection("pods", attrgetter("uid"))
NAMESPACES: Collection[Namespace] = Collection("namespaces", attrgetter("name"))
CONFIGURATIONS: Collection[MetricsConfiguration] = Collection("metricsconfigurations", attrgetter("name"))
POD_SLICES: Collection[PodSlice] = Collection("podslices", attrgetter("name"))  # the agent's view of them
SLICE_DIGESTS: Collection[SliceDigest] = Collection("podslices", attrgetter("name"))  # the operator's
NODES: Collection[Node] = Collection("nodes", attrgetter("name"))  # the agent's, with the Hubble API only
SERVICES: Collection[Service] = Collection("services", attrgetter("uid"))  # the agent's: naming flows
SERVICE_BACKENDS: Collection[ServiceBackends] = Collection("endpointslices", attrgetter("uid"))


# Deltas are msgspec structs, not dataclasses: one is built per watch event, and a frozen struct is
# built seven times faster than a frozen dataclass.


class Replace(msgspec.Struct, Generic[R], frozen=True, gc=False):
    """A (re)list: the collection is exactly ``items``, except objects under ``keep`` that failed to decode
    (their last good state must stay, so they are neither replaced nor deleted)."""

    collection: Collection[R]
    items: Sequence[R]
    keep: frozenset[str] = frozenset()


class Upsert(msgspec.Struct, Generic[R], frozen=True, gc=False):
    """One object was added or changed."""

    collection: Collection[R]
    item: R


class Delete(msgspec.Struct, Generic[R], frozen=True, gc=False):
    """The object with ``key`` is gone (``last`` is its final state when it could be decoded)."""

    collection: Collection[R]
    key: str
    last: R | None = None


Delta = Replace[R] | Upsert[R] | Delete[R]
