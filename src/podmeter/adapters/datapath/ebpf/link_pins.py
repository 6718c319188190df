"""Pinned links: how the counting programs (TCX) and the drop tracer (BTF tracepoints) stay attached while
no agent runs.

A TCX link is a BPF link held by file descriptors; it detaches when the last one closes, unless the link
is pinned in a bpffs, which holds it as the pinned maps are held. The attach manager pins each link it
creates as ``<dir>/<ifindex>_<ingress|egress>`` and a successor adopts the pin instead of creating a new
link: the hook never goes without a program, so nothing goes uncounted between two agents.

A pin is adopted only when the kernel still reports it as a TCX link on that interface and hook: a link
whose interface was deleted is defunct (the kernel reports ifindex 0), and an interface index the kernel
gave to a new interface meanwhile never matches such a link. Adopting replaces the link's program by the
successor's in place (``bpf_link_update``, atomic: no packet sees no program). Pins are written under a
staging name and renamed, so a crash leaves a whole pin or none.

The drop tracer's links (:class:`TracingPins`, ``<pin dir>/drops/links/<hook>``) cannot take another
program in place: a successor adopts one only if it runs the very program the successor would attach
(:class:`ProgramIdentity`: name, instructions, maps), and replaces it otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from dataclasses import dataclass
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


# --- pinned tracing links (the drop and TCP health programs) -------------------------------------------------

BPF_LINK_TYPE_RAW_TRACEPOINT = 1  # what bpf_raw_tracepoint_open makes, for a tp_btf program too
_TP_NAME_BYTES = 128


class _RawTracepointLinkInfo(ctypes.Structure):
    """The head of ``struct bpf_link_info`` with the ``raw_tracepoint`` member of its union (at 16)."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("prog_id", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("tp_name", ctypes.c_uint64),  # in: a buffer for the name; the kernel writes it there
        ("tp_name_len", ctypes.c_uint32),
        ("_pad2", ctypes.c_uint32),
    ]


_MAX_MAP_IDS = 16


