"""Pinned TCX links: how the counting programs stay attached while no agent runs.

A TCX link is a BPF link held by file descriptors; it detaches when the last one closes, unless the link
is pinned in a bpffs, which holds it as the pinned maps are held. The attach manager pins each link it
creates as ``<dir>/<ifindex>_<ingress|egress>`` and a successor adopts the pin instead of creating a new
link: the hook never goes without a program, so nothing goes uncounted between two agents.

A pin is adopted only when the kernel still reports it as a TCX link on that interface and hook: a link
whose interface was deleted is defunct (the kernel reports ifindex 0), and an interface index the kernel
gave to a new interface meanwhile never matches such a link. Adopting replaces the link's program by the
successor's in place (``bpf_link_update``, atomic: no packet sees no program). Pins are written under a
staging name and renamed, so a crash leaves a whole pin or none.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from pathlib import Path

from podmeter.adapters.datapath.ebpf.libbpf import BPF_TCX_INGRESS, BpfCallError, libbpf

log = logging.getLogger("podmeter.attach")

BPF_LINK_TYPE_TCX = 11
DIR_MODE = 0o700
PIN_MODE = 0o600
_STAGING = "__swap"  # bpffs refuses names containing a dot


class _LinkInfo(ctypes.Structure):
    """The head of ``struct bpf_link_info`` with the ``tcx`` member of its union (which starts at 16)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
    ]


class _ProgInfo(ctypes.Structure):
    """The head of ``struct bpf_prog_info``: its type and id."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32)]


def _info(fd: int, info: ctypes.Structure) -> None:
    size = ctypes.c_uint32(ctypes.sizeof(info))
    libbpf().call("bpf_obj_get_info_by_fd", fd, ctypes.byref(info), ctypes.byref(size))


def link_info(fd: int) -> tuple[int, int, int, int]:
    """(link type, program id, ifindex, attach type) of a link fd."""
    info = _LinkInfo()
    _info(fd, info)
    return info.type, info.prog_id, info.ifindex, info.attach_type


def program_id(fd: int) -> int:
    info = _ProgInfo()
    _info(fd, info)
    return int(info.id)


def pin_name(ifindex: int, hook: int) -> str:
    return f"{ifindex}_{'ingress' if hook == BPF_TCX_INGRESS else 'egress'}"


class LinkPins:
    """A directory of pinned TCX links (inside the agent's pin directory, which its lock guards)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def ensure(self) -> None:
        self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.path, DIR_MODE)

    def names(self) -> set[str]:
        if not self.path.is_dir():
            return set()
        return {entry.name for entry in self.path.iterdir()}

    def adopt(self, ifindex: int, hook: int, program_fd: int) -> int | None:
        """The fd of the link pinned for this interface and hook, now running ``program_fd``; None when
        there is none to adopt (a pin that is not such a link is removed)."""
        path = self.path / pin_name(ifindex, hook)
        try:
            fd = libbpf().call("bpf_obj_get", str(path).encode())
        except BpfCallError:
            return None  # no pin (ENOENT), or nothing a link can be made of: a new link is created
        try:
            kind, prog_id, pinned_ifindex, attach_type = link_info(fd)
            if (kind, pinned_ifindex, attach_type) != (BPF_LINK_TYPE_TCX, ifindex, hook):
                log.info("pinned link %s is not on ifindex %d any more: removed", path.name, ifindex)
                os.close(fd)
                self._unlink(path.name)
                return None
            if prog_id != program_id(program_fd):  # the predecessor's program: run ours instead
                libbpf().call("bpf_link_update", fd, program_fd, None)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def pin(self, fd: int, ifindex: int, hook: int) -> None:
        """Pin a new link (atomically replacing whatever the name held)."""
        name = pin_name(ifindex, hook)
        staging = self.path / f"{name}{_STAGING}"
        self._unlink(staging.name)
        libbpf().call("bpf_obj_pin", fd, str(staging).encode())
        os.chmod(staging, PIN_MODE)
        os.rename(staging, self.path / name)

    def unpin(self, ifindex: int, hook: int) -> None:
        """Forget the link of this interface and hook: it detaches once its last fd closes too."""
        self._unlink(pin_name(ifindex, hook))

    def prune(self, keep: set[str]) -> list[str]:
        """Unpin every link but ``keep`` (those nobody wants any more detach); their names."""
        removed = sorted(self.names() - keep)
        for name in removed:
            self._unlink(name)
        return removed

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / name).unlink()
