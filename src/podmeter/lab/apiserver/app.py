"""The aiohttp application: routing of Kubernetes REST paths, auth, fault injection, counting.

Request path: authenticate (401) → injected failure (fail fault) → route → verb handler → count. Every
:class:`ApiError` becomes a ``Status`` body with its code and headers; anything unexpected becomes a 500
``InternalError`` Status, and the server stays up. ``/_lab/`` goes to the admin API (admin.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from podmeter.lab.apiserver import discovery, errors, options, protobuf, tables
from podmeter.lab.apiserver.admin import Admin
from podmeter.lab.apiserver.errors import ApiError
from podmeter.lab.apiserver.faults import Faults
from podmeter.lab.apiserver.registry import PATCH_TYPES, Registry, WriteContext
from podmeter.lab.apiserver.resources import NAMESPACES, PODS, SERVICES, ResourceType, lookup
from podmeter.lab.apiserver.services import NODE_PORT_RANGE, SERVICE_CIDR, ServiceAllocator, kubernetes_service
from podmeter.lab.apiserver.store import Store, decode, encode
from podmeter.lab.apiserver.watching import WatchHub

log = logging.getLogger("podmeter.lab.apiserver")

MAX_BODY = 3 * 1024 * 1024  # the real server's request body limit
JSON = "application/json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
COUNTED = web.RequestKey("counted", bool)  # set once a watch was counted at open


@dataclass
class Settings:
    token: str
    history: int = 10_000
    bookmark_interval: float = 60.0
    graceful_pod_deletion: bool = False
    too_large_wait: float = 3.0
    watch_queue_limit: int = 10_000
    server_address: str = "127.0.0.1:6443"
    # ClusterIPs come from here (kubeadm's default; "CIDR,CIDR" of both families: dual-stack); the first
    # address is the ``kubernetes`` Service's. NodePorts from the range.
    service_cidr: str = SERVICE_CIDR
    service_node_port_range: str = NODE_PORT_RANGE


@dataclass
class Route:
    """A parsed REST path."""

    resource: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


class LabApiServer:
    """State shared by all requests: store, registry, watch hub, faults, counters."""

    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        self.settings = settings
        self.store = store or Store(history=settings.history)
        self.registry = Registry(
            self.store,
            settings.too_large_wait,
            ServiceAllocator(settings.service_cidr, settings.service_node_port_range),
        )
        self.faults = Faults()
        self.hub = WatchHub(
            self.store,
            self.faults,
            settings.bookmark_interval,
            settings.watch_queue_limit,
            settings.too_large_wait,
        )
        self.admin = Admin(self)
        self.restart_hook: Callable[[float], Awaitable[None]] | None = None
        self.background: asyncio.Future[None] | None = None  # the restart in progress
        self.started = time.time()
        if not self.store.objects[NAMESPACES.key]:
            for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
                self.registry.create(NAMESPACES, None, {"metadata": {"name": name}}, WriteContext())
            # The Service a real control plane keeps for itself, on the first ClusterIP.
            self.registry.create(SERVICES, "default", kubernetes_service(self.registry.services.kubernetes_ip()),
                                 WriteContext(manager="kube-apiserver"))

    # --- aiohttp wiring --------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY + 1)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        verb, resource = _classify(request)
        admin = request.path.startswith("/_lab/")
        try:
            self._authenticate(request)
            if not admin:
                injected = self.faults.take_failure(verb)
                if injected is not None:
                    raise injected
            response = await handler(request)
        except ApiError as err:
            response = status_response(err)
        except Exception as exc:  # a bug must not take the server down: answer 500 and log it
            log.exception("internal error on %s %s", request.method, request.path)
            response = status_response(errors.internal(f"{type(exc).__name__}: {exc}"))
        if not admin and not request.get(COUNTED):
            self.admin.requests.add(verb, resource, response.status, request)
        if not response.prepared:
            response.headers.setdefault("Audit-Id", str(uuid.uuid4()))
        return response

    def _authenticate(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.settings.token.encode()):
            raise errors.unauthorized()

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.startswith("/_lab/"):
            return await self.admin.handle(request)
        static = self._static(path)
        if static is not None:
            return static
        route = _parse_route(path)
        if route is None:
            raise ApiError(
                404,
                "NotFound",
                "the server could not find the requested resource",
                {"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]},
            )
        return await self._resource(request, route)

    def _static(self, path: str) -> web.Response | None:
        path = path.rstrip("/") or "/"
        doc: Any = None
        if path == "/version":
            doc = discovery.VERSION
        elif path == "/api":
            doc = discovery.api_versions(self.settings.server_address)
        elif path == "/apis":
            doc = discovery.api_group_list()
        elif path == "/openapi/v3":
            doc = discovery.openapi_root()
        elif path.startswith("/openapi/v3/"):
            gv = path.removeprefix("/openapi/v3/").split("/")
            if gv[0] == "api" and len(gv) == 2:
                doc = discovery.openapi_gv("", gv[1])
            elif gv[0] == "apis" and len(gv) == 3:
                doc = discovery.openapi_gv(gv[1], gv[2])
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        elif path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok", content_type="text/plain")
        else:
            parts = path.strip("/").split("/")
            if parts[0] == "api" and len(parts) == 2:
                doc = discovery.resource_list("", parts[1])
            elif parts[0] == "apis" and len(parts) == 2:
                doc = discovery.api_group(parts[1])
            elif parts[0] == "apis" and len(parts) == 3:
                doc = discovery.resource_list(parts[1], parts[2])
            discovery_path = (parts[0] == "api" and len(parts) == 2) or (parts[0] == "apis" and len(parts) in (2, 3))
            if doc is None and discovery_path:
                raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        return None if doc is None else json_response(encode(doc))

    # --- resources -------------------------------------------------------------------------------------
    async def _resource(self, request: web.Request, route: Route) -> web.StreamResponse:
        r = route.resource
        if route.subresource == "binding" and r is PODS and route.name is not None and request.method == "POST":
            body = await _read_json(request, r)
            return json_response(self.registry.bind(route.namespace, route.name, body, _context(request)), 201)
        if route.subresource not in (None, "status") or (route.subresource == "status" and not r.has_status):
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if route.name is None:
            return await self._collection(request, route)
        return await self._item(request, route, route.name)

    async def _collection(self, request: web.Request, route: Route) -> web.StreamResponse:
        """list, watch, create and deletecollection."""
        r = route.resource
        if request.method == "POST":
            ctx = _context(request)
            body = await _read_json(request, r)
            return json_response(self.registry.create(r, route.namespace, body, ctx), 201, ctx)
        if request.method == "DELETE" and "deletecollection" in r.verbs:
            ctx = _context(request)
            deleted = self.registry.delete_collection(
                r,
                route.namespace,
                options.parse_list(r, request.query),
                options=await _delete_options(request, r),
                graceful_pods=self.settings.graceful_pod_deletion,
                ctx=ctx,
            )
            return json_response(deleted, 200, ctx)
        if request.method != "GET":
            raise errors.method_not_allowed()
        table = tables.wants_table(request.headers.get("Accept", ""))
        include = request.query.get("includeObject", "Metadata")
        if options.is_watch(request.query):
            opts = options.parse_watch(r, request.query, route.namespace)
            if table is not None:
                opts = dataclasses.replace(opts, transform=tables.watch_transform(r, include, table))
            verb, key = _classify(request)

            def opened() -> None:
                request[COUNTED] = True
                self.admin.requests.add(verb, key, 200, request)

            return await self.hub.serve(request, r, opts, opened)
        listed = await self.registry.list(r, route.namespace, options.parse_list(r, request.query))
        if table is not None:
            listed = tables.list_table(r, listed, include, table)
        return json_response(listed)

    async def _item(self, request: web.Request, route: Route, name: str) -> web.StreamResponse:
        """get, update, patch and delete of one object (or its status)."""
        r, method, sub = route.resource, request.method, route.subresource
        if method == "GET":
            got = self.registry.get(r, route.namespace, name)
            table = tables.wants_table(request.headers.get("Accept", ""))
            if table is not None and sub is None:
                got = tables.object_table(r, got, request.query.get("includeObject", "Metadata"), table)
            return json_response(got)
        ctx = _context(request)
        if method == "PUT":
            body = await _read_json(request, r)
            return json_response(
                self.registry.update(r, route.namespace, name, body, subresource=sub, ctx=ctx), 200, ctx
            )
        if method == "PATCH":
            if request.content_type not in PATCH_TYPES:
                raise errors.unsupported_media_type(request.content_type)
            patch = await _read_json(request, r)
            patched = self.registry.patch(
                r, route.namespace, name, patch_type=request.content_type, patch=patch, subresource=sub, ctx=ctx
            )
            return json_response(patched, 200, ctx)
        if method == "DELETE" and sub is None:
            deleted = self.registry.delete(
                r,
                route.namespace,
                name,
                options=await _delete_options(request, r),
                graceful_pods=self.settings.graceful_pod_deletion,
                ctx=ctx,
            )
            return json_response(deleted, 200, ctx)
        raise errors.method_not_allowed()


# --- helpers ---------------------------------------------------------------------------------------------


def json_response(body: bytes, status: int = 200, ctx: WriteContext | None = None) -> web.Response:
    headers = {"Cache-Control": "no-cache, private"}
    if ctx is not None and ctx.warnings:
        headers["Warning"] = ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in ctx.warnings)
    return web.Response(body=body, status=status, content_type=JSON, headers=headers)


def status_response(err: ApiError) -> web.Response:
    return web.Response(
        body=encode(err.status()),
        status=err.code,
        content_type=JSON,
        headers={"Cache-Control": "no-cache, private", **err.headers},
    )


def _context(request: web.Request) -> WriteContext:
    manager = request.query.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
    validation = request.query.get("fieldValidation", "Warn")
    if validation not in ("Strict", "Warn", "Ignore"):
        raise errors.bad_request(f"fieldValidation parameter unsupported: {validation}")
    return WriteContext(
        manager=manager or "unknown",
        field_validation=validation,
        dry_run=bool(request.query.getall("dryRun", [])),
    )


async def _read_body(request: web.Request) -> bytes:
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise errors.too_large(MAX_BODY)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise errors.too_large(MAX_BODY) from exc


def _parse_json(raw: bytes, resource: ResourceType) -> Any:
    try:
        return decode(raw)
    except Exception as exc:  # msgspec.DecodeError, UnicodeDecodeError
        summary = raw[:30].decode("utf-8", "replace") + ("..." if len(raw) > 30 else "")
        raise errors.bad_request(
            f"the object provided is unrecognized (must be of type {resource.kind}): "
            f"couldn't get version/kind; json parse error: {exc} ({summary})"
        ) from exc


async def _read_json(request: web.Request, resource: ResourceType) -> Any:
    if request.content_type == protobuf.CONTENT_TYPE and resource in (NAMESPACES, SERVICES):
        decoder = protobuf.decode_namespace if resource is NAMESPACES else protobuf.decode_service
        try:
            return decoder(await _read_body(request))
        except (protobuf.ProtobufError, UnicodeDecodeError) as exc:
            raise errors.unsupported_media_type(f"{request.content_type} ({exc})") from exc
    if request.content_type not in ("application/json", "", "application/octet-stream", *PATCH_TYPES):
        # Only JSON is served: protobuf (kubectl's typed clients) and YAML get 415, as from a server
        # without those serializers; client-go then retries in JSON.
        raise errors.unsupported_media_type(request.content_type)
    return _parse_json(await _read_body(request), resource)


async def _delete_options(request: web.Request, resource: ResourceType) -> dict[str, Any]:
    """DeleteOptions from the body (if any) and the ``gracePeriodSeconds`` query parameter."""
    raw = await _read_body(request)
    body = _parse_json(raw, resource) if raw.strip() else {}
    opts: dict[str, Any] = body if isinstance(body, dict) else {}
    grace = request.query.get("gracePeriodSeconds")
    if grace is not None and grace.lstrip("-").isdigit():
        opts["gracePeriodSeconds"] = int(grace)
    return opts


def _parse_route(path: str) -> Route | None:
    """``/api/v1/...`` and ``/apis/<group>/<version>/...`` → resource, namespace, name, subresource."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    resource = lookup(group, version, rest[0])
    if resource is None:
        return None
    if namespace is not None and not resource.namespaced:
        return None
    name = rest[1] if len(rest) > 1 else None
    return Route(resource, namespace, name, rest[2] if len(rest) > 2 else None)


def _classify(request: web.Request) -> tuple[str, str]:
    """(verb, resource) for counters and the fail fault."""
    route = _parse_route(request.path)
    if route is None:
        # Not the path itself: counters must stay bounded whatever URLs clients try.
        return ("admin" if request.path.startswith("/_lab/") else "discovery"), "-"
    method = request.method
    if route.name is None:
        verb = {
            "GET": "watch" if options.is_watch(request.query) else "list",
            "POST": "create",
            "DELETE": "deletecollection",
        }.get(method, method.lower())
    else:
        verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
    return verb, route.resource.key + (f"/{route.subresource}" if route.subresource else "")