class _ProgramInfo(ctypes.Structure):
    """``struct bpf_prog_info`` up to ``name``: its id, tag (a hash of its instructions with the map
    references left out, so two loads of one object have one tag), the maps it uses, its name."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),  # in: a buffer of nr_map_ids ids
        ("name", ctypes.c_char * 16),
    ]


@dataclass(frozen=True)
class ProgramIdentity:
    """What makes a loaded program the same as another: its name, its instructions (the tag) and the
    maps it reads and writes (by kernel id). Two loads of one object against the same maps are equal."""

    id: int
    name: str
    tag: bytes
    map_ids: frozenset[int]

    def same_program(self, other: ProgramIdentity) -> bool:
        return (self.name, self.tag, self.map_ids) == (other.name, other.tag, other.map_ids)


def program_identity(fd: int) -> ProgramIdentity:
    info = _ProgramInfo()
    ids = (ctypes.c_uint32 * _MAX_MAP_IDS)()
    info.nr_map_ids = _MAX_MAP_IDS
    info.map_ids = ctypes.addressof(ids)
    _info(fd, info)
    count = min(int(info.nr_map_ids), _MAX_MAP_IDS)
    return ProgramIdentity(int(info.id), info.name.decode(errors="replace"), bytes(info.tag),
                           frozenset(int(ids[i]) for i in range(count)))


def tracepoint_link_info(fd: int) -> tuple[int, int, str]:
    """(link type, program id, tracepoint name: '' unless a raw tracepoint link) of a link fd."""
    name = ctypes.create_string_buffer(_TP_NAME_BYTES)
    info = _RawTracepointLinkInfo()
    info.tp_name, info.tp_name_len = ctypes.addressof(name), _TP_NAME_BYTES
    _info(fd, info)
    tracepoint = name.value.decode(errors="replace") if info.type == BPF_LINK_TYPE_RAW_TRACEPOINT else ""
    return int(info.type), int(info.prog_id), tracepoint


@dataclass
class PinnedTracing:
    """A tracing link found pinned for a hook, and what it runs: ``program`` is the identity of the
    program pinned beside it when the link runs that one (None: it cannot be told what it runs)."""

    link_fd: int
    tracepoint: str
    program: ProgramIdentity | None
    program_fd: int = -1

    def close(self) -> None:
        for fd in (self.link_fd, self.program_fd):
            if fd >= 0:
                os.close(fd)
        self.link_fd = self.program_fd = -1


class TracingPins:
    """Pinned tracing links, ``<dir>/links/<hook>``, and the program each runs, ``<dir>/programs/<hook>``.

    A tracing link (a BTF tracepoint's) detaches when its last fd closes, unless pinned; its program
    cannot be replaced in place (no ``bpf_link_update`` for these links), so a successor either adopts
    a link as it is, when it runs the very program the successor would attach (same name, same
    instructions, same maps: :class:`ProgramIdentity`), or replaces it. The program is pinned beside its
    link because telling what a link runs needs the program's fd, and getting one by id takes
    CAP_SYS_ADMIN, which the agent has not. Pins are written under a staging name and renamed (mode
    0600, directories 0700), so a crash leaves a whole pin or none; staging names are removed on start.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.links = self.path / "links"
        self.programs = self.path / "programs"

    def ensure(self) -> None:
        for path in (self.path, self.links, self.programs):
            path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            os.chmod(path, DIR_MODE)

    def hooks(self) -> set[str]:
        """The hooks with a link or a program pinned."""
        return {entry.name for folder in (self.links, self.programs) if folder.is_dir()
                for entry in folder.iterdir() if not entry.name.endswith(_STAGING)}

    def remove_leftovers(self) -> list[str]:
        """Staging pins a crash left between pin and rename."""
        removed = []
        for folder in (self.links, self.programs):
            if folder.is_dir():
                for entry in folder.iterdir():
                    if entry.name.endswith(_STAGING):
                        entry.unlink()
                        removed.append(f"{folder.name}/{entry.name}")
        return removed

    def find(self, hook: str) -> PinnedTracing | None:
        """The link pinned for ``hook``; None when there is none. A pin that is not a tracing link is
        removed (with the program pinned beside it)."""
        try:
            link_fd = libbpf().call("bpf_obj_get", str(self.links / hook).encode())
        except BpfCallError:
            if (self.programs / hook).exists():
                self._unlink(self.programs / hook)
            return None
        try:
            kind, prog_id, tracepoint = tracepoint_link_info(link_fd)
        except BaseException:
            os.close(link_fd)
            raise
        if kind != BPF_LINK_TYPE_RAW_TRACEPOINT:
            log.warning("pinned %s is not a tracing link (link type %d): removed", self.links / hook, kind)
            os.close(link_fd)
            self.unpin(hook)
            return None
        found = PinnedTracing(link_fd, tracepoint, None)
        try:
            program_fd = libbpf().call("bpf_obj_get", str(self.programs / hook).encode())
        except BpfCallError:
            return found  # no program pinned beside it: what it runs cannot be told
        try:
            identity = program_identity(program_fd)
        except BaseException:
            os.close(program_fd)
            found.close()
            raise
        if identity.id != prog_id:
            os.close(program_fd)
            return found
        found.program, found.program_fd = identity, program_fd
        return found

    def pin(self, hook: str, link_fd: int, program_fd: int) -> None:
        """Pin a new link and its program (each atomically replacing what the name held: the link it
        replaces detaches once its last fd closes)."""
        self._pin(self.programs / hook, program_fd)
        self._pin(self.links / hook, link_fd)

    def unpin(self, hook: str) -> None:
        self._unlink(self.links / hook)
        self._unlink(self.programs / hook)

    def prune(self, keep: set[str]) -> list[str]:
        """Unpin the links (and programs) of every hook but ``keep``; their names."""
        removed = sorted(self.hooks() - keep)
        for hook in removed:
            self.unpin(hook)
        return removed

    def _pin(self, path: Path, fd: int) -> None:
        staging = path.with_name(f"{path.name}{_STAGING}")
        self._unlink(staging)
        libbpf().call("bpf_obj_pin", fd, str(staging).encode())
        os.chmod(staging, PIN_MODE)
        os.rename(staging, path)

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
