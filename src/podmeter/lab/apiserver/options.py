"""List and watch query parameters: parsing and the real server's validation of their combinations.

Unknown parameters are ignored, like the real server does. Bad combinations answer 422 with the
``ListOptions.meta.k8s.io`` Status (error-422-send-initial-events-without-match.json); malformed values
answer 400.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass

from podmeter.lab.apiserver.errors import Cause, bad_request, list_options_invalid
from podmeter.lab.apiserver.resources import ResourceType
from podmeter.lab.apiserver.selectors import Selector, parse_field_selector, parse_label_selector
from podmeter.lab.apiserver.watching import WatchOptions, random_timeout

NOT_OLDER_THAN, EXACT = "NotOlderThan", "Exact"


@dataclass(frozen=True)
class ListOptions:
    resource_version: str
    match: str
    labels: Selector
    fields: Selector
    limit: int
    continue_rv: int | None
    continue_key: str | None


def is_watch(query: Mapping[str, str]) -> bool:
    return query.get("watch", "").lower() in ("true", "1")


def _bool(query: Mapping[str, str], name: str) -> bool | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    if raw.lower() in ("true", "1"):
        return True
    if raw.lower() in ("false", "0"):
        return False
    raise bad_request(f'invalid value for {name}: "{raw}"')


def _rv(query: Mapping[str, str]) -> str:
    raw = query.get("resourceVersion", "")
    if raw and not raw.isdigit():
        raise bad_request(f'Invalid value: "{raw}": resourceVersion must be an integer')
    return str(int(raw)) if raw else ""


def _selectors(resource: ResourceType, query: Mapping[str, str]) -> tuple[Selector, Selector]:
    return (
        parse_label_selector(query.get("labelSelector")),
        parse_field_selector(query.get("fieldSelector"), resource.field_keys),
    )


def encode_continue(rv: int, last_key: str) -> str:
    """The real token's shape: base64 of ``{"v":"meta.k8s.io/v1","rv":N,"start":"<key>\\u0000"}``."""
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": last_key + "\x00"}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        rv, start = int(data["rv"]), str(data["start"])
        if data.get("v") != "meta.k8s.io/v1" or rv <= 0:
            raise ValueError("unsupported token")
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
        raise bad_request(f"continue key is not valid: {exc}") from exc
    return rv, start.rstrip("\x00")


def parse_list(resource: ResourceType, query: Mapping[str, str]) -> ListOptions:
    rv, match = _rv(query), query.get("resourceVersionMatch", "")
    causes: list[Cause] = []
    if match and match not in (NOT_OLDER_THAN, EXACT):
        causes.append(
            Cause(
                "FieldValueNotSupported",
                f'Unsupported value: "{match}": supported values: "Exact", "NotOlderThan"',
                "resourceVersionMatch",
            )
        )
    elif match and not rv:
        causes.append(
            Cause(
                "FieldValueForbidden",
                "Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
                "resourceVersionMatch",
            )
        )
    elif match == EXACT and rv == "0":
        causes.append(
            Cause(
                "FieldValueForbidden",
                'Forbidden: resourceVersionMatch "exact" is forbidden for resourceVersion "0"',
                "resourceVersionMatch",
            )
        )
    token = query.get("continue", "")
    if token and rv:
        causes.append(
            Cause(
                "FieldValueForbidden",
                "Forbidden: specifying resource version is not allowed when using continue",
                "resourceVersion",
            )
        )
    if causes:
        raise list_options_invalid(causes)
    try:
        limit = int(query.get("limit") or 0)
    except ValueError as exc:
        raise bad_request(f'invalid value for limit: "{query.get("limit")}"') from exc
    labels, fields = _selectors(resource, query)
    continue_rv, continue_key = decode_continue(token) if token else (None, None)
    return ListOptions(rv, match, labels, fields, max(limit, 0), continue_rv, continue_key)


def parse_watch(resource: ResourceType, query: Mapping[str, str], namespace: str | None) -> WatchOptions:
    rv, match = _rv(query), query.get("resourceVersionMatch", "")
    send_initial = _bool(query, "sendInitialEvents")
    bookmarks = bool(_bool(query, "allowWatchBookmarks"))
    causes: list[Cause] = []
    if send_initial is not None and match != NOT_OLDER_THAN:
        causes.append(
            Cause(
                "FieldValueForbidden",
                "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
                "resourceVersionMatch",
            )
        )
    if match:
        if send_initial is None:
            causes.append(
                Cause(
                    "FieldValueForbidden",
                    "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
                    "resourceVersionMatch",
                )
            )
        if match != NOT_OLDER_THAN:
            causes.append(
                Cause(
                    "FieldValueNotSupported",
                    f'Unsupported value: "{match}": supported values: "NotOlderThan"',
                    "resourceVersionMatch",
                )
            )
        if send_initial and not bookmarks:
            causes.append(
                Cause(
                    "FieldValueForbidden",
                    "Forbidden: sendInitialEvents requires setting allowWatchBookmarks to true",
                    "allowWatchBookmarks",
                )
            )
    if causes:
        raise list_options_invalid(causes)
    timeout_raw = query.get("timeoutSeconds")
    try:
        timeout = float(int(timeout_raw)) if timeout_raw else random_timeout()
    except ValueError as exc:
        raise bad_request(f'invalid value for timeoutSeconds: "{timeout_raw}"') from exc
    if timeout <= 0:
        timeout = random_timeout()
    labels, fields = _selectors(resource, query)
    return WatchOptions(rv, labels, fields, namespace, bookmarks, timeout, send_initial)
