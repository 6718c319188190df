"""Reading the ``default`` MetricsConfiguration and writing its status, through lightkube.

The operator's status writer (``runtime.operator.ConfigurationStatus``) decides what to write; this adapter
only speaks to the API server (cluster-scoped ``metricsconfigurations`` of ``podmeter.io/v1alpha1``).
"""

from __future__ import annotations

from typing import Any


class KubeConfigApi:
    """:class:`ConfigApi` over a lightkube ``AsyncClient`` (cluster-scoped ``metricsconfigurations``)."""

    def __init__(self, client: Any) -> None:
        from lightkube.generic_resource import create_global_resource

        self._client = client
        self._res: Any = create_global_resource(
            "podmeter.io", "v1alpha1", "MetricsConfiguration", "metricsconfigurations"
        )

    async def get(self, name: str) -> dict[str, Any] | None:
        from lightkube import ApiError

        try:
            obj = await self._client.get(self._res, name)
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise
        return dict(obj.to_dict())

    async def write_status(self, name: str, status: dict[str, Any]) -> None:
        from lightkube.types import PatchType

        await self._client.patch(self._res.Status, name, {"status": status}, patch_type=PatchType.MERGE)
