"""The flow export (``adapters.flow_export``) on real files, in-process: the lines are Hubble's exporter's
(the agent's own Hubble messages in protobuf's JSON form), allow and deny lists and the field mask apply,
rotation keeps at most N backups of about the maximum size, a reader behind the ring and a slow disk (a
FIFO nobody reads) drop and count records while the event loop stays free, a full file system (a 64 KiB
tmpfs) and a read-only one are counted, never a half line written, and writing resumes when they recover;
after ``stop`` no thread and no file descriptor is left. The agent with real traffic is in
tests/adapters/test_flow_export_kernel.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from google.protobuf import json_format

from bpf_support import needs_root
from flow_support import sample_records
from podmeter.adapters.flow_export import ExportLines, FlowExporter, check_field_mask, exporter
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.flows import FlowMessages
from podmeter.adapters.metrics.flow_export import FlowExportCollector
from podmeter.model.endpoints import Endpoint
from podmeter.model.flow_export import ExportSelector, is_backup, mask_tree
from podmeter.model.flow_records import FlowFilter
from podmeter.model.services import ServiceName

THREAD = "podmeter-flow-export"


def labels(endpoint: Endpoint) -> tuple[str, ...]:
    return ("app", endpoint.pod)


EVERY_RECORD = ExportSelector()


def make(feed: FlowFeed, path: Path, selector: ExportSelector = EVERY_RECORD, mask: tuple[str, ...] = (),
         max_bytes: int = 1 << 20, max_backups: int = 5, queue_records: int = 10_000,
         retry_interval: float = 0.2) -> FlowExporter:
    return exporter(feed, str(path), "node-a", labels, selector=selector, mask=mask_tree(mask), max_bytes=max_bytes,
                    max_backups=max_backups, queue_records=queue_records, retry_interval=retry_interval)


@contextlib.asynccontextmanager
async def running(export: FlowExporter) -> AsyncIterator[FlowExporter]:
    await export.start()
    try:
        yield export
    finally:
        await export.stop()


async def until(check: Any, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def open_fds_to(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)):
                found.append(target)
    return found


async def test_every_record_is_a_line_of_hubbles_exporter_format(tmp_path: Path) -> None:
    feed = FlowFeed(100)
    path = tmp_path / "logs" / "flows.log"
    records = sample_records(9)
    async with running(make(feed, path)) as export:
        feed.publish(records)
        await until(lambda: export.figures().written == 9, what="9 records written")
    messages = FlowMessages(labels)
    got = lines(path)
    assert [list(line) for line in got] == [["flow", "node_name", "time"]] * 9  # Hubble's ExportEvent, in order
    for line, record in zip(got, records, strict=True):
        flow = messages.flow(record)
        assert line["flow"] == json_format.MessageToDict(flow, preserving_proto_field_name=True)
        assert line["node_name"] == "node-a" and line["time"] == flow.time.ToJsonString() == line["flow"]["time"]
    assert got[1]["flow"]["source"]["pod_name"] == "web" and got[1]["flow"]["destination"]["pod_name"] == "db"
    assert got[1]["flow"]["verdict"] == "FORWARDED" and "k8s:app=web" in got[1]["flow"]["source"]["labels"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not [t for t in threading.enumerate() if t.name == THREAD] and open_fds_to(tmp_path) == []


async def test_allow_deny_and_the_field_mask_apply(tmp_path: Path) -> None:
    feed = FlowFeed(100)
    path = tmp_path / "flows.log"
    selector = ExportSelector(allow=(FlowFilter(to_pod="shop/db"), FlowFilter(protocol="tcp")),
                              deny=(FlowFilter(protocol="udp"),))
    mask = ("time", "source.namespace", "destination.pod_name", "verdict", "l4.TCP")
    async with running(make(feed, path, selector, mask)) as export:
        feed.publish(sample_records(12))  # odd ones to shop/db; TCP, UDP, ICMP in turn
        await until(lambda: export.figures().written == 6, what="the selected records")
    got = lines(path)
    ports = [0, 3, 5, 6, 9, 11]  # to db or TCP, not UDP (i % 3 == 1)
    assert [line["flow"]["time"] for line in got] == [f"1970-01-01T00:00:{p:02d}Z" for p in ports]
    for line, port in zip(got, ports, strict=True):
        expected = {"time": line["flow"]["time"], "source": {"namespace": "shop"}, "verdict": "FORWARDED",
                    "destination": {"pod_name": "db"} if port % 2 else {}}  # the world: no pod (as protobuf masks)
        tcp = {"source_port": 40000 + port, "destination_port": 5432, "flags": {"SYN": True}}
        expected["l4"] = {"TCP": tcp} if port % 3 == 0 else {}  # ICMP's l4 has no TCP
        assert line["flow"] == expected
        assert "node_name" not in line and line["time"] == line["flow"]["time"]  # as Hubble: the masked flow's


def test_the_hand_written_json_is_protobufs_json_of_the_flow() -> None:
    """``ExportLines.flow_json`` is, for every shape of record (every TCP flag byte, ports 0 and the highest,
    a protocol without a name, times with and without a fraction, an identity, both verdicts and every kind
    of drop, IPv6, the world, a Service's frontend), what protobuf's ``MessageToDict`` makes of the Hubble
    API's own message, key for key in the same order."""
    from record_support import odd_records

    export = ExportLines("node-a", mask_tree(()))
    messages = FlowMessages(labels)
    served = sample_records(9)
    through_service = msgspec.structs.replace(served[0], destination=msgspec.structs.replace(
        served[0].destination, service=ServiceName("shop", "api")))
    every = [*odd_records(), *served, through_service]
    export._labels = {e: labels(e) for r in every for e in (r.source.endpoint, r.destination.endpoint) if e}
    for record in every:
        expected = json_format.MessageToDict(messages.flow(record), preserving_proto_field_name=True)
        got = export.flow_json(record)
        assert got == expected and list(got) == list(expected), record
        assert json.dumps(got) == json.dumps(expected)  # nested keys in the same order too


def test_a_field_mask_names_fields_of_hubbles_flow() -> None:
    check_field_mask(["time", "source.namespace", "destination.pod_name", "verdict", "l4.TCP.flags.SYN", "IP"])
    for bad, why in (("sourc.namespace", "'sourc' is not a field of flow.Flow"),
                     ("source.pod", "'pod' is not a field of flow.Endpoint"),
                     ("time.seconds.x", "'seconds' has no sub-fields"),
                     ("source.workloads.name", "'workloads' has no sub-fields")):
        with pytest.raises(ValueError, match=why):
            check_field_mask([bad])


async def test_rotation_keeps_at_most_n_backups_of_about_the_max_size(tmp_path: Path) -> None:
    feed = FlowFeed(5000)
    path = tmp_path / "flows.log"
    (tmp_path / "notes.txt").write_text("not a backup")
    max_bytes = 8000
    async with running(make(feed, path, max_bytes=max_bytes, max_backups=3)) as export:
        for start in range(0, 400, 50):
            feed.publish(sample_records(50, start))
            await asyncio.sleep(0.01)
        await until(lambda: export.figures().written == 400, what="400 records written")
        rotations = export.figures().rotations
    backups = sorted(p for p in tmp_path.iterdir() if is_backup(p.name, path.name))
    assert rotations > 3 and len(backups) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*(b.name for b in backups), "flows.log", "notes.txt"])
    longest = max(len(line) for p in [*backups, path] for line in p.read_bytes().splitlines(keepends=True))
    for backup in backups:
        assert max_bytes - longest < backup.stat().st_size <= max_bytes
        assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    kept = [line for p in [*backups, path] for line in lines(p)]
    times = [line["flow"]["time"] for line in kept]
    assert times == sorted(times) and len(kept) < 400  # the newest records, in order, the oldest rotated out
    assert kept[-1]["flow"]["l4"] and times[-1] == "1970-01-01T00:06:39Z"


