"""Lab benchmark: the whole system under sustained churn, with the lab's own checks running.

Run (root for eBPF):
``.venv/bin/python -m bench.lab ebpf --duration 600 --rate 20``   # the 10-minute eBPF run
``.venv/bin/python -m bench.lab soak``                            # the soak scenario: 1,000,000 lifecycles
``.venv/bin/python -m bench.lab soak --lifecycles 50000``         # a shorter soak
``.venv/bin/python -m bench.lab scenarios``                       # every other shipped scenario, end to end

``ebpf`` generates a scenario: 40 steady observed pods, Job-style pods with unique labels (they finish,
then are deleted) and plain pods deleted while running, ``--rate`` lifecycles per second in total, watch
closes every 30 s. ``soak`` runs the shipped ``soak`` scenario (memory mode) until ``--lifecycles`` pods
have been created and deleted (default: the scenario's 1,000,000), or ``--duration`` if given. Each prints the
lab's verdict and one JSON line: ``lifecycles``, ``lifecycles_per_s``, ``max_filter_drift`` (most IPs
leaked or missing at one sample), ``agent_rss_growth_mib`` / ``operator_rss_growth_mib`` (RSS after every
pod is gone and the settle time, minus RSS at the start), ``delete_to_unmapped_p99_ms`` (from a running
pod's delete answered by the API server to its IP absent from the pinned map, polled every 5 ms; eBPF
only), ``passed``. ``scenarios`` runs each shipped scenario but ``soak`` as it is (eBPF as root) and prints
one JSON line per scenario with the same figures plus the traffic checks (how many were exact against the
agent's flow records, how many forced an IP reuse during a flow), the restart convergence times, transient
violations and the most observed IPs that waited for a filter slot.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from podmeter.cli.lab import print_summary
from podmeter.lab.cluster import lab_run
from podmeter.lab.report import write_report
from podmeter.lab.run import LabOptions, LabResult, LabRun
from podmeter.lab.scenario import Scenario, load_scenario, parse_scenario, shipped_scenarios


def ebpf_scenario(duration: float, rate: float) -> Scenario:
    churn_for = max(1.0, duration - 3)
    closes = max(1, int(duration // 30))
    text = f"""
name: bench-ebpf
seed: 20
datapath: ebpf
duration: {duration}
settle: 5
sample_interval: 1
node: {{pod_cidr: 10.244.0.0/22, filter_map_size: 4096, ip_reuse: oldest}}
agent: {{resync_interval: 30}}
operator: {{sweep_period: 30}}
apiserver: {{history: 50000}}
namespaces: [{{name: steady}}, {{name: jobs}}, {{name: web}}]
steps:
  - {{at: 0, do: pods, namespace: steady, count: 40}}
  - {{at: 2, do: churn, namespace: jobs, rate: {rate / 2}, duration: {churn_for}, lifetime: 1, complete: true,
      linger: 1, unique_labels: true}}
  - {{at: 2, do: churn, namespace: web, rate: {rate / 2}, duration: {churn_for}, lifetime: 2}}
  - {{at: 10, do: fault, fault: close-watches, repeat: {closes}, every: 30}}
"""
    return parse_scenario(text, "bench-ebpf")


def figures(result: LabResult, duration: float) -> dict[str, Any]:
    memory = result.memory
    latency = result.counts.get("delete_to_unmapped_ms", {})
    return {
        "run": result.scenario,
        "datapath": result.datapath,
        "duration_s": duration,
        "lifecycles": result.counts.get("lifecycles"),
        "lifecycles_per_s": round(result.counts.get("lifecycles", 0) / duration, 1),
        # Pods whose sandbox was up (Running, or finished) when their delete came: the node's real pace.
        "ran_before_delete": sum(n for phase, n in result.counts.get("deleted_in_phase", {}).items()
                                 if phase in ("Running", "Succeeded")),
        "max_filter_drift": result.counts.get("max_filter_drift"),
        "agent_rss_growth_mib": memory.get("agent", {}).get("growth_mib"),
        "operator_rss_growth_mib": memory.get("operator", {}).get("growth_mib"),
        "delete_to_unmapped_p99_ms": latency.get("p99"),
        "delete_to_unmapped_samples": latency.get("count"),
        "failures": len(result.failures),
        "passed": result.passed,
    }


def scenario_figures(result: LabResult, duration: float) -> dict[str, Any]:
    checks = [t for t in result.traffic if "skipped" not in t]
    return {
        **figures(result, duration),
        "traffic_checks": len(checks),
        "traffic_ok": sum(1 for t in checks if t.get("ok")),
        "flow_checks_exact": sum(1 for t in checks if (t.get("flow") or {}).get("ok")),
        "ip_reused_during_flow": sum(1 for t in checks if t.get("reused")),
        "agent_kills": result.counts.get("agent_kills"),
        "restart_converged_after_s": result.counts.get("restart_converged_after_s"),
        "transient_violations": result.counts.get("transient_violations"),
        "overflow_max_waiting": result.counts.get("overflow_max_waiting"),
    }


def run_scenarios(out: Path) -> None:
    for name in shipped_scenarios():
        if name == "soak":
            continue
        started = time.monotonic()
        result = lab_run(load_scenario(name), LabOptions(out / name, progress=False)).run()  # cluster: 3 nodes
        print_summary(result, write_report(result, out / name))
        print(json.dumps(scenario_figures(result, result.steps_s or time.monotonic() - started)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("mode", choices=("ebpf", "soak", "scenarios"))
    parser.add_argument("--duration", type=float, help="seconds (default: ebpf 600, soak the scenario's)")
    parser.add_argument("--lifecycles", type=int, help="soak: end after this many lifecycles")
    parser.add_argument("--rate", type=float, default=20.0, help="ebpf: lifecycles per second")
    parser.add_argument("--out", type=Path, help="report directory (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix=f"podmeter-bench-{args.mode}-"))
    if args.mode == "scenarios":
        run_scenarios(out)
        return
    scenario = ebpf_scenario(args.duration or 600.0, args.rate) if args.mode == "ebpf" else load_scenario("soak")
    options = LabOptions(out, progress=False, duration=args.duration if args.mode == "soak" else None,
                         lifecycles=args.lifecycles)
    started = time.monotonic()
    result = LabRun(scenario, options).run()
    elapsed = time.monotonic() - started
    print_summary(result, write_report(result, out))
    print(json.dumps(figures(result, result.steps_s or elapsed)))


if __name__ == "__main__":
    main()
