"""``podmeter observe``: the flows an agent saw, as ``hubble observe`` shows them.

Reads the agent's ``/debug/flows`` stream (NDJSON) and prints one line per flow (``-o compact``) or the
records themselves (``-o json``, one JSON object per line; the fields are a contract, docs/flows.md).
Without ``--follow`` it prints the last ``--last`` matching flows (default 20) and exits; with it, it keeps
printing new flows until interrupted. The agent answers on loopback only unless it runs with
``--debug-remote`` (flows name pods and IPs).

Nothing of the answer is trusted (docs/flows.md, "What observe trusts of an answer"): every text printed is
escaped (:func:`printable`: no terminal control character gets through), a line is read with a bound
(:data:`MAX_LINE`), every field the compact line shows is checked for its type, and an answer that is not
what the agent sends is said in one line on stderr with exit status 1. A follower is told on stderr how
many flows it lost (``{"lost": N}``) and why the agent ended its stream (``{"error": "..."}``, exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import re
import sys
import time
import urllib.parse
from collections.abc import Iterator
from datetime import datetime
from typing import Any, NamedTuple, TextIO

from podmeter.adapters.http import parse_listen

DEFAULT_SERVER = "127.0.0.1:9978"  # the agent's default --listen
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "observe", help="show the flows an agent saw (who talks to whom)", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--server", default=DEFAULT_SERVER, help="the agent's HTTP address, HOST:PORT")
    p.add_argument("-o", "--output", choices=("compact", "json"), default="compact", help="output format")
    p.add_argument("--last", type=_count, default=None,
                   help="print the last N matching flows first (default: 20, or 0 with --follow)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new flows until interrupted")
    add_filters(p)
    p.add_argument("--since", type=parse_since,
                   help="flows seen since this long ago (30s, 5m, 2h) or this time (RFC 3339 or epoch seconds)")
    p.add_argument("--labels", action="store_true",
                   help="show each end's labels (a pod of the agent's node: its own; another node's: its identity's)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the agent to answer")
    p.set_defaults(func=run)


FILTERS = ("namespace", "pod", "from_pod", "to_pod", "workload", "service", "from_service", "to_service", "protocol",
           "port", "verdict")  # what add_filters adds (and --since)


def add_filters(p: argparse.ArgumentParser) -> None:
    """The filter options: observe's, and the language of the agent's flow export filters (cli.agent)."""
    p.add_argument("--namespace", help="flows with either end in this namespace")
    p.add_argument("--pod", help="flows with either end this pod: NAME or NAMESPACE/NAME")
    p.add_argument("--from-pod", help="flows whose source is this pod: NAME or NAMESPACE/NAME")
    p.add_argument("--to-pod", help="flows whose destination is this pod: NAME or NAMESPACE/NAME")
    p.add_argument("--workload", help="flows with either end this workload: NAME or NAMESPACE/NAME, or world")
    p.add_argument("--service", help="flows with either end this Service: NAME or NAMESPACE/NAME")
    p.add_argument("--from-service", help="flows whose source is this Service (replies): NAME or NAMESPACE/NAME")
    p.add_argument("--to-service", help="flows whose destination is this Service: NAME or NAMESPACE/NAME")
    p.add_argument("--protocol", help="tcp, udp, icmp (either), icmpv4, icmpv6; dns: the DNS records (query, "
                   "type, response code, count, latency per pod and server)")
    p.add_argument("--port", type=_port, help="flows with either end on this port")
    p.add_argument("--verdict", choices=("forwarded", "dropped"),
                   help="forwarded flows only, or the packets the kernel dropped (with their reason)")


def filter_query(args: argparse.Namespace, names: tuple[str, ...] = FILTERS) -> dict[str, str]:
    """The filters given, as ``/debug/flows``'s query parameters (``adapters.flow_http.parse_query``)."""
    return {name: str(getattr(args, name)) for name in names if getattr(args, name) is not None}


