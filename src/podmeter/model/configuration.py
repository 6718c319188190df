"""The ``MetricsConfiguration`` custom resource: decoding and validation of its spec.

Only the object named ``default`` matters. An invalid spec is rejected with one :class:`DecodeError`
that names the field and the reason; the caller keeps the last valid configuration in force.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from podmeter.model.records import DecodeError, is_dns1123_label, object_name

DEFAULT_NAME: Final = "default"
KIND: Final = "MetricsConfiguration"
_NameList = Annotated[list[Annotated[str, msgspec.Meta(max_length=253)]], msgspec.Meta(max_length=10_000)]


class _Namespaces(msgspec.Struct, forbid_unknown_fields=True):
    include: _NameList | None = None
    exclude: _NameList | None = None


class _Spec(msgspec.Struct, forbid_unknown_fields=True):
    namespaces: _Namespaces | None = None
    annotations: bool = True


class _Meta(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(max_length=253)] = ""
    resourceVersion: Annotated[str, msgspec.Meta(max_length=64)] = ""
    generation: int = 0


class _Wire(msgspec.Struct):
    metadata: _Meta
    spec: _Spec | None = None


@dataclass(frozen=True, slots=True)
class Interest:
    """Which namespaces are observed wholesale, and whether annotations count.

    Invariant: ``include`` and ``exclude`` are never both non-empty. An empty ``include`` with a non-empty
    ``exclude`` observes every namespace but those; both empty means only annotations count.
    """

    include: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()
    annotations: bool = True


NO_CONFIGURATION: Final = Interest()


@dataclass(frozen=True, slots=True)
class MetricsConfiguration:
    """A decoded and validated ``MetricsConfiguration`` object."""

    name: str
    resource_version: str
    generation: int
    interest: Interest


_decoder: Final = msgspec.json.Decoder(_Wire)


def decode_configuration(data: bytes | dict[str, Any]) -> MetricsConfiguration:
    """Decode and validate; raises :class:`DecodeError` naming the field on any problem."""
    try:
        wire = msgspec.convert(data, _Wire) if isinstance(data, dict) else _decoder.decode(data)
    except msgspec.ValidationError as exc:
        reason, _, where = str(exc).rpartition(" - at ")
        raise DecodeError(KIND, object_name(data), where.strip("`") or "$", reason or str(exc)) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(KIND, "", "$", f"malformed JSON: {exc}") from None
    spec = wire.spec or _Spec()
    name = wire.metadata.name
    return MetricsConfiguration(name, wire.metadata.resourceVersion, wire.metadata.generation,
                                _interest(name, spec))


def _interest(name: str, spec: _Spec) -> Interest:
    namespaces = spec.namespaces or _Namespaces()
    include = _valid_names(name, "include", namespaces.include or [])
    exclude = _valid_names(name, "exclude", namespaces.exclude or [])
    if include and exclude:
        raise DecodeError(KIND, name, "$.spec.namespaces",
                          "include and exclude cannot both be non-empty; use one mode")
    return Interest(include, exclude, spec.annotations)


def _valid_names(name: str, which: str, names: list[str]) -> frozenset[str]:
    for index, ns in enumerate(names):
        if not is_dns1123_label(ns):
            raise DecodeError(KIND, name, f"$.spec.namespaces.{which}[{index}]",
                              f"{ns[:80]!r} is not a valid namespace name (DNS-1123 label)")
    return frozenset(names)


def accepted_condition(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``Accepted`` condition for a MetricsConfiguration object (True, or False with the reason)."""
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    try:
        decode_configuration(obj)
    except DecodeError as exc:
        return {"type": "Accepted", "status": "False", "reason": "Invalid", "message": str(exc),
                "observedGeneration": generation}
    return {"type": "Accepted", "status": "True", "reason": "Valid",
            "message": "configuration accepted", "observedGeneration": generation}
