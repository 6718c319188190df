"""What the lab report says about a run besides its checks: where and with what it ran, and when the
faults happened.

:class:`RunInfo` is the run's metadata (podmeter's version and commit, the kernel, the date, the duration,
the seed, the scenario, the datapath mode, where the logs are). A :class:`Mark` is a moment of the
timeline the report draws on its time plots: a fault step, an agent SIGKILL (and when its successor was
ready), a span during which the checks were held, the end of the steps.
"""

from __future__ import annotations

import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from podmeter import version as podmeter_version
from podmeter.lab import scenario as sc

# Steps that are the scenario's ordinary life (pods come and go, interest changes, traffic): not marked.
# Every other kind is a fault of some sort (the API server's knobs, a compaction gap, and whatever kind a
# scenario gains later, such as drop-inducing steps) and is marked where it started. The agent's SIGKILL
# is marked by the run itself, with the moment its successor was ready.
ORDINARY_STEPS = frozenset({"pods", "delete", "churn", "annotate", "unobserve-delete", "configure", "traffic",
                            "reuse-during-flow", "kill-agent"})

FAULT = "fault"  # a fault step started (until: when it ended, when known)
AGENT_KILL = "agent-kill"  # the agent was SIGKILLed (until: its successor was ready)
HELD = "held"  # the checks were held (a deliberate outage: violations do not age)
TEARDOWN = "teardown"  # the steps ended: every pod is deleted, then the run settles


@dataclass
class Mark:
    """A moment of the run, in seconds since the steps started (the time plots' x axis)."""

    t: float
    kind: str  # FAULT, AGENT_KILL, HELD or TEARDOWN
    label: str  # a few words for the plot ("close-watches", "agent SIGKILL")
    until: float | None = None  # the end of a span (the agent ready again, the hold released)


@dataclass
class RunInfo:
    scenario: str
    description: str
    seed: int
    datapath: str  # the mode the run used: ebpf or memory
    podmeter_version: str
    commit: str | None  # None: not known (not a git checkout, no COMMIT file)
    kernel: str  # the running kernel's release (uname -r)
    host: str
    python: str
    started: str  # ISO 8601, local time with its UTC offset
    started_unix: float
    planned_s: float  # the scenario's duration (or the --duration override)
    settle_s: float
    sample_interval_s: float
    operator: bool  # the operator ran (I4 checked)
    log_dir: str  # <out>/logs: one <process>.log per process
    duration_s: float | None = None  # the whole run: start-up, steps, teardown and settling


def collect(scenario: sc.Scenario, datapath: str, out: Path, planned_s: float) -> RunInfo:
    return RunInfo(scenario=scenario.name, description=scenario.description, seed=scenario.seed,
                   datapath=datapath, podmeter_version=podmeter_version.version(),
                   commit=podmeter_version.commit(), kernel=platform.release(), host=socket.gethostname(),
                   python=platform.python_version(),
                   started=time.strftime("%Y-%m-%d %H:%M:%S %z"), started_unix=round(time.time(), 3),
                   planned_s=planned_s, settle_s=scenario.settle, sample_interval_s=scenario.sample_interval,
                   operator=scenario.operator.enabled, log_dir=str(out / "logs"))


def step_tag(step: sc.Step) -> str:
    return str(step.__struct_config__.tag)


def is_marked(step: sc.Step) -> bool:
    return step_tag(step) not in ORDINARY_STEPS


def step_label(step: sc.Step) -> str:
    """A few words for a fault step: ``close-watches``, ``stall 2 s``, ``fail 500 (3 requests), 2 times every 1 s``."""
    if isinstance(step, sc.Fault):
        label: str = step.fault
        if step.fault in ("stall", "restart"):
            label += f" {step.seconds:g} s"
        elif step.fault == "fail":
            label += f" {step.code} ({step.count} {step.verb or ''} requests)".replace("  ", " ")
        if step.repeat > 1:
            label += f", {step.repeat} times every {step.every:g} s"
        return label
    if isinstance(step, sc.CompactionGap):
        return "compaction gap"
    return step_tag(step)
