"""The admin API under ``/_lab/``: fault knobs, counters and the test-only inject.

Authenticated like the API (same bearer token); never counted and never failed by the ``fail`` fault, so a
test can always observe and steer the server it is breaking.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from podmeter.lab.apiserver import errors
from podmeter.lab.apiserver.errors import ApiError
from podmeter.lab.apiserver.resources import BY_KEY, SERVICES, ResourceType
from podmeter.lab.apiserver.store import ADDED, MODIFIED, decode, encode

if TYPE_CHECKING:
    from podmeter.lab.apiserver.app import LabApiServer


@dataclass
class RequestLog:
    """Counters by (verb, resource, code) and the last requests, for tests that count reconnects."""

    counts: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=2000))

    def add(self, verb: str, resource: str, code: int, request: web.Request) -> None:
        self.counts[(verb, resource, code)] += 1
        self.recent.append(
            {
                "time": time.time(),
                "verb": verb,
                "resource": resource,
                "code": code,
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
            }
        )

    def reset(self) -> None:
        self.counts.clear()
        self.recent.clear()

    def to_json(self) -> list[dict[str, Any]]:
        return [{"verb": v, "resource": r, "code": c, "count": n} for (v, r, c), n in sorted(self.counts.items())]


class Admin:
    """The ``/_lab/`` endpoints of one :class:`LabApiServer`."""

    def __init__(self, lab: LabApiServer) -> None:
        self.lab = lab
        self.requests = RequestLog()

    async def handle(self, request: web.Request) -> web.Response:
        """Route one ``/_lab/`` request."""
        path = request.path.rstrip("/")
        body = await _admin_body(request)
        if path == "/_lab/stats" and request.method == "GET":
            return _plain_json(self.stats())
        if path == "/_lab/requests" and request.method == "GET":
            return _plain_json(self._requests(request))
        if path == "/_lab/requests/reset" and request.method == "POST":
            self.requests.reset()
            return _plain_json({"reset": True})
        if path == "/_lab/inject" and request.method == "POST":
            return _plain_json(self._inject(body))
        knob = path.removeprefix("/_lab/faults/")
        if request.method == "POST" and knob != path:
            return _plain_json(await self.fault(knob, body))
        raise ApiError(404, "NotFound", f"no admin endpoint {request.method} {path}")

    async def fault(self, knob: str, body: dict[str, Any]) -> dict[str, Any]:
        """Apply one fault knob; returns what it did."""
        if knob == "close-watches":
            return {"closed": self.lab.hub.close_all("fault")}
        if knob == "compact":
            return {"floor": self.lab.store.compact()}
        if knob == "stall":
            seconds = body.get("seconds")
            self.lab.faults.stall(float(seconds) if seconds else None, bool(body.get("includeNew", False)))
            return {"stalled": len(self.lab.hub.open)}
        if knob == "unstall":
            self.lab.faults.unstall()
            return {"stalled": 0}
        if knob == "fail":
            count, code = int(body.get("count", 1)), int(body.get("code", 500))
            try:
                self.lab.faults.set_fail(count, code, int(body.get("retryAfter", 1)), body.get("verb"))
            except ValueError as exc:
                raise errors.bad_request(str(exc)) from exc
            return {"failing": count, "code": code}
        if knob == "restart":
            if self.lab.restart_hook is None:
                raise errors.bad_request("restart is only available when the server owns its listener")
            down = float(body.get("downSeconds", 0.5))
            closed = self.lab.hub.close_all("restart", abort=True)
            self.lab.background = asyncio.ensure_future(self.lab.restart_hook(down))
            return {"closed": closed, "downSeconds": down}
        raise ApiError(404, "NotFound", f"unknown fault {knob!r}")

    def _inject(self, body: dict[str, Any]) -> dict[str, Any]:
        """Test-only: put an object into the store (and watch streams) without validation, or a raw line."""
        resource = BY_KEY.get(str(body.get("resource", "")))
        if resource is None:
            raise errors.bad_request(f"unknown resource {body.get('resource')!r}; one of {sorted(BY_KEY)}")
        if "rawLine" in body:
            line = str(body["rawLine"]).encode()
            return {"watchers": self.lab.hub.inject_line(resource, line if line.endswith(b"\n") else line + b"\n")}
        objects = body["objects"] if isinstance(body.get("objects"), list) else [body.get("object")]
        keys = [_inject_key(resource, obj) for obj in objects]  # all checked before any is stored
        result: dict[str, Any] = {}
        for key, obj in zip(keys, objects, strict=True):
            event_type = MODIFIED if self.lab.store.get(resource, key) is not None else ADDED
            obj["metadata"].setdefault("uid", f"injected-{self.lab.store.rv + 1}")
            stored = self.lab.store.commit(resource, event_type, obj)
            result = {"type": event_type, "resourceVersion": str(stored.rv), "count": len(objects)}
        if resource is SERVICES:  # what injected Services name is taken, as if they had been allocated
            self.lab.registry.services.rebuild((s.key, s.decode()) for s in self.lab.store.items(SERVICES))
        return result

    def _requests(self, request: web.Request) -> dict[str, Any]:
        verb, resource = request.query.get("verb"), request.query.get("resource")
        recent = [
            r
            for r in self.requests.recent
            if (verb is None or r["verb"] == verb) and (resource is None or r["resource"] == resource)
        ]
        return {"counts": self.requests.to_json(), "recent": recent}

    def stats(self) -> dict[str, Any]:
        by_verb: Counter[str] = Counter()
        for (verb, _, _), n in self.requests.counts.items():
            by_verb[verb] += n
        return {
            **self.lab.store.stats(),
            "openWatches": len(self.lab.hub.open),
            "watchesClosed": dict(self.lab.hub.closed_by_reason),
            "requests": self.requests.to_json(),
            "requestsByVerb": dict(by_verb),
            "faults": {
                "failRemaining": self.lab.faults.fail.remaining if self.lab.faults.fail else 0,
                "stalled": self.lab.faults.stalled,
                "injectedFailures": self.lab.faults.injected_failures,
            },
            "uptimeSeconds": round(time.time() - self.lab.started, 3),
            "serviceAllocations": self.lab.registry.services.stats(),
        }


def _plain_json(doc: Any) -> web.Response:
    return web.Response(body=encode(doc), content_type="application/json")


async def _admin_body(request: web.Request) -> dict[str, Any]:
    if request.method != "POST" or not request.can_read_body:
        return {}
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = decode(raw)
    except Exception as exc:
        raise errors.bad_request(f"admin body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise errors.bad_request("admin body must be a JSON object")
    return body


def _inject_key(resource: ResourceType, obj: Any) -> str:
    """The store key of an object to inject; only name (and namespace) must be well-formed strings."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise errors.bad_request("inject needs object.metadata.name (a string)")
    if not resource.namespaced:
        return str(meta["name"])
    if not isinstance(meta.get("namespace"), str):
        raise errors.bad_request("inject needs object.metadata.namespace (a string) for this resource")
    return f"{meta['namespace']}/{meta['name']}"
