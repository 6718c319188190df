"""A small synchronous client for the lab API server's admin endpoints (faults, stats, inject).

Used by ``podmeter apiserver fault ...`` and by tests; standard library only, so a test can call it from
any thread without an event loop.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


class AdminError(RuntimeError):
    """The admin endpoint answered an error status."""


class AdminClient:
    """``AdminClient(url, token).fault("fail", count=3, code=429)`` and friends."""

    def __init__(self, url: str, token: str, ca_file: str | None = None, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_file) if url.startswith("https") else None

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode() if method == "POST" else None
        req = urllib.request.Request(  # noqa: S310 (operator-given URL)
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            # The URL is the operator-given server address (http or https), not user input.
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:  # noqa: S310
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path}: {exc.code} {exc.read().decode(errors='replace')}") from exc

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/_lab/stats")
        return result

    def requests(self, verb: str | None = None, resource: str | None = None) -> list[dict[str, Any]]:
        """Recent requests (newest last), optionally only of one verb/resource (e.g. "watch", "pods")."""
        query = "&".join(f"{k}={v}" for k, v in (("verb", verb), ("resource", resource)) if v)
        result: list[dict[str, Any]] = self._call("GET", "/_lab/requests" + (f"?{query}" if query else ""))["recent"]
        return result

    def count(self, verb: str, resource: str | None = None) -> int:
        """How many requests of ``verb`` (and ``resource``) were answered, whatever their status."""
        return sum(
            c["count"]
            for c in self.stats()["requests"]
            if c["verb"] == verb and (resource is None or c["resource"] == resource)
        )

    def reset_requests(self) -> None:
        self._call("POST", "/_lab/requests/reset")

    def open_watches(self) -> int:
        return int(self.stats()["openWatches"])

    def fault(self, knob: str, **params: Any) -> dict[str, Any]:
        """One of close-watches, compact, stall (seconds, includeNew), unstall, fail (count, code, retryAfter,
        verb), restart (downSeconds)."""
        result: dict[str, Any] = self._call("POST", f"/_lab/faults/{knob}", params)
        return result

    def close_watches(self) -> int:
        return int(self.fault("close-watches")["closed"])

    def compact(self) -> int:
        return int(self.fault("compact")["floor"])

    def stall(self, seconds: float | None = None, include_new: bool = False) -> None:
        self.fault("stall", seconds=seconds, includeNew=include_new)

    def unstall(self) -> None:
        self.fault("unstall")

    def fail(self, count: int, code: int = 500, retry_after: int = 1, verb: str | None = None) -> None:
        self.fault("fail", count=count, code=code, retryAfter=retry_after, verb=verb)

    def restart(self, down_seconds: float = 0.5) -> None:
        self.fault("restart", downSeconds=down_seconds)

    def inject(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """TEST ONLY: store ``obj`` as-is (no validation, no defaults) and send it to watchers."""
        result: dict[str, Any] = self._call("POST", "/_lab/inject", {"resource": resource, "object": obj})
        return result

    def inject_many(self, resource: str, objects: list[dict[str, Any]]) -> dict[str, Any]:
        """TEST/BENCH ONLY: ``inject`` for a batch (keep each request under the 3 MiB body limit)."""
        result: dict[str, Any] = self._call("POST", "/_lab/inject", {"resource": resource, "objects": objects})
        return result

    def inject_line(self, resource: str, line: str) -> int:
        """TEST ONLY: send ``line`` verbatim to every open watch of ``resource`` (garbage on the wire)."""
        return int(self._call("POST", "/_lab/inject", {"resource": resource, "rawLine": line})["watchers"])