def _count(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be a number of flows, not {value!r}")
    return int(value)


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, not {value!r}")
    return int(value)


def parse_since(value: str, now: float | None = None) -> float:
    """``30s``/``5m``/``2h``/``1d`` ago, an RFC 3339 time or epoch seconds -> epoch seconds."""
    match = _DURATION.match(value.strip())
    seconds = math.nan
    if match:
        seconds = (time.time() if now is None else now) - float(match.group(1)) * _UNITS[match.group(2)]
    else:
        with contextlib.suppress(ValueError):
            seconds = float(value)
        if math.isnan(seconds):  # not a number of seconds (nan is none either)
            with contextlib.suppress(ValueError, OverflowError):
                seconds = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    if not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(
            f"--since {value!r}: expected a duration (30s, 5m, 2h) or a time (RFC 3339, epoch seconds)")
    return seconds


def query(args: argparse.Namespace) -> dict[str, str]:
    params: dict[str, str] = {}
    if args.follow:
        params["follow"] = "1"
    if args.last is not None:
        params["last"] = str(args.last)
    if args.labels:
        params["labels"] = "1"
    return params | filter_query(args, (*FILTERS, "since"))


class AgentRefused(Exception):
    """The agent answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body}" if body else str(status))
        self.status = status


class BadAnswer(Exception):
    """The answer is not what ``/debug/flows`` sends (not HTTP, not JSON, JSON of another shape, a line
    beyond :data:`MAX_LINE`): what was wrong, in one line."""


class StreamEnded(Exception):
    """The agent ended the stream and said why (a line ``{"error": "..."}``)."""


class Gap(NamedTuple):
    """``lost`` records this reader missed: the agent's ring overwrote them before they were sent."""

    lost: int


MAX_LINE = 1 << 20  # bytes of one line of the answer at most, its newline aside (a record is about 500)
BLOCK = 64 * 1024  # bytes read at a time at most
MAX_ERROR_BODY = 4096  # bytes of an error answer's body read at most
MAX_SHOWN = 300  # characters of an error answer's body shown at most


def run(args: argparse.Namespace) -> int:
    if hasattr(sys.stdout, "reconfigure"):  # a character the terminal cannot show is written as an escape
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        host, port = parse_listen(args.server)
    except ValueError:
        _say(f"podmeter observe: --server {args.server!r}: expected HOST:PORT")
        return 2
    path = f"/debug/flows?{urllib.parse.urlencode(query(args))}"
    out = sys.stdout
    json_output = args.output == "json"
    try:
        for item in _stream(host, port, path, args.timeout):
            if isinstance(item, Gap):
                out.flush()
                _say(f"podmeter observe: {item.lost} flows lost: this reader fell behind (the agent's ring of "
                     "recent flows overwrote them before they were sent)")
                continue
            line = compact(item)  # also checks the record's shape, whatever the output
            out.write(json.dumps(item, separators=(",", ":"), allow_nan=False) + "\n" if json_output else line)
            out.flush()
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader of our output went (| head)
        return 0
    except AgentRefused as exc:
        _say(f"podmeter observe: the agent at {args.server} answered {exc}")
        return 2 if exc.status == 400 else 1
    except StreamEnded as exc:
        _flush(out)
        _say(f"podmeter observe: the agent at {args.server} ended the stream: {exc}")
        return 1
    except BadAnswer as exc:
        _flush(out)
        _say(f"podmeter observe: bad answer from the agent at {args.server}: {exc}")
        return 1
    except OSError as exc:
        _flush(out)
        _say(f"podmeter observe: cannot reach the agent at {args.server}: {exc} "
             "(is `podmeter agent` running there? --server HOST:PORT)")
        return 1
    return 0


def _say(message: str) -> None:
    print(printable(message), file=sys.stderr, flush=True)


def _flush(out: TextIO) -> None:
    with contextlib.suppress(OSError):
        out.flush()


def _stream(host: str, port: int, path: str, timeout: float) -> Iterator[dict[str, Any] | Gap]:
    """The records of the answer, and a :class:`Gap` where the agent says records are missing; raises
    :class:`StreamEnded` at an ``{"error": ...}`` line and :class:`BadAnswer` at anything else that is not
    a record."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        try:
            connection.request("GET", path)
            response = connection.getresponse()
        except http.client.RemoteDisconnected:
            raise BadAnswer("it closed the connection without answering") from None
        except http.client.HTTPException as exc:
            raise BadAnswer(f"not an HTTP answer ({_exception(exc)})") from None
        if response.status != 200:
            raise AgentRefused(response.status, _error_body(response))
        if connection.sock is not None:
            connection.sock.settimeout(None)  # it answered: a follow may now wait for flows as long as it takes
        lines, number = _Lines(response), 0
        while True:
            line = lines.next()
            if line is None:
                return
            number += 1
            if line.strip():
                yield _item(_decode(line, number), number)
    finally:
        connection.close()


class _Lines:
    """The answer's lines, read in blocks of what has arrived (at most :data:`BLOCK` bytes at a time), so
    that no more than :data:`MAX_LINE` bytes of one line, and one block, are ever held: a longer line is a
    :class:`BadAnswer`, however long it really is."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.response = response
        self.pending = bytearray()

    def next(self) -> bytes | None:
        """The next line (its newline included; the last one may have none), None at the end."""
        pending, start = self.pending, 0
        while True:
            end = pending.find(b"\n", start)
            if end > MAX_LINE or (end < 0 and len(pending) > MAX_LINE):
                raise BadAnswer(f"a line of the answer is longer than {MAX_LINE} bytes (1 MiB): not a flow record")
            if end >= 0:
                line = bytes(pending[:end + 1])
                del pending[:end + 1]
                return line
            start = len(pending)
            block = self._read()
            if not block:
                line = bytes(pending)
                pending.clear()
                return line or None
            pending += block

    def _read(self) -> bytes:
        try:
            return self.response.read1(BLOCK)
        except http.client.IncompleteRead:  # cut before its end, or a chunk that is not one
            raise BadAnswer("the answer broke off in the middle (did the agent go away?)") from None
        except (http.client.HTTPException, ValueError) as exc:
            raise BadAnswer(f"not a valid HTTP answer ({_exception(exc)})") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range")
    return value


def _decode(line: bytes, number: int) -> Any:
    try:
        return json.loads(line, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:
        raise BadAnswer(f"line {number} is JSON nested too deep") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise BadAnswer(f"line {number} is not JSON ({_short(str(exc))})") from None


def _item(value: Any, number: int) -> dict[str, Any] | Gap:
    """A record (its fields are checked when it is shown), a gap, or the agent's last word."""
    if not isinstance(value, dict):
        raise BadAnswer(f"line {number} is a JSON {_kind(value)}, not an object")
    if "source" in value:
        return value
    if "lost" in value:
        lost = value["lost"]
        if not _is_int(lost) or lost < 0:
            raise BadAnswer(f"line {number}: 'lost' is a JSON {_kind(lost)}, not a count of flows")
        return Gap(lost)
    if "error" in value:
        message = value["error"]
        raise StreamEnded(_short(message) if isinstance(message, str) else f"(a JSON {_kind(message)})")
    raise BadAnswer(f"line {number} is neither a flow record, nor 'lost', nor 'error' "
                    f"(its fields: {_short(', '.join(sorted(map(str, value))))})")


def _error_body(response: http.client.HTTPResponse) -> str:
    try:
        body = response.read(MAX_ERROR_BODY)
    except (http.client.HTTPException, OSError, ValueError):
        return ""
    return _short(body.decode(errors="replace").strip())


def _exception(exc: BaseException) -> str:
    return _short(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _short(text: str) -> str:
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__


# --- what is printed ----------------------------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or not show written as an escape: C0 and
    C1 controls, DEL, and every other character Python does not call printable (line and paragraph
    separators, format characters such as bidirectional overrides, lone surrogates) become ``\\x1b``,
    ``\\u009b``, ``\\U000e0001``; a backslash becomes two, so an escape printed is never one received."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escaped(c) for c in text)


def _escaped(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


class _Fields:
    """A JSON object of the answer, read field by field: each is checked for the type the record's
    contract gives it (docs/flows.md), and text comes back escaped (:func:`printable`). ``where`` is the
    object's path in the record ("" for the record, ``source`` for its source)."""

    def __init__(self, value: Any, where: str = "") -> None:
        if not isinstance(value, dict):
            raise BadAnswer(f"{f'field {where} of a record' if where else 'a record'} is a JSON {_kind(value)}, "
                            "not an object")
        self.value: dict[str, Any] = value
        self.where = where

    def _bad(self, key: str, expected: str) -> BadAnswer:
        path = f"{self.where}.{key}" if self.where else key
        return BadAnswer(f"field {printable(path)} of a record is a JSON {_kind(self.value.get(key))}, not {expected}")

    def present(self, key: str) -> bool:
        return self.value.get(key) is not None

    def string(self, key: str) -> str:
        """The field as it is: for what is changed before it is escaped."""
        value = self.value.get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def text(self, key: str) -> str:
        return printable(self.string(key))

    def integer(self, key: str) -> int:
        value = self.value.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._bad(key, "an integer")
        return value

    def number(self, key: str) -> float:
        value = self.value.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._bad(key, "a number")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.value.get(key, False)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def texts(self, key: str) -> list[str]:
        value = self.value.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "an array of strings")
        return [printable(v) for v in value]

    def labels(self, key: str) -> dict[str, str]:
        value = self.value.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self._bad(key, "an object of strings")
        return {printable(k): printable(v) for k, v in value.items()}

    def object(self, key: str) -> _Fields:
        return _Fields(self.value.get(key), f"{self.where}.{key}" if self.where else key)


# --- the compact line ---------------------------------------------------------------------------------


def _end(end: _Fields) -> str:
    ip = end.text("ip")
    where = _host_port(ip, end.integer("port")) if end.present("port") else ip
    if end.flag("world"):
        return f"world {where}"
    service = ""
    if end.present("service"):
        named = end.object("service")
        service = f"service:{named.text('namespace')}/{named.text('name')} "
        if not end.present("pod"):
            return f"{service}{where}"  # the backend not known (yet)
    labels = end.labels("labels")
    shown = "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "} " if labels else ""
    return f"{service}{end.text('namespace')}/{end.text('pod')} {shown}{where}"


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _stamp(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds).strftime("%b %d %H:%M:%S.%f")[:-3]
    except (ValueError, OverflowError, OSError):
        raise BadAnswer(f"field time of a record is {seconds!r}, not a time") from None


def _dns_line(stamp: str, fields: _Fields) -> str:
    """A DNS record: who asked whom, the name, its type, and for responses the code and mean latency."""
    dns = fields.object("dns")
    answer = ""
    if dns.present("rcode"):
        latency = dns.object("latency_ms")
        mean = f" {latency.number('mean'):g} ms" if latency.present("mean") else ""
        answer = f" {dns.text('rcode')}{mean}"
    return (f"{stamp} {fields.text('node')}: {_end(fields.object('source'))} -> "
            f"{_end(fields.object('destination'))} DNS {dns.text('direction')} {dns.text('query')} "
            f"{dns.text('qtype')}{answer} x{dns.integer('count')}\n")


def compact(record: dict[str, Any]) -> str:
    """One readable line: time, source -> destination with ports, protocol and flags, packets, bytes.
    Every field is checked (:class:`BadAnswer` says which is wrong) and every text escaped."""
    fields = _Fields(record)
    stamp = _stamp(fields.number("time"))
    protocol = fields.text("protocol")
    if fields.present("icmp"):
        icmp = fields.object("icmp")
        protocol += f" type {icmp.integer('type')} code {icmp.integer('code')}"
    tcp_flags = fields.texts("tcp_flags")
    flags = f" [{' '.join(tcp_flags)}]" if tcp_flags else ""
    verdict = fields.string("verdict") if fields.present("verdict") else "forwarded"
    shown = "" if verdict == "forwarded" else f" {printable(verdict.upper())}"
    if fields.present("drop_reason"):
        shown += f" ({fields.text('drop_reason')})"
    if fields.present("tcp_retransmits") and (retransmits := fields.integer("tcp_retransmits")):
        flags += f" {retransmits} retransmits"
    if fields.present("dns"):
        return _dns_line(stamp, fields)
    return (f"{stamp} {fields.text('node')}: {_end(fields.object('source'))} -> "
            f"{_end(fields.object('destination'))} {protocol}{flags} {fields.text('observation')}{shown} "
            f"{fields.integer('packets')} pkts {fields.integer('bytes')} B\n")
