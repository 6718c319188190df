"""``podmeter lab [SCENARIO]``: run a scenario on this machine and write a report (see docs/lab.md).

Also, for tests only: ``python -m podmeter.cli.lab --faulty-agent KIND agent ARGS...`` runs a real agent
with a planted fault (:mod:`podmeter.lab.faults`), to show that the lab's checks fail when they should.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from podmeter.lab.scenario import ScenarioError, load_scenario, shipped_scenarios


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "lab", help="run a lab scenario (API server, node, agent, operator) and write a report",
        description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("scenario", nargs="?", default="default",
                   help=f"a scenario file, or a shipped one: {', '.join(shipped_scenarios())} (default: default)")
    p.add_argument("--out", type=Path, default=Path("lab-report"), help="report directory (default ./lab-report)")
    p.add_argument("--datapath", choices=("ebpf", "memory"), help="override the scenario's datapath")
    p.add_argument("--duration", type=float, help="override the scenario's duration (seconds)")
    p.add_argument("--lifecycles", type=_positive_int,
                   help="end the steps once this many pods were created and deleted (or at the duration)")
    p.add_argument("--no-progress", action="store_true", help="no live display")
    p.add_argument("--no-service-proxy", dest="service_proxy", action="store_false",
                   help="the lab's nodes leave Services to a real kube-proxy (default: they rewrite ClusterIPs "
                        "and NodePorts to backends as kube-proxy's nftables mode does)")
    p.add_argument("--hubble", action=argparse.BooleanOptionalAction, default=None,
                   help="each agent also serves Hubble's Observer API on a loopback port of its own, and the lab "
                        "prints the hubble observe command (default: the scenario's agent.hubble, off)")
    p.add_argument("--kubeconfig", type=Path, metavar="FILE",
                   help="run the scenario's nodes, agents and operator against this existing API server instead of "
                        "the embedded one; what it creates there is removed at the end (docs/lab.md)")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def run(args: argparse.Namespace) -> int:
    # Imported here: matplotlib and the runner would slow every other `podmeter` command's start.
    from podmeter.lab.cluster import lab_run
    from podmeter.lab.report import write_report
    from podmeter.lab.run import LabOptions

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"podmeter lab: {exc}", file=sys.stderr)
        return 2
    if (args.datapath or scenario.datapath) == "ebpf" and (missing := ebpf_lab_missing()):
        print(f"podmeter lab: {missing}", file=sys.stderr)
        return 2
    try:
        options = LabOptions(args.out, args.datapath, not args.no_progress, args.duration, args.lifecycles,
                             kubeconfig=args.kubeconfig, hubble=args.hubble, service_proxy=args.service_proxy)
        lab = lab_run(scenario, options)  # several nodes, or an existing API server: lab.cluster
    except RuntimeError as exc:
        print(f"podmeter lab: {exc}", file=sys.stderr)
        return 2
    for note in lab.result.notes:
        print(f"notice: {note}")
    # Ctrl-C and SIGTERM unwind the run at its next pause, so every namespace, veth, pin and process of the
    # run is removed; a second one raises at once.
    handler = _interrupt_handler(lab)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a run that seems stuck: kill -USR1 prints where
    try:
        result = lab.run()
    except KeyboardInterrupt:
        result = None
    if result is None or lab.interrupted.is_set():  # interrupted in the teardown: it ran to its end
        print("podmeter lab: interrupted; the run removed what it had created", file=sys.stderr)
        return 130
    files = write_report(result, args.out)
    print_summary(result, files)
    return 0 if result.passed else 1


def ebpf_lab_missing(caps: int | None = None, euid: int | None = None, mountinfo: str | None = None) -> str | None:
    """Why this process cannot run the eBPF lab, with what to do, or None. The lab makes network namespaces
    and veths (CAP_SYS_ADMIN, CAP_NET_ADMIN), loads and pins BPF programs (CAP_BPF or CAP_SYS_ADMIN, a bpf
    filesystem at /sys/fs/bpf) and its pin directory belongs to root."""
    from podmeter.adapters.datapath.ebpf import preflight
    from podmeter.adapters.datapath.ebpf.errors import BpffsNotMounted

    mask = preflight.effective_capabilities() if caps is None else caps
    wanted = (("CAP_SYS_ADMIN", preflight.CAP_SYS_ADMIN), ("CAP_NET_ADMIN", preflight.CAP_NET_ADMIN))
    problems = []
    if (os.geteuid() if euid is None else euid) != 0:
        problems.append("this process is not root")
    if lacking := [name for name, bit in wanted if not mask & (1 << bit)]:
        problems.append(f"it lacks {' and '.join(lacking)}")
    try:
        preflight.check_bpffs("/sys/fs/bpf", mountinfo)
    except BpffsNotMounted:
        problems.append("no bpf filesystem is mounted at /sys/fs/bpf")
    if not problems:
        return None
    return ("--datapath ebpf makes network namespaces and veths and loads BPF programs, so it needs root with "
            f"CAP_SYS_ADMIN and CAP_NET_ADMIN and bpffs at /sys/fs/bpf, but {'; '.join(problems)}. Run it as root "
            "(sudo, or a privileged container), mount bpffs with `mount -t bpf bpf /sys/fs/bpf`, or use "
            "--datapath memory (no kernel, no root)")


def _interrupt_handler(lab: Any) -> Callable[[int, FrameType | None], None]:
    def interrupt(signum: int, frame: FrameType | None) -> None:
        if lab.interrupted.is_set():
            raise KeyboardInterrupt  # the second: now, wherever the run is
        lab.interrupt()
    return interrupt


def _pair(value: Any) -> str:
    """(packets, bytes) as people read it; a list of them (one per holder of a reused IP) in order."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]:,} pkts {value[1]:,} B"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        return " then ".join(_pair(v) for v in value)
    return str(value)


