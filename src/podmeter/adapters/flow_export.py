"""The flow export file: every flow record (forwarded or dropped) as one JSON line in Hubble's exporter
format, for log pipelines (``podmeter agent --flow-export-file PATH``; docs/flow-export.md).

A line is ``{"flow": {...}, "node_name": "...", "time": "..."}``: ``flow`` is the record as Hubble's
``flow.Flow`` (``adapters.hubble.flows``) in protobuf's JSON form with the field names of the ``.proto``
file, ``time`` its time (RFC 3339, UTC, to the nanosecond as far as it has digits). Records the export did
not get are said in a line ``{"lost_events": {"source": ..., "num_events_lost": "N"}, ...}`` as Hubble's
exporter writes its lost events: ``HUBBLE_RING_BUFFER`` for those the flow feed's ring overwrote before the
export read them, ``OBSERVER_EVENTS_QUEUE`` for those that found the export's queue full,
``UNKNOWN_LOST_EVENT_SOURCE`` (0: left out of the JSON) for those a failed write lost.

Writing never holds up the agent. :class:`FlowExporter` is a follower of the flow feed
(``adapters.flow_serving``: a cursor on the ring, told what it lost) whose task only selects the records
(allow and deny lists: ``model.flow_export.ExportSelector``) and hands them to a bounded queue; one worker
thread encodes and writes them. A full queue (a slow disk) drops the newest records, a failed write (a full
disk, an unwritable path) drops its batch; both are counted (:meth:`FlowExporter.figures`, read by
``adapters.metrics.flow_export`` at scrape time) and logged once per change of state, and a failing file
is tried again every ``retry_interval`` seconds. Files are created 0600: records name pods and IPs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from google.protobuf import json_format

from podmeter.adapters.flow_serving import FlowFeed, Gap
from podmeter.adapters.hubble.flows import TCP_FLAG_FIELDS, FlowMessages, LabelSource, end_labels, timestamp
from podmeter.adapters.hubble.proto import flow_pb2
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_export import ExportSelector, MaskTree, apply_mask, backup_name, expired, plan_writes
from podmeter.model.flow_records import FlowEnd, FlowRecord
from podmeter.model.flows import ICMP, ICMPV6, TCP, UDP

log = logging.getLogger("podmeter.flow_export")

LOST, QUEUE_FULL, WRITE_ERROR = "lost", "queue_full", "write_error"  # why records were dropped
DROP_REASONS = (LOST, QUEUE_FULL, WRITE_ERROR)
_SOURCES = {LOST: flow_pb2.HUBBLE_RING_BUFFER, QUEUE_FULL: flow_pb2.OBSERVER_EVENTS_QUEUE,
            WRITE_ERROR: flow_pb2.UNKNOWN_LOST_EVENT_SOURCE}
STOP_GRACE = 5.0  # seconds the worker may take to write what is queued when the agent stops
_encode = msgspec.json.Encoder().encode


def check_field_mask(paths: Sequence[str]) -> None:
    """ValueError naming the first path that is not a path of Hubble's ``Flow`` (``source.pod_name``); only
    the last field of a path may be repeated, as in protobuf's field masks."""
    for path in paths:
        descriptor: Any = flow_pb2.Flow.DESCRIPTOR
        names = path.split(".")
        for depth, name in enumerate(names):
            field = descriptor.fields_by_name.get(name)
            if field is None:
                raise ValueError(f"--flow-export-field-mask: {path!r}: {name!r} is not a field of "
                                 f"{descriptor.full_name}")
            if depth < len(names) - 1 and (field.message_type is None or field.is_repeated):
                raise ValueError(f"--flow-export-field-mask: {path!r}: {name!r} has no sub-fields to select")
            descriptor = field.message_type


# --- the lines ----------------------------------------------------------------------------------------


