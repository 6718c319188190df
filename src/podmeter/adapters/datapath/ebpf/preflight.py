"""Checks run before touching the kernel, so that a missing prerequisite is named, not guessed at.

Each check raises the matching :class:`~.errors.DatapathSetupError` with what to do about it.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from podmeter.adapters.datapath.ebpf.errors import (
    BpffsNotMounted,
    KernelTooOld,
    NotPrivileged,
    ObjectMissing,
)

# Oldest kernel with everything the datapath uses: hash batch operations, and
# lookup-and-delete on per-CPU hashes (5.14). TCX (6.6) is optional: older kernels use clsact.
MIN_KERNEL = (5, 15)
TCX_KERNEL = (6, 6)

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_BPF = 39

OBJECT_NAME = "podmeter.bpf.o"
BARE_OBJECT_NAME = "podmeter_bare.bpf.o"  # parse only: the benchmarks' baseline
NOFLOWS_OBJECT_NAME = "podmeter_noflows.bpf.o"  # counting without flows: the flows benchmark's reference


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of the running kernel, from ``uname -r`` (``6.18.44-xyz`` -> (6, 18))."""
    text = release if release is not None else os.uname().release
    parts = text.split("-", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as error:
        raise KernelTooOld(f"cannot parse the kernel release {text!r}") from error


def check_kernel(release: str | None = None) -> tuple[int, int]:
    version = kernel_version(release)
    if version < MIN_KERNEL:
        raise KernelTooOld(
            f"kernel {version[0]}.{version[1]} is too old for podmeter's eBPF datapath "
            f"(needs {MIN_KERNEL[0]}.{MIN_KERNEL[1]} or later); use --datapath memory on this machine"
        )
    return version


def effective_capabilities(status: str | None = None) -> int:
    """The CapEff bit mask of this process (from /proc/self/status)."""
    text = status if status is not None else Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges(caps: int | None = None) -> None:
    mask = effective_capabilities() if caps is None else caps
    bpf = mask & (1 << CAP_BPF) or mask & (1 << CAP_SYS_ADMIN)
    net = mask & (1 << CAP_NET_ADMIN)
    if not (bpf and net):
        raise NotPrivileged(
            "podmeter's eBPF datapath needs CAP_BPF (or CAP_SYS_ADMIN) and CAP_NET_ADMIN: run it as root, "
            "or use --datapath memory"
        )


def filesystem_of(path: str, mountinfo: str | None = None) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding ``path`` (which may not exist yet)."""
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    target = os.path.realpath(path)
    best = ("", "")
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        point = _unescape(fields[4])
        fstype = fields[fields.index("-") + 1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):  # later mounts over the same point win
            best = (point, fstype)
    return best


def check_bpffs(path: str, mountinfo: str | None = None) -> None:
    point, fstype = filesystem_of(path, mountinfo)
    if fstype != "bpf":
        raise BpffsNotMounted(
            f"{path} is not on a bpf filesystem (it is on {fstype or 'nothing'} at {point or '?'}): "
            "mount it with `mount -t bpf bpf /sys/fs/bpf`, or pass --bpffs a directory inside a bpffs"
        )


def object_path(name: str = OBJECT_NAME) -> Path:
    """The compiled BPF object shipped as package data (``podmeter/bpf/``)."""
    path = Path(str(resources.files("podmeter"))) / "bpf" / name
    if not path.is_file():
        raise ObjectMissing(f"BPF object {path} is missing: build it with `make bpf` (needs clang)")
    return path


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field