async def test_a_reader_behind_the_ring_is_told_what_it_lost_and_says_it_in_a_line(tmp_path: Path) -> None:
    feed = FlowFeed(16)
    path = tmp_path / "flows.log"
    async with running(make(feed, path)) as export:
        feed.publish(sample_records(100))  # before the export's task read any: the ring keeps 16
        await until(lambda: export.figures().written == 16, what="the 16 the ring kept")
        assert export.figures().dropped["lost"] == 84
        feed.publish(sample_records(1, 100))
        await until(lambda: export.figures().written == 17, what="one more")
    got = lines(path)
    assert got[0]["lost_events"] == {"source": "HUBBLE_RING_BUFFER", "num_events_lost": "84"}
    assert got[0]["node_name"] == "node-a" and "time" in got[0]
    assert got[1]["flow"]["l4"]["TCP"]["source_port"] == 40084  # the oldest the ring still held
    assert len(got) == 18 and all("flow" in line for line in got[1:])


async def test_a_slow_disk_fills_the_queue_and_drops_records_while_the_loop_stays_free(tmp_path: Path) -> None:
    """A FIFO that its reader stops reading: the writer thread blocks in write(2) as on a stuck disk."""
    fifo = tmp_path / "flows.log"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened, never read until the end
    feed = FlowFeed(1000)
    export = make(feed, fifo, queue_records=200, max_bytes=1 << 30)
    await export.start()
    try:
        for start in range(0, 3000, 100):
            feed.publish(sample_records(100, start))
            before = time.monotonic()
            await asyncio.sleep(0.01)
            assert time.monotonic() - before < 1.0  # the event loop runs: nothing waits for the disk
        await until(lambda: export.figures().dropped["queue_full"] > 0, what="records dropped for a full queue")
        figures = export.figures()
        assert figures.queued <= 200 and figures.written < 3000
        text = FlowExportCollector(export.figures).collect()
        samples = {(s.name, s.labels.get("reason")): s.value for family in text for s in family.samples}
        assert samples[("podmeter_flow_export_records_dropped_total", "queue_full")] == figures.dropped["queue_full"]
        assert samples[("podmeter_flow_export_records_dropped_total", "write_error")] == 0
    finally:
        drained = threading.Thread(target=lambda: _read_all(reader), daemon=True)
        drained.start()  # the disk comes back: what is queued is written, and the export stops
        await export.stop()
        os.close(reader)
    assert not [t for t in threading.enumerate() if t.name == THREAD]


