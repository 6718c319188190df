"""`podmeter apiserver`: run the lab API server, or (`podmeter apiserver fault ...`) poke a running one.

It serves HTTPS by default, with a self-signed certificate (made by ``openssl``) that the kubeconfig it
writes names as the CA: kubectl sends no credentials over plain HTTP, so that kubeconfig works with it.
Plain HTTP only with ``--plain-http`` (most tests use it; ``podmeter lab`` runs it over HTTPS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from podmeter.lab.apiserver import Settings, serve_forever
from podmeter.lab.apiserver.client import AdminClient, AdminError
from podmeter.lab.apiserver.server import new_token

_KNOBS = ("close-watches", "compact", "stall", "unstall", "fail", "restart", "stats")


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "apiserver",
        help="run the lab Kubernetes API server (or: apiserver fault KNOB)",
        description="In-memory Kubernetes API server for the lab (namespaces, pods, leases, "
        "metricsconfigurations). 'podmeter apiserver fault KNOB --url URL --token T' pokes a running one.",
    )
    # A string default: argparse runs it through _listen like a given value, and --help shows it as typed.
    parser.add_argument("--listen", type=_listen, default="127.0.0.1:6443", help="HOST:PORT (port 0: any free)")
    parser.add_argument("--kubeconfig-out", type=Path, help="write a kubeconfig for this server here")
    parser.add_argument("--token", help="bearer token clients must send (default: random)")
    parser.add_argument("--plain-http", action="store_true",
                        help="serve plain HTTP instead of HTTPS (kubectl then sends no token: every request is a 401)")
    parser.add_argument("--tls", action="store_true",
                        help="serve HTTPS with a self-signed certificate: the default (kept for older command lines)")
    parser.add_argument("--tls-dir", type=Path,
                        help="where to put the certificate (default: tls/ beside the kubeconfig, else a new "
                             "temporary directory)")
    parser.add_argument("--history", type=int, default=10_000, help="events kept for watch resumption")
    parser.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds between watch bookmarks")
    parser.add_argument(
        "--graceful-pod-deletion",
        action="store_true",
        help="bound pods stay Terminating until deleted with grace 0 (as a kubelet does)",
    )
    parser.add_argument(
        "--too-large-rv-wait",
        type=float,
        default=3.0,
        help="seconds a read at a future resourceVersion waits before 504",
    )
    parser.add_argument(
        "--watch-queue-limit", type=int, default=10_000, help="events a watch may fall behind before it is closed"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every request (access log)")
    parser.add_argument("action", nargs="?", choices=["fault"], help=argparse.SUPPRESS)
    parser.add_argument("knob", nargs="?", choices=_KNOBS, help=argparse.SUPPRESS)
    parser.add_argument("amount", nargs="?", type=int, help=argparse.SUPPRESS)  # `fault fail 3` = --count 3
    parser.add_argument("--url", help="fault: the server's URL")
    parser.add_argument("--ca-file", help="fault: CA certificate for an HTTPS server")
    parser.add_argument("--count", type=int, default=1, help="fault fail: how many requests")
    parser.add_argument("--code", type=int, default=500, choices=[500, 503, 429], help="fault fail: status code")
    parser.add_argument("--retry-after", type=int, default=1, help="fault fail 429: Retry-After seconds")
    parser.add_argument("--verb", help="fault fail: only requests of this verb (list, watch, get, ...)")
    parser.add_argument(
        "--seconds",
        type=float,
        help="fault stall: for how long (default: until unstall); fault restart: how long to stay down",
    )
    parser.add_argument("--include-new", action="store_true", help="fault stall: also streams opened later")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.action == "fault":
        return _fault(args)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    host, port = args.listen
    if args.token is None and args.kubeconfig_out is None:
        print("podmeter apiserver: give --token or --kubeconfig-out, or no client can authenticate", file=sys.stderr)
        return 2
    settings = Settings(
        token=args.token or new_token(),
        history=args.history,
        bookmark_interval=args.bookmark_interval,
        graceful_pod_deletion=args.graceful_pod_deletion,
        too_large_wait=args.too_large_rv_wait,
        watch_queue_limit=args.watch_queue_limit,
    )
    if args.plain_http and (args.tls or args.tls_dir):
        print("podmeter apiserver: --plain-http and --tls/--tls-dir contradict each other", file=sys.stderr)
        return 2
    tls_dir = None
    if not args.plain_http:
        if shutil.which("openssl") is None:
            print("podmeter apiserver: HTTPS (the default) needs openssl for its self-signed certificate: install "
                  "it (apt-get install openssl), or serve plain HTTP with --plain-http", file=sys.stderr)
            return 2
        tls_dir = args.tls_dir or (args.kubeconfig_out.parent / "tls" if args.kubeconfig_out else
                                   Path(tempfile.mkdtemp(prefix="podmeter-apiserver-tls-")))
        print(f"podmeter apiserver: HTTPS with the self-signed certificate {tls_dir / 'apiserver.crt'} "
              "(clients trust it as the CA; the kubeconfig names it)", flush=True)
    try:
        asyncio.run(serve_forever(settings, host, port, kubeconfig_out=args.kubeconfig_out, tls_dir=tls_dir))
    except KeyboardInterrupt:
        return 0
    return 0


def _fault(args: argparse.Namespace) -> int:
    if not args.knob or not args.url or not args.token:
        print(
            "usage: podmeter apiserver fault KNOB --url URL --token TOKEN [...]; KNOB is one of " + ", ".join(_KNOBS),
            file=sys.stderr,
        )
        return 2
    client = AdminClient(args.url, args.token, args.ca_file)
    try:
        if args.knob == "stats":
            result: Any = client.stats()
        elif args.knob == "fail":
            count = args.amount if args.amount is not None else args.count
            result = client.fault("fail", count=count, code=args.code, retryAfter=args.retry_after, verb=args.verb)
        elif args.knob == "stall":
            result = client.fault("stall", seconds=args.seconds, includeNew=args.include_new)
        elif args.knob == "restart":
            result = client.fault("restart", downSeconds=args.seconds if args.seconds is not None else 0.5)
        else:
            result = client.fault(args.knob)
    except (AdminError, OSError) as exc:
        print(f"podmeter apiserver fault: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0
