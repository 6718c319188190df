"""Retina's node-level series of the node's own network stack (what Retina's ``linuxutil`` plugin exports),
read at each scrape from the kernel's files of the agent's network namespace (the node's: the agent runs
with hostNetwork) and parsed by :mod:`podmeter.model.node_stats`:

* ``networkobservability_tcp_state{state}``: open TCP sockets (``/proc/net/tcp``, ``tcp6``) by state;
* ``networkobservability_tcp_connection_remote{address}``: open TCP sockets by remote address, loopback and
  unspecified addresses left out, the ``remote_limit`` biggest counts kept and the rest under ``_other_``;
* ``networkobservability_tcp_connection_stats{statistic_name}``: the ``TcpExt`` counters of
  ``/proc/net/netstat`` (lower-cased, as Retina's dashboard queries them) and ``resetcount``, the RSTs of
  the observed pods (``resets``: the one sample of the family that is not the kernel's);
* ``networkobservability_udp_connection_stats{statistic_name="active"}``: open UDP sockets (``udp``, ``udp6``);
* ``networkobservability_interface_stats{interface_name,statistic_name}``: the generic counters of every
  interface but ``lo`` (``/proc/net/dev``: of the agent's network namespace, where ``/sys/class/net`` is
  that of whoever mounted ``/sys``), the ``interface_limit`` interfaces that carried the most bytes kept
  and the others summed under ``_other_``.

A file that cannot be read leaves its families out (``tcp_connection_stats`` keeps ``resetcount``) and
counts in ``podmeter_node_stats_errors_total{file,error="unreadable"}``; lines that do not parse count in
``error="malformed"``. A kernel without IPv6 has no ``tcp6`` or ``udp6``: no IPv6 sockets, not an error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from podmeter.adapters.metrics.pod_traffic import escape
from podmeter.adapters.metrics.retina_node import RESETS, family
from podmeter.model.node_stats import (
    SocketTable,
    parse_net_dev,
    parse_netstat,
    parse_sockets,
    tcp_states,
    top,
    top_interfaces,
)

FILES = ("tcp", "tcp6", "udp", "udp6", "netstat", "dev")
IPV6_TABLES = {"tcp6", "udp6"}
ERRORS = "podmeter_node_stats_errors_total"
UNREADABLE, MALFORMED = "unreadable", "malformed"
ACTIVE = "active"  # udp_connection_stats' statistic_name: the open sockets, as Retina's dashboard queries it


class NodeStatsExposition:
    """Renders the series above from ``proc_net`` (``/proc/net``: the process's own network namespace);
    ``errors`` counts the files and lines it could not read, from the start."""

    def __init__(self, resets: Callable[[], int], remote_limit: int, interface_limit: int,
                 proc_net: Path = Path("/proc/net")) -> None:
        self.resets = resets
        self.remote_limit, self.interface_limit = remote_limit, interface_limit
        self.proc_net = proc_net
        self.errors: Counter[tuple[str, str]] = Counter({(f, e): 0 for f in FILES for e in (UNREADABLE, MALFORMED)})

    def render(self) -> bytes:
        out = self._sockets("tcp", self._tcp_families) + self._sockets("udp", self._udp_family)
        out += self._connection_stats() + self._interfaces() + self._errors()
        return ("\n".join(out) + "\n").encode()

    def _read(self, name: str) -> str | None:
        """The file's text; None (counted) if it cannot be read, "" for an IPv6 table the kernel lacks."""
        try:
            return (self.proc_net / name).read_text(errors="replace")
        except FileNotFoundError:
            if name in IPV6_TABLES:
                return ""
            self.errors[name, UNREADABLE] += 1
        except OSError:
            self.errors[name, UNREADABLE] += 1
        return None

    def _sockets(self, protocol: str, families: Callable[[SocketTable], list[str]]) -> list[str]:
        """The families of a protocol's two socket tables; none if either cannot be read."""
        table = SocketTable()
        for name in (protocol, protocol + "6"):
            text = self._read(name)
            if text is None:
                return []
            parsed = parse_sockets(text)
            self.errors[name, MALFORMED] += parsed.errors
            table += parsed
        return families(table)

    def _tcp_families(self, table: SocketTable) -> list[str]:
        states, unknown = tcp_states(table)
        self.errors["tcp", MALFORMED] += unknown
        name = "networkobservability_tcp_state"
        out = family(name, [f'{name}{{state="{state}"}} {count}' for state, count in sorted(states.items())])
        name = "networkobservability_tcp_connection_remote"
        return out + family(name, [f'{name}{{address="{escape(address)}"}} {count}'
                                   for address, count in sorted(top(table.remotes, self.remote_limit).items())])

    @staticmethod
    def _udp_family(table: SocketTable) -> list[str]:
        name = "networkobservability_udp_connection_stats"
        return family(name, [f'{name}{{statistic_name="{ACTIVE}"}} {table.sockets}'])

    def _connection_stats(self) -> list[str]:
        text = self._read("netstat")
        counters = parse_netstat(text) if text is not None else None
        values = {RESETS: self.resets()}
        if counters is not None:
            self.errors["netstat", MALFORMED] += counters.errors
            values |= {name: value for name, value in counters.values.items() if name != RESETS}
        name = "networkobservability_tcp_connection_stats"
        return family(name, [f'{name}{{statistic_name="{escape(statistic)}"}} {value}'
                             for statistic, value in sorted(values.items())])

    def _interfaces(self) -> list[str]:
        text = self._read("dev")
        if text is None:
            return []
        parsed = parse_net_dev(text)
        self.errors["dev", MALFORMED] += parsed.errors
        name, kept = "networkobservability_interface_stats", top_interfaces(parsed.values, self.interface_limit)
        return family(name, [f'{name}{{interface_name="{escape(interface)}",statistic_name="{statistic}"}} {value}'
                             for interface, values in sorted(kept.items())
                             for statistic, value in sorted(values.items())])

    def _errors(self) -> list[str]:
        return [f"# HELP {ERRORS} Kernel files of the node's network stack podmeter could not read, and lines of "
                "them it could not parse.", f"# TYPE {ERRORS} counter",
                *(f'{ERRORS}{{file="{file}",error="{error}"}} {count}'
                  for (file, error), count in sorted(self.errors.items()))]
