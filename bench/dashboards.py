"""How much of the dashboards people run podmeter fills: Retina's six (as Retina ships them) and podmeter's
own, panel by panel, against a real agent.

Run (root, ``make bpf``, Debian's ``prometheus``): ``.venv/bin/python -m bench.dashboards [--mode remote]``
(about 20 s per mode). The scenario is the test's (``tests/dashboard_support.py``): a real ``podmeter
agent --datapath ebpf`` (``--retina-compat=remote`` and Hubble's metrics, or without either: ``--mode
default``) and ``podmeter operator`` in a private network namespace, four netns pods in two namespaces with
TCP, UDP, refused connections and drops, Prometheus scraping them every second, and every panel's queries
sent to ``/api/v1/query``.

Prints, per dashboard, the panels with data / the panels, and for every empty panel why (the series
podmeter does not export, from ``tests/dashboard_queries.py``'s table); the last line is one JSON object:
``{"mode", "retina_panels", "retina_with_data", "own_panels", "own_with_data", "dashboards": {name:
[with data, panels]}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test's scenario, shared

import dashboard_queries as dq
from bpf_support import BPFFS, Topology, remove_pin_dir, unique
from dashboard_support import DEFAULT, REMOTE, measure, summary
from lab_server import LabServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=(REMOTE, DEFAULT), default=REMOTE)
    args = parser.parse_args()
    os.environ.setdefault("PODMETER_ALLOW_PLAIN_HTTP_CREDENTIALS", "1")  # the lab API server, plain HTTP on loopback
    topology, pins, workdir = Topology(), BPFFS / unique("pmbench"), Path(tempfile.mkdtemp(prefix="pm-dash-"))
    topology.create()
    try:
        with topology.in_host():
            server = LabServer(process=False)
            server.start()
        try:
            results = measure(topology, server, pins, workdir, args.mode)
        finally:
            server.stop()
    finally:
        remove_pin_dir(pins)
        topology.destroy()
        shutil.rmtree(workdir, ignore_errors=True)
    figures = summary(results)
    for name, row in figures.items():
        print(f"{name:40} {row['with_data']:3} / {row['panels']:3} with data ({row['expected']} podmeter should fill)")
        for r in results:
            if r.panel.dashboard == name and not r.has_data:
                print(f"    empty: {r.panel.id:4} {r.panel.title or '(untitled)'}: {r.expected or 'no samples'}")
    retina = {n: f for n, f in figures.items() if not dq.is_own(n)}
    own = {n: f for n, f in figures.items() if dq.is_own(n)}
    print(json.dumps({
        "mode": args.mode,
        "retina_panels": sum(f["panels"] for f in retina.values()),
        "retina_with_data": sum(f["with_data"] for f in retina.values()),
        "own_panels": sum(f["panels"] for f in own.values()),
        "own_with_data": sum(f["with_data"] for f in own.values()),
        "dashboards": {n: [f["with_data"], f["panels"]] for n, f in figures.items()},
    }))


if __name__ == "__main__":
    main()
