"""Just enough of the Kubernetes protobuf envelope to accept ``kubectl create namespace`` and ``kubectl
create service``.

kubectl's typed clients send ``application/vnd.kubernetes.protobuf`` and do not fall back to JSON on a 415,
so the such requests the lab sees in practice (a Namespace, a Service) are decoded here: the ``k8s\\0``
magic, the ``runtime.Unknown`` envelope, the ObjectMeta fields these carry (name, generateName, namespace,
labels, annotations) and a v1 ServiceSpec (field numbers of k8s.io/api core/v1 generated.proto). Anything
else is refused with 415, as an unknown media type.
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
        elif number == 3:
            meta["namespace"] = _text(value)
        elif number in (11, 12):
            key, text = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = text
    return meta


def _envelope(body: bytes) -> tuple[str, str, bytes]:
    """(apiVersion, kind, raw message) of a ``runtime.Unknown``."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf magic")
    envelope = dict(_fields(body[len(MAGIC) :]))
    type_meta = envelope.get(1)
    raw = envelope.get(2)
    if not isinstance(type_meta, bytes) or not isinstance(raw, bytes):
        raise ProtobufError("not a runtime.Unknown envelope")
    tm = {n: _text(v) for n, v in _fields(type_meta)}
    return tm.get(1, ""), tm.get(2, ""), raw


def decode_namespace(body: bytes) -> dict[str, Any]:
    """A protobuf-encoded v1 Namespace as the JSON dict the JSON path would have decoded."""
    api_version, kind, raw = _envelope(body)
    if (api_version, kind) != ("v1", "Namespace"):
        raise ProtobufError(f"only v1 Namespace is decoded, got {api_version} {kind}")
    meta: dict[str, Any] = {}
    for number, value in _fields(raw):
        if number == 1 and isinstance(value, bytes):
            meta = _object_meta(value)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def _int32(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise ProtobufError("expected a varint")
    return value - (1 << 64) if value >= 1 << 63 else value


def _message(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a message")
    return value


_PORT_FIELDS = {1: "name", 2: "protocol", 6: "appProtocol"}
_SPEC_STRINGS = {3: "clusterIP", 4: "type", 7: "sessionAffinity", 8: "loadBalancerIP", 10: "externalName",
                 11: "externalTrafficPolicy", 17: "ipFamilyPolicy", 21: "loadBalancerClass",
                 22: "internalTrafficPolicy", 23: "trafficDistribution"}
_SPEC_LISTS = {18: "clusterIPs", 5: "externalIPs", 9: "loadBalancerSourceRanges", 19: "ipFamilies"}


def _service_port(data: bytes) -> dict[str, Any]:
    port: dict[str, Any] = {}
    for number, value in _fields(data):
        if number in _PORT_FIELDS:
            port[_PORT_FIELDS[number]] = _text(value)
        elif number in (3, 5):
            port["port" if number == 3 else "nodePort"] = _int32(value)
        elif number == 4:  # IntOrString: type (0 int, 1 string), intVal, strVal
            target = dict(_fields(_message(value)))
            kind = target.get(1, 0)
            port["targetPort"] = _text(target.get(3, b"")) if kind == 1 else _int32(target.get(2, 0))
    return port


def _service_spec(data: bytes) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for number, value in _fields(data):
        if number == 1:
            spec.setdefault("ports", []).append(_service_port(_message(value)))
        elif number == 2:
            key, text = _map_entry(value)
            spec.setdefault("selector", {})[key] = text
        elif number in _SPEC_STRINGS:
            spec[_SPEC_STRINGS[number]] = _text(value)
        elif number in _SPEC_LISTS:
            spec.setdefault(_SPEC_LISTS[number], []).append(_text(value))
        elif number == 12:
            spec["healthCheckNodePort"] = _int32(value)
        elif number in (13, 20):
            spec["publishNotReadyAddresses" if number == 13 else "allocateLoadBalancerNodePorts"] = bool(value)
        elif number == 14:
            client = dict(_fields(_message(value))).get(1)
            timeout = dict(_fields(_message(client))).get(1) if client is not None else None
            spec["sessionAffinityConfig"] = {"clientIP": {} if timeout is None else {"timeoutSeconds": _int32(timeout)}}
    return spec


def decode_service(body: bytes) -> dict[str, Any]:
    """A protobuf-encoded v1 Service (what ``kubectl create service`` sends) as JSON would decode it."""
    api_version, kind, raw = _envelope(body)
    if (api_version, kind) != ("v1", "Service"):
        raise ProtobufError(f"only v1 Service is decoded here, got {api_version} {kind}")
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": {}}
    for number, value in _fields(raw):
        if number == 1:
            out["metadata"] = _object_meta(_message(value))
        elif number == 2:
            out["spec"] = _service_spec(_message(value))
    return out
