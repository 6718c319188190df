"""The agent's Services: the cluster's Services and EndpointSlices as listed and watched, and, per flow
drain, what naming a flow's ends by Service needs (``model.services.ServiceNaming``).

The stores are fed on the event loop by their reflectors' callbacks, outside the writer's queue: they
move nothing in the view or the datapath. The index is built again only after a change. The node's
translations are read from conntrack at each drain, and only while some Service has a frontend (a
cluster without Services costs nothing). A missing permission or API is an empty collection and one
warning (the reflector's optional mode): flows to Services are then named as today, by address.

Next stage: ``runtime.flow_drain`` passes the naming to ``model.flow_records.name_flows``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from podmeter.adapters.conntrack import Translation
from podmeter.adapters.kube.resources import SERVICE_BACKENDS, SERVICES
from podmeter.model.deltas import Delta
from podmeter.model.services import Service, ServiceBackends, ServiceIndex, ServiceNaming, Translations
from podmeter.model.store import Store

SERVICES_HINT = ("flows to Services are named by address only; grant the agent list and watch on services "
                 "and endpointslices (deploy/base/agent-rbac.yaml)")


class ServiceNames:
    """``translations``: reads the node's translated connections (``adapters.conntrack``), None: never;
    ``node_addresses``: where NodePorts are reached (the node's own addresses)."""

    def __init__(self, translations: Callable[[], list[Translation]] | None = None,
                 node_addresses: Callable[[], Iterable[str]] = tuple) -> None:
        self.services: Store[Service] = Store(SERVICES.collection)
        self.backends: Store[ServiceBackends] = Store(SERVICE_BACKENDS.collection)
        self._translations = translations
        self._node_addresses = node_addresses
        self._index: ServiceIndex | None = None
        self.translations_read = 0  # drains that read conntrack
        self.last_translations = 0

    async def apply_services(self, delta: Delta[Service]) -> None:
        if self.services.apply(delta):
            self._index = None

    async def apply_backends(self, delta: Delta[ServiceBackends]) -> None:
        if self.backends.apply(delta):
            self._index = None

    def index(self) -> ServiceIndex:
        if self._index is None:
            self._index = ServiceIndex(self.services, self.backends)
        return self._index

    def naming(self) -> ServiceNaming | None:
        """What this drain names Services with; None when no Service has a frontend."""
        index = self.index()
        if not len(index):
            return None
        translated = Translations()
        if self._translations is not None:
            entries = self._translations()
            self.translations_read += 1
            self.last_translations = len(entries)
            translated = Translations((entry.original, entry.reply) for entry in entries)
        return ServiceNaming(index, translated, self._node_addresses())
