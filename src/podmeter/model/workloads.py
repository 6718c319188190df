"""Which workload a pod belongs to, from its controller reference alone (the agent stores no ReplicaSets
or Jobs, so the second hop is read from the names their controllers give them).

* ReplicaSet ``web-5d9f7`` with the pod's ``pod-template-hash`` label ``5d9f7``: Deployment ``web``;
* Job ``backup-29300000`` (a name ending in ``-`` and eight or more digits, the scheduled time in minutes
  that the CronJob controller appends): CronJob ``backup``; any other Job is its own workload;
* StatefulSet, DaemonSet, a ReplicaSet without a Deployment's hash, any other controller: that controller;
* no controller at all: the pod is its own workload (kind ``Pod``).

Used for the per-pod series' workload labels and for both ends of every flow.
"""

from __future__ import annotations

import sys

from podmeter.model.records import Pod

_CRONJOB_SUFFIX_DIGITS = 8


def workload_of(pod: Pod) -> tuple[str, str]:
    """``(kind, name)`` of the workload ``pod`` belongs to (see the module docstring)."""
    kind, name = pod.owner_kind, pod.owner_name
    if not kind:
        return "Pod", pod.name
    if kind == "ReplicaSet":
        suffix = "-" + pod.label_dict().get("pod-template-hash", "\0")
        if name.endswith(suffix):
            return "Deployment", sys.intern(name[: -len(suffix)])
    elif kind == "Job":
        base, _, run = name.rpartition("-")
        if base and len(run) >= _CRONJOB_SUFFIX_DIGITS and run.isdigit():
            return "CronJob", sys.intern(base)
    return kind, name
