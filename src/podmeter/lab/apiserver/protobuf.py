"""Just enough of the Kubernetes protobuf envelope to accept ``kubectl create namespace``.

kubectl's typed clients send ``application/vnd.kubernetes.protobuf`` and do not fall back to JSON on a 415,
so the one such request the lab sees in practice (a Namespace) is decoded here: the ``k8s\\0`` magic, the
``runtime.Unknown`` envelope, and the ObjectMeta fields a namespace carries (name, generateName, labels,
annotations). Anything else is refused with 415, as an unknown media type.
"""

from __future__ import annotations

from typing import Any

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"


class ProtobufError(ValueError):
    """Not a message this decoder understands."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of one message; length-delimited values stay bytes."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise ProtobufError("truncated field")
            out.append((number, data[pos : pos + length]))
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a string")
    return value.decode()


def _map_entry(value: int | bytes) -> tuple[str, str]:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a map entry")
    entry = dict(_fields(value))
    return _text(entry.get(1, b"")), _text(entry.get(2, b""))


def _object_meta(data: bytes) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for number, value in _fields(data):
        if number == 1:
            meta["name"] = _text(value)
        elif number == 2:
            meta["generateName"] = _text(value)
        elif number in (11, 12):
            key, text = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = text
    return meta


def decode_namespace(body: bytes) -> dict[str, Any]:
    """A protobuf-encoded v1 Namespace as the JSON dict the JSON path would have decoded."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf magic")
    envelope = dict(_fields(body[len(MAGIC) :]))
    type_meta = envelope.get(1)
    raw = envelope.get(2)
    if not isinstance(type_meta, bytes) or not isinstance(raw, bytes):
        raise ProtobufError("not a runtime.Unknown envelope")
    tm = {n: _text(v) for n, v in _fields(type_meta)}
    if (tm.get(1), tm.get(2)) != ("v1", "Namespace"):
        raise ProtobufError(f"only v1 Namespace is decoded, got {tm.get(1)} {tm.get(2)}")
    meta: dict[str, Any] = {}
    for number, value in _fields(raw):
        if number == 1 and isinstance(value, bytes):
            meta = _object_meta(value)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}
