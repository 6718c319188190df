"""Objects, the global resourceVersion and the bounded event history.

Invariants:
- One integer resourceVersion for everything; every write takes the next one, so RVs order all events.
- ``objects[resource][key]`` holds the live objects as :class:`Stored`: the JSON bytes (without
  ``kind``/``apiVersion``, ready to splice into a list or an event line) plus the labels and selectable
  fields extracted once, so selectors and fan-out never decode JSON. Memory is live objects + history.
- ``history`` keeps the last N events (a deque with ``maxlen``). ``floor`` is the oldest RV a watch may
  resume from: every event with ``rv > floor`` is still in ``history``. Compaction moves ``floor`` to now.
- A write is applied, recorded and dispatched to the subscribed watchers in one synchronous step (no
  ``await``), so a watcher registered in the same step as it reads the history misses nothing and sees
  nothing twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from podmeter.lab.apiserver.errors import expired
from podmeter.lab.apiserver.resources import ALL, ResourceType

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes) -> Any:
    return _decoder.decode(data)


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    """Labels that are well-formed strings; a malformed (injected) object simply has fewer labels."""
    meta = obj.get("metadata")
    raw = meta.get("labels") if isinstance(meta, dict) else None
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


@dataclass(slots=True)
class Stored:
    """One version of one object. ``body`` is compact JSON starting with ``{"metadata":``."""

    body: bytes
    rv: int
    uid: str
    namespace: str
    name: str
    labels: dict[str, str]
    fields: dict[str, str]

    def decode(self) -> dict[str, Any]:
        """A fresh mutable dict (without kind/apiVersion)."""
        out: dict[str, Any] = decode(self.body)
        return out

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


def make_stored(resource: ResourceType, obj: dict[str, Any]) -> Stored:
    """Freeze ``obj`` (its ``metadata.resourceVersion`` already set) into a :class:`Stored`."""
    body = {"metadata": obj.get("metadata", {})}
    for key, value in obj.items():
        if key not in ("kind", "apiVersion", "metadata"):
            body[key] = value
    meta = body["metadata"] if isinstance(body["metadata"], dict) else {}
    return Stored(
        body=encode(body),
        rv=int(meta.get("resourceVersion") or 0),
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace") or "") if resource.namespaced else "",
        name=str(meta.get("name", "")),
        labels=_labels(body),
        fields=resource.fields(body),
    )


def object_bytes(resource: ResourceType, body: bytes) -> bytes:
    """The full object: ``kind`` and ``apiVersion`` spliced in front of the stored body."""
    return resource.prefix + body[1:]


def event_line(event_type: str, resource: ResourceType, body: bytes) -> bytes:
    """One line of a watch stream."""
    return b'{"type":"' + event_type.encode() + b'","object":' + object_bytes(resource, body) + b"}\n"


def with_rv(body: bytes, rv: int) -> bytes:
    """``body`` with another ``metadata.resourceVersion`` (a DELETED for an object leaving a selector)."""
    obj = decode(body)
    obj["metadata"]["resourceVersion"] = str(rv)
    return encode(obj)


@dataclass(slots=True)
class Event:
    """A committed change. For MODIFIED and DELETED ``prev`` is the version before it."""

    rv: int
    type: str
    resource: ResourceType
    obj: Stored
    prev: Stored | None
    _lines: dict[str, bytes] = field(default_factory=dict)

    def line(self, event_type: str) -> bytes:
        """The wire line for ``event_type`` (a watcher's view may differ from ``type``), cached per event."""
        cached = self._lines.get(event_type)
        if cached is None:
            if event_type == DELETED and self.type == MODIFIED and self.prev is not None:
                body = with_rv(self.prev.body, self.rv)
            else:
                body = self.obj.body
            cached = self._lines[event_type] = event_line(event_type, self.resource, body)
        return cached


class Subscriber(Protocol):
    """A watch: receives every event of its resource, in RV order."""

    def offer(self, event: Event) -> None: ...


class Store:
    """All objects, the RV counter, the history window and the watcher registry."""

    def __init__(self, history: int = 10_000, start_rv: int = 1) -> None:
        if history < 1:
            raise ValueError("history must hold at least one event")
        self.rv = start_rv
        self.floor = start_rv
        self.objects: dict[str, dict[str, Stored]] = {r.key: {} for r in ALL}
        self.history: deque[Event] = deque(maxlen=history)
        self.watchers: dict[str, set[Subscriber]] = {r.key: set() for r in ALL}

    # --- reads -----------------------------------------------------------------------------------------
    def get(self, resource: ResourceType, key: str) -> Stored | None:
        return self.objects[resource.key].get(key)

    def items(self, resource: ResourceType, namespace: str | None = None) -> Iterator[Stored]:
        """Objects in key order (namespace, then name), like etcd's range reads."""
        table = self.objects[resource.key]
        for key in sorted(table):
            stored = table[key]
            if namespace is None or stored.namespace == namespace:
                yield stored

    def snapshot(self, resource: ResourceType, rv: int) -> dict[str, Stored]:
        """The objects of ``resource`` as they were at ``rv`` (410 Expired if history no longer covers it)."""
        table = self.objects[resource.key]
        if rv >= self.rv:
            return table
        if rv < self.floor:
            raise expired("The resourceVersion for the provided list is too old.")
        undo = [e for e in self.history if e.rv > rv and e.resource is resource]
        if not undo:
            return table
        past = dict(table)
        for event in reversed(undo):
            if event.type == ADDED:
                past.pop(event.obj.key, None)
            elif event.prev is not None:
                past[event.prev.key] = event.prev
        return past

    def events_since(self, rv: int) -> list[Event]:
        """Events after ``rv``; the caller has checked ``rv >= floor``."""
        if not self.history or self.history[-1].rv <= rv:
            return []
        return [e for e in self.history if e.rv > rv]

    # --- writes ----------------------------------------------------------------------------------------
    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def commit(self, resource: ResourceType, event_type: str, obj: dict[str, Any]) -> Stored:
        """Apply one write: stamp the next RV on ``obj``, store (or remove, for DELETED), record, dispatch."""
        rv = self.next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        stored = make_stored(resource, obj)
        table = self.objects[resource.key]
        prev = table.get(stored.key)
        if event_type == DELETED:
            table.pop(stored.key, None)
        else:
            table[stored.key] = stored
        self._record(Event(rv, event_type, resource, stored, prev))
        return stored

    def _record(self, event: Event) -> None:
        if self.history.maxlen is not None and len(self.history) == self.history.maxlen:
            self.floor = self.history[0].rv
        self.history.append(event)
        for watcher in list(self.watchers[event.resource.key]):
            watcher.offer(event)
        # The rendered lines only serve this fan-out (watchers keep their own references); a replay from
        # history renders again, so the window holds each version once.
        event._lines.clear()

    def compact(self) -> int:
        """Forget all history: any watch or continue token older than now gets 410. Returns the new floor."""
        self.history.clear()
        self.floor = self.rv
        return self.floor

    def subscribe(self, resource: ResourceType, watcher: Subscriber) -> None:
        self.watchers[resource.key].add(watcher)

    def unsubscribe(self, resource: ResourceType, watcher: Subscriber) -> None:
        self.watchers[resource.key].discard(watcher)

    def watch_count(self) -> int:
        return sum(len(w) for w in self.watchers.values())

    def stats(self) -> dict[str, Any]:
        return {
            "resourceVersion": self.rv,
            "floor": self.floor,
            "history": {"events": len(self.history), "capacity": self.history.maxlen},
            "objects": {key: len(table) for key, table in self.objects.items()},
            "objectBytes": sum(len(s.body) for t in self.objects.values() for s in t.values()),
            "openWatches": self.watch_count(),
        }