def failed_check_text(check: dict[str, Any], most: int = 3) -> str:
    """One failed traffic check as a line: what was sent where, and why it failed (the counters, the first
    problems of its flow check); the report has it all."""
    kind = check.get("kind") or check.get("protocol", "?")
    head = f"{kind} {check.get('src') or check.get('client', '-')} -> {check.get('dst') or check.get('service', '-')}"
    why: list[str] = []
    if check.get("problem"):
        why.append(str(check["problem"]))
    if "expected" in check and not isinstance(check["expected"], dict):
        counted = ", ".join(f"{name} {_pair(check[name])}" for name in ("src_egress", "dst_ingress") if name in check)
        why.append(f"expected {_pair(check['expected'])}" + (f", counted {counted}" if counted else ""))
    if "delivered" in check:
        why.append(f"delivered {check['delivered']:,}")
    problems = list(check.get("problems") or (check.get("flow") or {}).get("problems") or [])  # a step's own
    why += problems[:most] + ([f"{len(problems) - most} more problems in the report"] if len(problems) > most else [])
    return f"{head}: {'; '.join(why) if why else 'failed (see the report)'}"


def failed_checks(result: Any) -> list[str]:
    """Each failed traffic check of a run, as :func:`failed_check_text` says it."""
    return [failed_check_text(check) for check in result.traffic if not check.get("ok", True)]


def print_summary(result: Any, files: list[Path]) -> None:
    """The verdict, every failure, and where the report is (also bench.lab's output)."""
    print()
    print(f"verdict: {'PASSED' if result.passed else 'FAILED'} ({result.scenario}, {result.datapath})")
    if result.error:
        print(f"error: {result.error}")
    for node in getattr(result, "nodes", None) or []:  # a multi-node run: one line per node
        memory = node.get("memory") or {}
        print(f"  node {node['name']}: pod CIDR {node['pod_cidr']}, up to {node['peaks'].get('pods', 0)} pods and "
              f"{node['peaks'].get('endpoints', 0)} cluster endpoints, agent started {node['agent_starts']}x, "
              f"RSS {memory.get('growth_mib', '-')} MiB, {node['failures']} failures")
    for failure in result.failures:
        where = f" [{failure['node']}]" if failure.get("node") else ""
        print(f"  {failure['invariant']}{where} {failure['subject']}: {failure['detail']}")
    for line in failed_checks(result):
        print(f"  traffic {line}")
    for name, memory in result.memory.items():
        if isinstance(memory, dict) and not memory["returned"]:
            print(f"  memory: {name} grew {memory['growth_mib']} MiB (tolerance {result.memory['tolerance_mib']})")
    print(f"report: {files[-1]} (also {', '.join(str(f.name) for f in files[:-1])})")


def _faulty_agent(argv: list[str]) -> int:
    from podmeter.cli.main import main
    from podmeter.lab.faults import install

    install(argv[0])
    return main(argv[1:])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--faulty-agent":
        sys.exit(_faulty_agent(sys.argv[2:]))
    sys.exit(2)
