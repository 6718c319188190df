"""The agent's Services (runtime.service_names): the stores follow their reflectors' deltas, the index is
built again only after a change, conntrack is read only while some Service has a frontend, and churn
leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from podmeter.adapters.conntrack import Translation, Tuple
from podmeter.model.deltas import SERVICE_BACKENDS, SERVICES, Delete, Replace, Upsert
from podmeter.model.services import Service, ServicePort, port_table, service_backends
from podmeter.runtime.service_names import ServiceNames

pytestmark = pytest.mark.fast
TCP = 6


def service(index: int) -> Service:
    return Service("shop", f"web-{index}", f"uid-{index}", "ClusterIP", f"10.96.{index // 250}.{index % 250 + 1}",
                   port_table([ServicePort("http", TCP, 80)]))


def test_conntrack_is_read_only_while_a_service_has_a_frontend_and_churn_returns_to_empty() -> None:
    reads: list[int] = []
    translation = Translation(Tuple(TCP, "10.0.2.7", 40000, "10.96.0.1", 80), Tuple(TCP, "10.0.1.5", 8080,
                                                                                      "10.0.2.7", 40000), False)

    def translations() -> list[Translation]:
        reads.append(1)
        return [translation]

    names = ServiceNames(translations)

    async def churn() -> None:
        assert names.naming() is None and not reads  # no Service: nothing asked of the kernel
        for index in range(1000):
            await names.apply_services(Upsert(SERVICES, service(index)))
        first = names.index()
        assert names.index() is first, "built once until the next change"
        naming = names.naming()
        assert naming is not None and reads == [1]
        service_name, backend = naming.ends((TCP, "10.0.2.7", 40000, "10.96.0.1", 80))[1]
        assert service_name is not None and (service_name.named, backend) == (("shop", "web-0"), "10.0.1.5")
        await names.apply_backends(Upsert(SERVICE_BACKENDS, service_backends(
            "shop", "web-0-abc", "s0", "web-0", addresses=["10.0.1.5"], ports=[(TCP, 8080)])))
        assert names.index() is not first
        for index in range(1000):
            await names.apply_services(Delete(SERVICES, f"uid-{index}"))
        await names.apply_backends(Replace(SERVICE_BACKENDS, []))
        assert len(names.services) == 0 and len(names.backends) == 0 and names.index().sizes() == (0, 0, 0)
        assert names.naming() is None and reads == [1]

    asyncio.run(churn())
