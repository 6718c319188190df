"""Per-Service series, rendered in the Prometheus text format at scrape time (``model.service_series``).

``podmeter_service_bytes_total`` and ``podmeter_service_packets_total`` by ``service_namespace``,
``service``, ``client_namespace``, ``client_workload_kind``, ``client_workload``, ``protocol`` and
``direction`` (request: client to Service, reply: back), and ``podmeter_service_connections_total`` (TCP
connections the clients opened) by the same labels but the direction (docs/services.md).
"""

from __future__ import annotations

from podmeter.adapters.metrics.flow_traffic import traffic_families
from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.model.service_series import ServiceClient, ServiceKey, ServiceTraffic

_SERIES = (
    ("podmeter_service_bytes_total", "Bytes between client workloads of this node and a Service (request, reply)."),
    ("podmeter_service_packets_total", "Packets between client workloads of this node and a Service."),
)
_CONNECTIONS = ("podmeter_service_connections_total", "TCP connections client workloads of this node opened "
                "to a Service.")
_CLIENT = ("service_namespace", "service", "client_namespace", "client_workload_kind", "client_workload", "protocol")


def _client(client: ServiceClient) -> str:
    return ",".join(f'{name}="{escape(value)}"' for name, value in zip(_CLIENT, client, strict=True))


def _labels(key: ServiceKey) -> str:
    return "{" + _client(key.client) + f',direction="{key.direction}"' + "}"


def render_service_traffic(traffic: ServiceTraffic) -> bytes:
    lines = traffic_families(traffic.values(), _labels, _SERIES, "counter")
    name, help_text = _CONNECTIONS
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    lines += [f"{name}{{{_client(client)}}} {opened.packets}" for client, opened in sorted(traffic.opened())]
    return ("\n".join(lines) + "\n").encode()
