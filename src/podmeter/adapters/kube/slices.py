"""Writing ``PodSlice`` objects (``podmeter.io/v1alpha1``, cluster-scoped) through lightkube.

The operator's publisher (``runtime.endpoint_publisher``) decides what to write; this adapter creates,
replaces (with the resourceVersion it read, so a concurrent writer makes it fail instead of being
overwritten) and deletes. Every write returns the new resourceVersion.
"""

from __future__ import annotations

from typing import Any

from podmeter.model.endpoint_slices import GROUP, KIND, PLURAL, VERSION

LABELS = {"app.kubernetes.io/managed-by": "podmeter-operator"}


class SliceConflict(Exception):
    """The slice changed (or appeared, or went) since it was read: read again, then decide."""


class KubeSliceApi:
    """Create/replace/delete slices over a lightkube ``AsyncClient``."""

    def __init__(self, client: Any) -> None:
        from lightkube.generic_resource import create_global_resource

        self._client = client
        self._res: Any = create_global_resource(GROUP, VERSION, KIND, PLURAL)

    def _object(self, name: str, spec: dict[str, Any], resource_version: str | None) -> Any:
        metadata: dict[str, Any] = {"name": name, "labels": LABELS}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return self._res(apiVersion=f"{GROUP}/{VERSION}", kind=KIND, metadata=metadata, spec=spec)

    async def create(self, name: str, spec: dict[str, Any]) -> str:
        return await self._write(lambda: self._client.create(self._object(name, spec, None)))

    async def replace(self, name: str, resource_version: str, spec: dict[str, Any]) -> str:
        return await self._write(lambda: self._client.replace(self._object(name, spec, resource_version)))

    async def delete(self, name: str) -> None:
        from lightkube import ApiError

        try:
            await self._client.delete(self._res, name)
        except ApiError as exc:
            if exc.status.code != 404:  # already gone: the goal is reached
                raise

    async def _write(self, call: Any) -> str:
        from lightkube import ApiError

        try:
            written = await call()
        except ApiError as exc:
            if exc.status.code in (404, 409):
                raise SliceConflict(str(exc)) from None
            raise
        return str(written.metadata.resourceVersion or "")
