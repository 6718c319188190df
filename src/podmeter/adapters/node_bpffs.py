"""The node's bpf filesystem: mounted where the agent pins its maps, on a node that did not mount it at boot.

``podmeter bpffs`` runs this, as the init container of ``deploy/components/mount-bpffs``
(docs/install.md, "What the node needs"). The agent pins its maps in the node's bpffs so that they outlive
its container; systemd mounts one at ``/sys/fs/bpf`` at boot, other inits often do not.

The mount has to be made in the node's own mount namespace: one made inside a container stays there.
Mount propagation would carry it out only from a volume with ``mountPropagation: Bidirectional``, which the
container runtime grants only where the node's mount is already shared, and on a node whose mounts are
private (every mount, where init is not systemd) containerd refuses such a container just as it refuses
``HostToContainer``. So this enters the mount namespace of the node's PID 1, found in the node's ``/proc``
(a hostPath in the container), and mounts there; the agent's hostPath finds the bpffs when its container
is created. Nothing is done where a bpf filesystem is already mounted, and nothing else is changed: no
propagation, no other mount.

Opening the node's mount namespace needs CAP_SYS_PTRACE (PID 1 is another process), entering it a process
of one thread, CAP_SYS_ADMIN and CAP_SYS_CHROOT, and mounting CAP_SYS_ADMIN: the init container is
privileged. Entering it is the last thing the process does before it exits.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
from dataclasses import dataclass

BPF_FS_TYPE = "bpf"
CLONE_NEWNS = 0x00020000
# What systemd mounts /sys/fs/bpf with: nosuid, nodev, noexec, relatime, mode=700.
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_RELATIME = 0x2, 0x4, 0x8, 0x200000
MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RELATIME
MOUNT_DATA = "mode=0700"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.mount.restype = ctypes.c_int


class BpffsError(Exception):
    """The bpf filesystem is not mounted and cannot be: the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of a mountinfo file, as far as this needs it."""

    point: str
    fstype: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/PID/mountinfo`` text, in its order (a later mount over a point hides an
    earlier one). Lines that are not mountinfo lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)  # the optional fields (shared:N, master:N) end here
        mounts.append(Mount(_unescape(fields[4]), fields[separator + 1]))
    return mounts


def mount_holding(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount that holds ``path`` (an absolute path of that mount namespace, without symbolic links):
    the last one of the longest mount point that is ``path`` or one of its parents."""
    target = posixpath.normpath(path)
    best: Mount | None = None
    for mount in mounts:
        point = mount.point
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = mount
    return best


def ensure_bpffs(mount_point: str, host_proc: str = "/proc") -> bool:
    """Make sure a bpf filesystem holds ``mount_point`` in the mount namespace of PID 1 of ``host_proc``
    (the node's /proc as this process sees it); mount one there if not. Returns whether it mounted one.
    Raises :class:`BpffsError` when it cannot. On a mount, the process is in the node's mount namespace
    afterwards."""
    if not posixpath.isabs(mount_point):
        raise BpffsError(f"the mount point must be an absolute path of the node, not {mount_point!r}")
    try:
        node = os.open(posixpath.join(host_proc, "1"), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise BpffsError(f"cannot open PID 1 in {host_proc} ({exc.strerror}): give the node's /proc "
                         "(a hostPath volume) as --host-proc") from None
    try:
        if _holds_bpffs(node, mount_point):
            return False
        _enter_mount_namespace(node, host_proc)
        _mount(mount_point)
        if not _holds_bpffs(node, mount_point):
            raise BpffsError(f"mounted a bpf filesystem at {mount_point}, but the node's mountinfo does not show "
                             "it there (a symbolic link in the path?)")
        return True
    finally:
        os.close(node)


PRIVILEGES = "needs CAP_SYS_ADMIN, CAP_SYS_CHROOT and CAP_SYS_PTRACE: a privileged container"


def _holds_bpffs(node: int, mount_point: str) -> bool:
    """Whether the mountinfo of the node's PID 1 (read afresh) shows a bpf filesystem holding the point."""
    try:
        fd = os.open("mountinfo", os.O_RDONLY | os.O_CLOEXEC, dir_fd=node)
        with os.fdopen(fd, "rb") as file:
            text = file.read().decode(errors="surrogateescape")
    except OSError as exc:
        raise BpffsError(f"cannot read the mounts of the node's PID 1: {exc.strerror} ({PRIVILEGES})") from None
    holding = mount_holding(mount_point, parse_mountinfo(text))
    return holding is not None and holding.fstype == BPF_FS_TYPE


def _enter_mount_namespace(node: int, host_proc: str) -> None:
    try:
        fd = os.open("ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=node)
    except OSError as exc:
        raise BpffsError(f"cannot open the mount namespace of PID 1 of {host_proc}: {exc.strerror} "
                         f"({PRIVILEGES})") from None
    try:
        if _libc.setns(fd, CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise BpffsError(f"cannot enter the mount namespace of PID 1 of {host_proc}: {os.strerror(err)} "
                             f"({PRIVILEGES})")
    finally:
        os.close(fd)


def _mount(mount_point: str) -> None:
    if _libc.mount(b"bpf", os.fsencode(mount_point), b"bpf", MOUNT_FLAGS, MOUNT_DATA.encode()) == 0:
        return
    err = ctypes.get_errno()
    why = {
        errno.ENOENT: "the directory does not exist on the node",
        errno.ENODEV: "the kernel has no bpf filesystem (CONFIG_BPF_SYSCALL)",
        errno.EPERM: "not permitted (needs CAP_SYS_ADMIN: a privileged container)",
    }.get(err, os.strerror(err))
    raise BpffsError(f"cannot mount a bpf filesystem at {mount_point} on the node: {why}")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field