def _read_all(fd: int) -> None:
    os.set_blocking(fd, True)
    with contextlib.suppress(OSError):
        while os.read(fd, 1 << 16):
            pass


@needs_root
async def test_a_full_file_system_is_counted_no_half_line_is_left_and_writing_resumes(
        small_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    feed = FlowFeed(10_000)
    path = small_tmpfs / "flows.log"
    async with running(make(feed, path, max_bytes=1 << 30)) as export:
        for start in range(0, 400, 20):
            feed.publish(sample_records(20, start))
            await asyncio.sleep(0.02)
        await until(lambda: export.figures().write_errors > 0, what="a write error")
        await until(lambda: export.figures().written + export.figures().dropped["write_error"] == 400,
                    what="every record written or dropped")
        failing = export.figures()
        assert failing.failing and failing.dropped["write_error"] > 0 and 0 < failing.written < 400
        assert [line for line in lines(path) if "flow" in line][-1]  # every line whole: the file parses
        warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()  # once per change of state
        path.unlink()  # the pipeline shipped the file and removed it: room again
        await asyncio.sleep(0.3)  # past the retry interval: records that come in it are dropped too
        feed.publish(sample_records(5, 1000))
        await until(lambda: export.figures().written == failing.written + 5 and not export.figures().failing,
                    what="writes again")
    got = lines(path)
    assert "source" not in got[0]["lost_events"]  # UNKNOWN_LOST_EVENT_SOURCE: 0, left out as proto3 does
    assert int(got[0]["lost_events"]["num_events_lost"]) == failing.dropped["write_error"]
    assert len(got) == 6 and any("again" in r.getMessage() for r in caplog.records)
    assert open_fds_to(small_tmpfs) == [] and not [t for t in threading.enumerate() if t.name == THREAD]


@needs_root
async def test_a_read_only_file_system_is_retried_until_it_is_writable(small_tmpfs: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    feed = FlowFeed(100)
    path = small_tmpfs / "export" / "flows.log"
    async with running(make(feed, path)) as export:
        feed.publish(sample_records(3))
        await until(lambda: export.figures().write_errors == 1, what="a write error")
        assert export.figures().dropped["write_error"] == 3 and export.figures().failing
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)
        await asyncio.sleep(0.3)  # past the retry interval
        feed.publish(sample_records(2, 3))
        await until(lambda: export.figures().written == 2, what="written after the remount")
    got = lines(path)
    assert int(got[0]["lost_events"]["num_events_lost"]) == 3 and len(got) == 3
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_agent_refuses_a_field_mask_that_names_no_flow_field(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "podmeter", "agent", "--node-name", "n", "--datapath", "memory",
                           "--flow-export-file", str(tmp_path / "flows.log"), "--flow-export-field-mask",
                           "time,source.pod"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "'pod' is not a field of flow.Endpoint" in done.stderr
    assert not (tmp_path / "flows.log").exists()


@pytest.mark.skipif(not os.path.exists("/usr/bin/promtool"), reason="promtool (Debian's prometheus) missing")
async def test_the_exports_metrics_exist_from_the_start_and_promtool_finds_nothing(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    export = make(FlowFeed(10), tmp_path / "flows.log")
    registry.register(FlowExportCollector(export.figures))
    text = generate_latest(registry)
    for reason in ("lost", "queue_full", "write_error"):
        assert registry.get_sample_value("podmeter_flow_export_records_dropped_total", {"reason": reason}) == 0
    assert registry.get_sample_value("podmeter_flow_export_records_written_total") == 0
    assert registry.get_sample_value("podmeter_flow_export_failing") == 0
    done = subprocess.run(["/usr/bin/promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done