class ExportLines:
    """Records as the export's lines (Hubble's ``ExportEvent`` in JSON, one per line). Used by the worker
    thread alone; the ends' labels come with each batch (read on the event loop, where the pods are).

    A flow's JSON object is built by hand (:meth:`flow_json`): exactly what protobuf's
    ``json_format.MessageToDict`` makes of the message ``adapters.hubble.flows.FlowMessages.flow`` builds,
    field by field in field-number order, with the parts that repeat across records (an end, the event
    type and summary) made once and kept; a test holds the two equal for every shape of record.
    ``MessageToDict`` costs about 100 µs a flow, which would bound the export to a few thousand records a
    second (``bench.flow_export``)."""

    CACHE = 4096

    def __init__(self, node: str, mask: MaskTree) -> None:
        self.node, self.mask = node, mask
        self._labels: dict[Endpoint, tuple[str, ...]] = {}
        self._messages = FlowMessages(lambda endpoint: self._labels.get(endpoint, ()))
        self._ends: dict[tuple[Endpoint | None, tuple[str, ...]], dict[str, Any]] = {}
        self._tails: dict[tuple[object, ...], tuple[str | None, dict[str, Any]]] = {}

    def flow_lines(self, records: Sequence[FlowRecord], labels: dict[Endpoint, tuple[str, ...]]) -> list[bytes]:
        self._labels = labels
        return [self.flow_line(record) for record in records]

    def flow_line(self, record: FlowRecord) -> bytes:
        masked = apply_mask(self.mask, self.flow_json(record)) if self.mask else self.flow_json(record)
        event: dict[str, Any] = {"flow": masked}
        if "node_name" in masked:  # the event's node and time are its flow's (masked out: left out too)
            event["node_name"] = masked["node_name"]
        if "time" in masked:
            event["time"] = masked["time"]
        return _encode(event) + b"\n"

    def flow_json(self, record: FlowRecord) -> dict[str, Any]:
        """``MessageToDict(FlowMessages.flow(record), preserving_proto_field_name=True)``, by hand (a flow
        through a Service, whose fields sit in the middle of the tail, is converted by protobuf)."""
        source, destination = record.source, record.destination
        if source.service is not None or destination.service is not None:
            return json_format.MessageToDict(self._messages.flow(record), preserving_proto_field_name=True)
        verdict, tail = self._tail(record)
        out: dict[str, Any] = {"time": timestamp(record.time).ToJsonString()}
        if verdict is not None:
            out["verdict"] = verdict
        addresses: dict[str, Any] = {"source": source.ip} if source.ip else {}
        if destination.ip:
            addresses["destination"] = destination.ip
        addresses["ipVersion"] = "IPv6" if ":" in source.ip else "IPv4"
        out["IP"] = addresses
        l4 = _layer4(record)
        if l4 is not None:
            out["l4"] = l4
        out["source"] = self._end(source)
        out["destination"] = self._end(destination)
        out["Type"] = "L3_L4"
        if record.node:
            out["node_name"] = record.node
        out.update(tail)
        return out

    def _end(self, end: FlowEnd) -> dict[str, Any]:
        labels = end_labels(end, self._messages.labels)
        key = (end.endpoint, labels)
        found = self._ends.get(key)
        if found is None:
            if len(self._ends) >= self.CACHE:
                self._ends.clear()
            message = self._messages.endpoint(end)
            found = self._ends[key] = json_format.MessageToDict(message, preserving_proto_field_name=True)
        return found

    def _tail(self, record: FlowRecord) -> tuple[str | None, dict[str, Any]]:
        """The verdict, and the fields from the event type on (they depend on these alone)."""
        icmp = record.protocol in (ICMP, ICMPV6)
        key = (record.protocol, record.tcp_flags, record.verdict, record.drop_reason, record.observation,
               record.source.port if icmp else 0, record.destination.port if icmp else 0)
        found = self._tails.get(key)
        if found is None:
            if len(self._tails) >= self.CACHE:
                self._tails.clear()
            flow = json_format.MessageToDict(self._messages.flow(record), preserving_proto_field_name=True)
            tail = {name: flow[name] for name in _TAIL if name in flow}
            found = self._tails[key] = (flow.get("verdict"), tail)
        return found

    def lost_line(self, reason: str, count: int, now: float) -> bytes:
        event = flow_pb2.LostEvent(source=_SOURCES[reason], num_events_lost=count)
        when = timestamp(now).ToJsonString()
        return _encode({"lost_events": json_format.MessageToDict(event, preserving_proto_field_name=True),
                        "node_name": self.node, "time": when}) + b"\n"


