"""`podmeter bpffs`: make sure a bpf filesystem is mounted at the node's /sys/fs/bpf, where the agent pins.

The init container of deploy/components/mount-bpffs, for nodes that do not mount it at boot (systemd
does; other inits often do not): see docs/install.md, "What the node needs". The mount is made in the
mount namespace of the node's PID 1, found in the node's /proc (--host-proc, a hostPath in the container),
so it needs root with CAP_SYS_ADMIN, CAP_SYS_CHROOT and CAP_SYS_PTRACE: a privileged container. Where a bpf
filesystem is mounted already, nothing is done. Exit status 0 when a bpf filesystem is there (found or
mounted), 1 when it cannot be mounted (the log says why).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from podmeter.adapters.node_bpffs import BpffsError, ensure_bpffs
from podmeter.runtime.logs import setup_logging

log = logging.getLogger("podmeter.bpffs")


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bpffs", help="mount the node's bpf filesystem if it is not (the agent's init container)",
        description=__doc__)
    p.add_argument("--mount-point", default="/sys/fs/bpf", metavar="DIR",
                   help="where the node's bpf filesystem belongs: a path of the node, without symbolic links")
    p.add_argument("--host-proc", default="/proc", metavar="DIR",
                   help="the node's /proc as this process sees it; the mount is made in the mount namespace "
                        "of its PID 1")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text for people, json: one object per line (ts, level, logger, msg)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    setup_logging("info", args.log_format)
    try:
        mounted = ensure_bpffs(args.mount_point, args.host_proc)
    except BpffsError as exc:
        log.error("%s", exc)
        return 1
    if mounted:
        log.info("mounted a bpf filesystem at %s on the node", args.mount_point)
    else:
        log.info("a bpf filesystem is mounted at %s on the node already: nothing to do", args.mount_point)
    return 0
