"""Benchmark of the flow export file (``--flow-export-file``): what its writer thread turns into lines and
writes per second, beside the Hubble API's encoding of the same records.

    python -m bench.flow_export [--records 20000] [--batch 1000] [--runs 3]

The records are ``bench.observer``'s (200 pods with labels and workloads, TCP and UDP, both observation
points, a fifth to the world).

- ``export_lines_per_s``: records turned into the export's lines (``ExportLines``: Hubble's Flow in
  protobuf's JSON form, the export event around it), no I/O, a cold cache each run; median of ``--runs``.
- ``encode_flows_per_s``: the same records turned into ``GetFlowsResponse`` bytes as the Hubble API sends
  them (``FlowMessages.serialized``), the reference in the same run.
- ``export_records_per_s``: end to end on a real file in a temporary directory: ``--records`` records
  published into the agent's flow feed in drains of ``--batch`` (each drain waits until the export's queue
  has room, so none is dropped), divided by the time until the writer thread has written them all.
- ``export_dropped``: records the export dropped meanwhile (0 expected).

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.measure import json_line, median_of, table
from bench.observer import pods, records
from podmeter.adapters.flow_export import ExportLines, exporter
from podmeter.adapters.flow_serving import FlowFeed
from podmeter.adapters.hubble.flows import FlowMessages, pod_labels
from podmeter.model.endpoints import AddressBook, Endpoint
from podmeter.model.flow_export import ExportSelector, mask_tree
from podmeter.model.flow_records import FlowRecord


def per_second(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def lines_per_s(drain: list[FlowRecord], labels: dict[Endpoint, tuple[str, ...]]) -> float:
    lines = ExportLines("node-a", mask_tree(()))
    started = time.perf_counter()
    lines.flow_lines(drain, labels)
    return per_second(len(drain), time.perf_counter() - started)


def encoded_per_s(drain: list[FlowRecord], messages: FlowMessages) -> float:
    started = time.perf_counter()
    for record in drain:
        messages.serialized(record)
    return per_second(len(drain), time.perf_counter() - started)


async def end_to_end(drain: list[FlowRecord], total: int, labels: dict[Endpoint, tuple[str, ...]]) -> tuple[float, int]:
    queue = 4 * len(drain)
    with tempfile.TemporaryDirectory() as directory:
        feed = FlowFeed(8192)
        export = exporter(feed, str(Path(directory) / "flows.log"), "node-a", lambda e: labels.get(e, ()),
                          selector=ExportSelector(), mask=mask_tree(()), max_bytes=10 << 20, max_backups=1,
                          queue_records=queue, retry_interval=2.0)
        await export.start()
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        for _ in range(total // len(drain)):
            while export.figures().queued + len(drain) > queue:
                await asyncio.sleep(0.001)  # a drain waits for room: the figure is what the writer writes
            feed.publish(drain)
            await asyncio.sleep(0)
        while export.figures().written + sum(export.figures().dropped.values()) < total:
            await asyncio.sleep(0.001)
        seconds = time.perf_counter() - started
        figures = export.figures()
        await export.stop()
    return per_second(figures.written, seconds), sum(figures.dropped.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    all_pods = pods()
    by_uid = {p.uid: p for p in all_pods}
    drain = records(args.batch, AddressBook(all_pods))
    ends = {e.endpoint for r in drain for e in (r.source, r.destination) if e.endpoint is not None}
    labels = {e: pod_labels(by_uid, e) for e in ends}
    messages = FlowMessages(lambda e: pod_labels(by_uid, e))
    export_lines = median_of(args.runs, lambda: lines_per_s(drain, labels))
    encode = median_of(args.runs, lambda: encoded_per_s(drain, messages))
    written, dropped = asyncio.run(end_to_end(drain, args.records, labels))
    table([("export_lines_per_s", export_lines, encode, "vs the Hubble API's encoding (encode_flows_per_s)"),
           ("export_records_per_s", written, export_lines, "end to end, written to a file, vs lines alone"),
           ("export_dropped", dropped, None, "0 expected")])
    json_line({"export_lines_per_s": round(export_lines), "encode_flows_per_s": round(encode),
               "export_records_per_s": round(written), "export_dropped": dropped,
               "export_vs_encode": round(export_lines / encode, 3) if encode else None})


if __name__ == "__main__":
    main()
