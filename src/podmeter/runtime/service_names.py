"""The agent's Services: the cluster's Services and EndpointSlices as listed and watched, and, per flow
drain, what naming a flow's ends by Service needs (``model.services.ServiceNaming``).

The stores are fed on the event loop by their reflectors' callbacks, outside the writer's queue: they
move nothing in the view or the datapath. The index is built again only after a change. The node's
translations are read from conntrack at each drain, and only while some Service has a frontend (a
cluster without Services costs nothing): in the agent's writer task, in a worker thread of their own
(``read_async``: the event loop serves meanwhile), after the drain took the kernel's entries. A
missing permission or API is an empty collection and one warning (the reflector's optional mode): flows
to Services are then named as today, by address.

Next stage: ``runtime.flow_drain`` passes the naming to ``model.flow_records.name_flows``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

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
        self._pool: ThreadPoolExecutor | None = None  # the conntrack reads' worker thread (read_async)
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

    def debug(self) -> dict[str, int]:
        """What ``/debug/state`` says of Services: the stores and the index (a test of baseline after churn
        reads them) and the conntrack reads."""
        frontends, node_ports, backends = self.index().sizes()
        return {"services": len(self.services), "endpointslices": len(self.backends), "frontends": frontends,
                "node_ports": node_ports, "backends": backends, "translations_read": self.translations_read,
                "last_translations": self.last_translations}

    def wants_translations(self) -> bool:
        """Whether naming this drain's flows reads the node's conntrack: some Service has a frontend, and
        there is a reader."""
        return self._translations is not None and bool(len(self.index()))

    def read(self) -> list[Translation]:
        """The node's translations now, in the calling thread (counted)."""
        if self._translations is None:
            return []
        entries = self._translations()
        self.translations_read += 1
        self.last_translations = len(entries)
        return entries

    async def read_async(self) -> list[Translation]:
        """:meth:`read` in the Services' worker thread (one: dumps never overlap), the event loop free
        meanwhile. The thread is made on first use, so it is in the netns the agent runs in."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="podmeter-conntrack")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.read)

    def close(self) -> None:
        """Let the worker thread go (a dump under way ends first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def naming(self, translations: list[Translation] | None = None) -> ServiceNaming | None:
        """What this drain names Services with, with ``translations`` read for it (None: read them now,
        here, if :meth:`wants_translations`); None when no Service has a frontend."""
        index = self.index()
        if not len(index):
            return None
        if translations is None and self.wants_translations():
            translations = self.read()
        translated = Translations((entry.original, entry.reply) for entry in translations or ())
        return ServiceNaming(index, translated, self._node_addresses())
