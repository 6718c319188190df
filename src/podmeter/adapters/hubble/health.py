"""``grpc.health.v1.Health/Check``: SERVING for ``hubble.server.Observer`` (what `hubble status` asks first),
for ``observer.Observer`` and for the server as a whole (``""``).

Next stage: ``adapters.hubble.server`` registers the handler beside ``observer`` and ``peer``.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc import aio

from podmeter.adapters.hubble.proto import health_pb2

HEALTHY_SERVICES = frozenset({"", "hubble.server.Observer", "observer.Observer"})


class HealthService:
    def handlers(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler("grpc.health.v1.Health", methods)

    async def check(self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext[Any, Any]
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in HEALTHY_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
