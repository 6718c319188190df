"""``podmeter doctor``: compare a node's pinned filter map with the API server's truth.

Exit status 0 when they match (or the map is full of desired IPs only: overflow), 1 on drift (each
leaked or missing IP is printed with its pods), 2 when the truth or the map cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from podmeter.adapters.datapath.ebpf import DEFAULT_BPFFS, DatapathSetupError, EbpfDatapath
from podmeter.adapters.datapath.ebpf.libbpf import BpfCallError
from podmeter.adapters.kube.connection import ConnectionConfigError, load_connection
from podmeter.runtime.doctor import Audit, DoctorError, audit, read_view


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "doctor", help="audit a node's kernel filter map against the API server", description=__doc__)
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, then the in-cluster account)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--node-name", required=True, help="the node whose pinned map is audited")
    p.add_argument("--bpffs", default=DEFAULT_BPFFS, help=f"pin directory (default {DEFAULT_BPFFS})")
    p.add_argument("--recheck", type=float, default=2.0,
                   help="seconds before a second audit; only differences seen both times count (0: one audit)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        connection = load_connection(args.kubeconfig, args.context)
        first = _audit_once(connection, args.node_name, args.bpffs)
        result = first
        if first.findings and args.recheck > 0:
            time.sleep(args.recheck)
            result = _persisting(first, _audit_once(connection, args.node_name, args.bpffs))
    except (ConnectionConfigError, DoctorError) as exc:
        print(f"podmeter doctor: {exc}", file=sys.stderr)
        return 2
    except (BpfCallError, DatapathSetupError) as exc:
        print(f"podmeter doctor: cannot open the maps pinned in {args.bpffs}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json()) if args.json else result.render())
    return 0 if result.clean else 1


def _audit_once(connection: Any, node_name: str, bpffs: str) -> Audit:
    view, skipped = asyncio.run(read_view(connection, node_name))
    with EbpfDatapath.open_pinned(bpffs) as datapath:
        kernel, capacity = datapath.contents(), datapath.capacity
    return audit(view, kernel, capacity, skipped)


def _persisting(first: Audit, second: Audit) -> Audit:
    """The second audit, keeping only differences the first one saw too (a write in flight is not drift)."""
    seen = {(f.kind, f.ip) for f in first.findings}
    second.findings = [f for f in second.findings if (f.kind, f.ip) in seen]
    return second