_TAIL = ("event_type", "traffic_direction", "trace_observation_point", "drop_reason_desc", "Summary")
_FLAGS = [{name: True for bit, name in enumerate(TCP_FLAG_FIELDS) if bits & (1 << bit)} for bits in range(256)]
_ICMP = {ICMP: "ICMPv4", ICMPV6: "ICMPv6"}


def _ports(first: str, first_value: int, second: str, second_value: int) -> dict[str, Any]:
    """Two integer fields as protobuf's JSON writes them: a field at 0 is left out."""
    out: dict[str, Any] = {first: first_value} if first_value else {}
    if second_value:
        out[second] = second_value
    return out


def _layer4(record: FlowRecord) -> dict[str, Any] | None:
    sport, dport = record.source.port, record.destination.port
    if record.protocol == TCP:
        tcp = _ports("source_port", sport, "destination_port", dport)
        tcp["flags"] = _FLAGS[record.tcp_flags & 0xFF]
        return {"TCP": tcp}
    if record.protocol == UDP:
        return {"UDP": _ports("source_port", sport, "destination_port", dport)}
    if record.protocol in _ICMP:
        return {_ICMP[record.protocol]: _ports("type", sport, "code", dport)}
    return None


# --- the file -----------------------------------------------------------------------------------------


class ExportFile:
    """The export file with its rotation: appended to (created 0600, its directory 0700 if missing), rotated
    before a line that would take it past ``max_bytes``, the newest ``max_backups`` rotated files kept. A write
    that fails is undone (the file cut back to its last whole line) and the file closed, so that the next
    write opens it again (a directory removed meanwhile, a file system remounted)."""

    def __init__(self, path: Path, max_bytes: int, max_backups: int) -> None:
        self.path, self.max_bytes, self.max_backups = path, max_bytes, max_backups
        self.rotations = 0
        self._fd: int | None = None
        self._size = 0

    def write(self, lines: Sequence[bytes]) -> None:
        """Write ``lines`` (each ending with a newline), rotating as needed; OSError if it failed (what
        this call wrote of the current file is undone)."""
        if self._fd is None:
            self._open()
        for chunk in plan_writes(self._size, [len(line) for line in lines], self.max_bytes):
            if chunk.rotate_first:
                self._rotate()
            self._append(b"".join(lines[chunk.start:chunk.stop]))

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _open(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        before = self._size
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
                self._size += written
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, before)  # no half line for the pipeline's parser
            self._size = before
            self.close()
            raise

    def _rotate(self) -> None:
        self.close()
        when = time.time()
        target = self.path.with_name(backup_name(self.path.name, when))
        while target.exists():  # two rotations within a millisecond
            when += 0.001
            target = self.path.with_name(backup_name(self.path.name, when))
        os.rename(self.path, target)
        self.rotations += 1
        for name in expired(os.listdir(self.path.parent), self.path.name, self.max_backups):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path.parent / name)
        self._open()


# --- the exporter -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportFigures:
    """What the export did so far (``podmeter_flow_export_*``)."""

    written: int
    dropped: dict[str, int]
    write_errors: int
    rotations: int
    queued: int
    failing: bool


_Batch = tuple[list[FlowRecord], dict[Endpoint, tuple[str, ...]]]


