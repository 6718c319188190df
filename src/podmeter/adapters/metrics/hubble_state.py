"""The Hubble API's own figures, read from the server at scrape time (registered only when it is on).

Next stage: none; the agent's registry serves them on ``/metrics`` beside ``agent_state``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from podmeter.adapters.metrics.families import counter, gauge


class HubbleStateCollector(Collector):
    """``podmeter_hubble_peer_clients`` and ``podmeter_hubble_peer_clients_dropped_total`` from a getter
    of (clients following ``peer.Peer/Notify`` now, clients dropped for falling behind so far)."""

    def __init__(self, figures: Callable[[], tuple[int, int]]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        clients, dropped = self._figures()
        yield gauge("podmeter_hubble_peer_clients", "Clients following peer.Peer/Notify (Hubble Relay).", clients)
        yield counter("podmeter_hubble_peer_clients_dropped",
                      "peer.Peer/Notify clients dropped for falling behind (they reconnect to a fresh list).",
                      value=dropped)
