"""Lease stores for leader election: one ``coordination.k8s.io/v1`` Lease on the API server, or one in memory.

Both give optimistic concurrency: ``update`` with a stale resourceVersion and ``create`` of an existing
Lease raise :class:`~podmeter.model.lease.LeaseConflict`. Next stage: ``runtime.leadership``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from podmeter.model.lease import LeaseConflict, LeaseRecord


class MemoryLeaseStore:
    """A Lease in process memory with optimistic concurrency (for single-process setups and tests)."""

    def __init__(self) -> None:
        self._record: LeaseRecord | None = None
        self._version = 0

    async def get(self) -> LeaseRecord | None:
        return self._record

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        if self._record is not None:
            raise LeaseConflict("lease exists")
        return self._store(record)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        if self._record is None or record.resource_version != self._record.resource_version:
            raise LeaseConflict("lease changed")
        return self._store(record)

    def _store(self, record: LeaseRecord) -> LeaseRecord:
        self._version += 1
        self._record = replace(record, resource_version=str(self._version))
        return self._record


class KubeLeaseStore:
    """The Lease ``namespace/name`` on a Kubernetes API server, through a lightkube ``AsyncClient``."""

    def __init__(self, client: Any, namespace: str, name: str) -> None:
        self._client, self._namespace, self._name = client, namespace, name

    async def get(self) -> LeaseRecord | None:
        from lightkube import ApiError
        from lightkube.resources.coordination_v1 import Lease

        try:
            lease = await self._client.get(Lease, self._name, namespace=self._namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise
        spec = lease.spec
        return LeaseRecord(
            holder=spec.holderIdentity or "",
            duration_s=spec.leaseDurationSeconds or 0,
            renew_time=spec.renewTime,
            acquire_time=spec.acquireTime,
            transitions=spec.leaseTransitions or 0,
            resource_version=lease.metadata.resourceVersion or "",
        )

    async def create(self, record: LeaseRecord) -> LeaseRecord:
        return await self._write(record, create=True)

    async def update(self, record: LeaseRecord) -> LeaseRecord:
        return await self._write(record, create=False)

    async def _write(self, record: LeaseRecord, *, create: bool) -> LeaseRecord:
        from lightkube import ApiError
        from lightkube.models.coordination_v1 import LeaseSpec
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.coordination_v1 import Lease

        meta = ObjectMeta(name=self._name, namespace=self._namespace)
        if not create:
            meta.resourceVersion = record.resource_version
        lease = Lease(metadata=meta, spec=LeaseSpec(
            holderIdentity=record.holder,
            leaseDurationSeconds=record.duration_s,
            renewTime=record.renew_time,
            acquireTime=record.acquire_time,
            leaseTransitions=record.transitions,
        ))
        try:
            out = await (self._client.create(lease) if create else self._client.replace(lease))
        except ApiError as exc:
            if exc.status.code in (409, 422) or exc.status.reason in ("AlreadyExists", "Conflict"):
                raise LeaseConflict(str(exc)) from None
            raise
        return replace(record, resource_version=out.metadata.resourceVersion or "")
