"""Kubernetes ``Status`` failures, shaped field by field like a real kube-apiserver's answers.

The recorded answers they are compared with are in tests/data/wire/.

Every error the lab API server answers is an :class:`ApiError`; :meth:`ApiError.status` renders the body.
The constructors mirror apimachinery's ``errors.New*`` helpers: same ``reason``, ``code``, ``details`` and
message wording, because clients (client-go, kubectl, podmeter's reflector) branch on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Cause:
    """One entry of ``details.causes``: a field path and why it is wrong."""

    reason: str
    message: str
    field: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"reason": self.reason, "message": self.message}
        if self.field is not None:
            out["field"] = self.field
        return out


@dataclass
class ApiError(Exception):
    """An HTTP failure with a Kubernetes ``Status`` body."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        """The ``Status`` object, keys in the real server's order."""
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(
    name: str | None,
    kind: str | None,
    group: str = "",
    causes: list[Cause] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if name:
        out["name"] = name
    if group:
        out["group"] = group
    if kind:
        out["kind"] = kind
    if causes:
        out["causes"] = [c.to_json() for c in causes]
    return out


def _qualified(plural: str, group: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(plural: str, name: str, group: str = "") -> ApiError:
    return ApiError(404, "NotFound", f'{_qualified(plural, group)} "{name}" not found', _details(name, plural, group))


def already_exists(plural: str, name: str, group: str = "") -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{_qualified(plural, group)} "{name}" already exists',
        _details(name, plural, group),
    )


def conflict(plural: str, name: str, group: str = "", why: str | None = None) -> ApiError:
    why = why or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_qualified(plural, group)} "{name}": {why}',
        _details(name, plural, group),
    )


def invalid(kind: str, name: str, causes: list[Cause], group: str = "") -> ApiError:
    """422 Invalid: ``Kind "name" is invalid: [field: message, ...]`` (brackets only for several causes)."""
    parts = [f"{c.field}: {c.message}" if c.field else c.message for c in causes]
    joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    qualified = f"{kind}.{group}" if group else kind
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {joined}', _details(name, kind, group, causes))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def forbidden(message: str, plural: str = "", name: str = "", group: str = "") -> ApiError:
    return ApiError(403, "Forbidden", message, _details(name, plural, group))


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - "
        f"accepted media types include: application/json-patch+json, application/merge-patch+json, "
        f"application/apply-patch+yaml, application/strategic-merge-patch+json; got {content_type}",
    )


def too_large(limit: int) -> ApiError:
    return ApiError(413, "RequestEntityTooLarge", f"Request entity too large: limit is {limit}")


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def too_old_watch(requested: int, oldest: int) -> ApiError:
    """The wording of a real API server's watch cache; its etcd path says "...provided watch is too old."."""
    return expired(f"too old resource version: {requested} ({oldest})")


def too_many_requests(retry_after: int) -> ApiError:
    return ApiError(
        429,
        "TooManyRequests",
        "Too many requests, please try again later.",
        {"retryAfterSeconds": retry_after},
        {"Retry-After": str(retry_after)},
    )


def internal(message: str) -> ApiError:
    return ApiError(500, "InternalError", f"Internal error occurred: {message}", {"causes": [{"message": message}]})


def service_unavailable() -> ApiError:
    return ApiError(503, "ServiceUnavailable", "the server is currently unable to handle the request")


def rv_too_large(requested: int, current: int) -> ApiError:
    """504 after the ~3 s a real server waits for an RV from the future (list-too-large-rv-504.json)."""
    return ApiError(
        504,
        "Timeout",
        f"Timeout: Too large resource version: {requested}, current: {current}",
        {
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": 1,
        },
        {"Retry-After": "1"},
    )


def list_options_invalid(causes: list[Cause]) -> ApiError:
    """422 on a bad combination of list/watch options (error-422-send-initial-events-without-match.json)."""
    parts = [f"{c.field}: {c.message}" for c in causes]
    joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return ApiError(
        422,
        "Invalid",
        f'ListOptions.meta.k8s.io "" is invalid: {joined}',
        {"group": "meta.k8s.io", "kind": "ListOptions", "causes": [c.to_json() for c in causes]},
    )