class FlowExporter:
    """The export of one agent's flows to a file: :meth:`start` on the agent's event loop, :meth:`stop` there
    too (it waits for the worker thread, at most :data:`STOP_GRACE` seconds of writing)."""

    def __init__(self, feed: FlowFeed, selector: ExportSelector, lines: ExportLines, file: ExportFile,
                 labels: LabelSource, *, queue_records: int, retry_interval: float) -> None:
        self.feed, self.selector, self.lines, self.file, self.labels = feed, selector, lines, file, labels
        self.queue_records, self.retry_interval = queue_records, retry_interval
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the counts the event loop and the worker both change
        self._queued = 0
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._unreported = dict.fromkeys(DROP_REASONS, 0)  # dropped records no lost_events line has said yet
        self.written = 0
        self.write_errors = 0
        self._failing: str | None = None  # the error of the last write, while writes fail
        self._retry_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def figures(self) -> ExportFigures:
        with self._lock:
            return ExportFigures(self.written, dict(self._dropped), self.write_errors, self.file.rotations,
                                 self._queued, self._failing is not None)

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="podmeter-flow-export", daemon=True)
        self._thread.start()
        reader = self.feed.open(self.selector, follow=True, client="flow-export", pinned=True)
        self._task = asyncio.create_task(self._follow(reader), name="flow-export")
        log.info("exporting flows to %s (rotated at %d bytes, %d rotated files kept)", self.file.path,
                 self.file.max_bytes, self.file.max_backups)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread is not None:
            self._queue.put(None)
            self._stopping.set()
            deadline = time.monotonic() + STOP_GRACE + 1.0
            while self._thread.is_alive() and time.monotonic() < deadline:  # no executor thread for a join
                await asyncio.sleep(0.02)
            if self._thread.is_alive():
                log.warning("the flow export's writes to %s did not end within %.0f s (a stuck disk?)",
                            self.file.path, STOP_GRACE)

    # --- on the event loop

    async def _follow(self, reader: Any) -> None:
        async with reader:
            async for item in reader.follow_batches():
                if isinstance(item, Gap):
                    self._drop(LOST, item.lost)
                else:
                    self._enqueue(item.records)

    def _enqueue(self, records: list[FlowRecord]) -> None:
        with self._lock:
            if self._queued + len(records) > self.queue_records:
                full = True
            else:
                full = False
                self._queued += len(records)
        if full:
            self._drop(QUEUE_FULL, len(records))
            return
        ends = {end.endpoint for r in records for end in (r.source, r.destination) if end.endpoint is not None}
        self._queue.put((records, {e: self.labels(e) for e in ends}))

    def _drop(self, reason: str, count: int) -> None:
        with self._lock:
            self._dropped[reason] += count
            self._unreported[reason] += count

    # --- on the worker thread

    def _work(self) -> None:
        deadline: float | None = None
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    break
                records, labels = item
                if deadline is None and self._stopping.is_set():
                    deadline = time.monotonic() + STOP_GRACE
                if deadline is not None and time.monotonic() > deadline:
                    self._done(len(records))
                    continue
                self._write(records, labels)
        finally:
            self.file.close()

    def _done(self, count: int) -> None:
        with self._lock:
            self._queued -= count

    def _write(self, records: list[FlowRecord], labels: dict[Endpoint, tuple[str, ...]]) -> None:
        count = len(records)
        now = time.monotonic()
        if self._failing is not None and now < self._retry_at:
            self._done(count)
            self._drop(WRITE_ERROR, count)
            return
        with self._lock:
            unreported, self._unreported = self._unreported, dict.fromkeys(DROP_REASONS, 0)
        wall = time.time()
        lost = [self.lines.lost_line(reason, n, wall) for reason, n in unreported.items() if n]
        try:
            self.file.write(lost + self.lines.flow_lines(records, labels))
        except OSError as exc:
            self._failed(exc, count, unreported, now)
            return
        finally:
            self._done(count)
        with self._lock:
            self.written += count
        if self._failing is not None:
            log.info("the flow export writes to %s again", self.file.path)
            self._failing = None

    def _failed(self, exc: OSError, count: int, unreported: dict[str, int], now: float) -> None:
        with self._lock:
            self.write_errors += 1
            for reason, n in unreported.items():  # said in a later line
                self._unreported[reason] += n
        self._drop(WRITE_ERROR, count)
        self._retry_at = now + self.retry_interval
        error = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        if self._failing != error:
            log.warning("the flow export cannot write to %s: %s; its records are dropped and counted "
                        "(podmeter_flow_export_records_dropped_total{reason=\"write_error\"}), tried again every "
                        "%g s", self.file.path, exc, self.retry_interval)
            self._failing = error


def exporter(feed: FlowFeed, path: str, node: str, labels: Callable[[Endpoint], tuple[str, ...]], *,
             selector: ExportSelector, mask: MaskTree, max_bytes: int, max_backups: int, queue_records: int,
             retry_interval: float) -> FlowExporter:
    """A :class:`FlowExporter` of ``feed`` to ``path``."""
    return FlowExporter(feed, selector, ExportLines(node, mask), ExportFile(Path(path), max_bytes, max_backups),
                        labels, queue_records=queue_records, retry_interval=retry_interval)
