"""The flow export's own figures (``--flow-export-file``), read from the exporter at scrape time (registered
only when the export is on). Every drop reason exists at 0 from the start.

Next stage: none; the agent's registry serves them on ``/metrics`` beside ``agent_state``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from podmeter.adapters.flow_export import DROP_REASONS, ExportFigures
from podmeter.adapters.metrics.families import by_one, counter, gauge, with_zeros


class FlowExportCollector(Collector):
    """``podmeter_flow_export_*`` from a getter of the exporter's figures."""

    def __init__(self, figures: Callable[[], ExportFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        f = self._figures()
        yield counter("podmeter_flow_export_records_written", "Flow records written to the flow export file.",
                      value=f.written)
        yield counter("podmeter_flow_export_records_dropped",
                      "Flow records the export did not write, by reason: lost (the flow feed's ring overwrote them "
                      "before the export read them), queue_full (the writes were behind: a slow disk), "
                      "write_error (a write failed: a full disk, an unwritable path).",
                      ("reason",), by_one(with_zeros(f.dropped, DROP_REASONS)))
        yield counter("podmeter_flow_export_write_errors", "Writes to the flow export file that failed (each is "
                      "tried again after the retry interval).", value=f.write_errors)
        yield counter("podmeter_flow_export_rotations", "Rotations of the flow export file.", value=f.rotations)
        yield gauge("podmeter_flow_export_queued_records", "Flow records waiting for the export's writer.", f.queued)
        yield gauge("podmeter_flow_export_failing", "1 while the writes to the flow export file fail, else 0.",
                    int(f.failing))
