"""A thin ctypes binding to the system libbpf (``libbpf.so.1``): only the calls podmeter makes.

Conventions of libbpf 1.x, which every wrapper here turns into Python exceptions:
* functions returning ``int`` return ``-errno`` on failure;
* functions returning a pointer return NULL and set ``errno``. Their ``restype`` is ``c_void_p``: the
  default ``c_int`` would truncate a 64-bit pointer and the next call would crash.

Failures raise :class:`BpfCallError` (an ``OSError`` with the errno and the libbpf function's name).
libbpf's own log lines go to the ``podmeter.libbpf`` logger; the last warnings are kept so a load failure
can quote the verifier's complaint.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import logging
import os
import platform
from collections import deque
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint32, c_uint64, c_void_p
from functools import cache
from typing import Any

from podmeter.adapters.datapath.ebpf.errors import LibbpfMissing

log = logging.getLogger("podmeter.libbpf")

LIBRARY = "libbpf.so.1"

# enum bpf_attach_type values from the kernel uapi (libbpf 1.1's headers predate TCX).
BPF_TCX_INGRESS = 46
BPF_TCX_EGRESS = 47
# Link/attach flags (uapi): place the new program before all others of the hook.
BPF_F_BEFORE = 1 << 3
# enum bpf_tc_attach_point (libbpf.h)
BPF_TC_INGRESS = 1 << 0
BPF_TC_EGRESS = 1 << 1
BPF_TC_F_REPLACE = 1 << 0
# Map update flags
BPF_ANY = 0
BPF_NOEXIST = 1
# enum bpf_map_type values used here
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_PERCPU_HASH = 5
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_MAP_TYPE_LPM_TRIE = 11


class BpfCallError(OSError):
    """A libbpf call failed; ``errno`` holds the positive error number."""

    def __init__(self, function: str, err: int) -> None:
        super().__init__(err, f"{function}: {os.strerror(err)}")
        self.function = function

    @property
    def errno_name(self) -> str:
        return errno_mod.errorcode.get(self.errno or 0, str(self.errno))


class MapBatchOpts(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("elem_flags", c_uint64), ("flags", c_uint64)]


class TestRunOpts(ctypes.Structure):
    __test__ = False  # not a pytest class
    _fields_ = [
        ("sz", c_size_t),
        ("data_in", c_void_p),
        ("data_out", c_void_p),
        ("data_size_in", c_uint32),
        ("data_size_out", c_uint32),
        ("ctx_in", c_void_p),
        ("ctx_out", c_void_p),
        ("ctx_size_in", c_uint32),
        ("ctx_size_out", c_uint32),
        ("retval", c_uint32),
        ("repeat", c_int),
        ("duration", c_uint32),
        ("flags", c_uint32),
        ("cpu", c_uint32),
        ("batch_size", c_uint32),
    ]


class TcHook(ctypes.Structure):
    _fields_ = [("sz", c_size_t), ("ifindex", c_int), ("attach_point", c_int), ("parent", c_uint32)]


class TcOpts(ctypes.Structure):
    _fields_ = [
        ("sz", c_size_t),
        ("prog_fd", c_int),
        ("flags", c_uint32),
        ("prog_id", c_uint32),
        ("handle", c_uint32),
        ("priority", c_uint32),
    ]


class LinkCreateOpts(ctypes.Structure):
    """The head of ``struct bpf_link_create_opts``: ``sz`` and ``flags`` (the rest stays zero)."""

    _fields_ = [("sz", c_size_t), ("flags", c_uint32), ("_pad", c_uint32)]


class MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", c_uint32),
        ("id", c_uint32),
        ("key_size", c_uint32),
        ("value_size", c_uint32),
        ("max_entries", c_uint32),
        ("map_flags", c_uint32),
        ("name", ctypes.c_char * 16),
        ("ifindex", c_uint32),
        ("btf_vmlinux_value_type_id", c_uint32),
        ("netns_dev", c_uint64),
        ("netns_ino", c_uint64),
        ("btf_id", c_uint32),
        ("btf_key_type_id", c_uint32),
        ("btf_value_type_id", c_uint32),
        ("_pad", c_uint32),
        ("map_extra", c_uint64),
    ]


# (name, restype, argtypes). Pointer returns are c_void_p, always.
_SIGNATURES: list[tuple[str, Any, list[Any]]] = [
    ("bpf_object__open_file", c_void_p, [c_char_p, c_void_p]),
    ("bpf_object__load", c_int, [c_void_p]),
    ("bpf_object__close", None, [c_void_p]),
    ("bpf_object__find_map_by_name", c_void_p, [c_void_p, c_char_p]),
    ("bpf_object__find_program_by_name", c_void_p, [c_void_p, c_char_p]),
    ("bpf_map__set_max_entries", c_int, [c_void_p, c_uint32]),
    ("bpf_map__reuse_fd", c_int, [c_void_p, c_int]),
    ("bpf_map__fd", c_int, [c_void_p]),
    ("bpf_map__type", c_int, [c_void_p]),
    ("bpf_map__key_size", c_uint32, [c_void_p]),
    ("bpf_map__value_size", c_uint32, [c_void_p]),
    ("bpf_map__map_flags", c_uint32, [c_void_p]),
    ("bpf_map__max_entries", c_uint32, [c_void_p]),
    ("bpf_program__fd", c_int, [c_void_p]),
    ("bpf_obj_pin", c_int, [c_int, c_char_p]),
    ("bpf_obj_get", c_int, [c_char_p]),
    ("bpf_obj_get_info_by_fd", c_int, [c_int, c_void_p, POINTER(c_uint32)]),
    ("bpf_map_lookup_elem", c_int, [c_int, c_void_p, c_void_p]),
    ("bpf_map_update_elem", c_int, [c_int, c_void_p, c_void_p, c_uint64]),
    ("bpf_map_delete_elem", c_int, [c_int, c_void_p]),
    ("bpf_map_get_next_key", c_int, [c_int, c_void_p, c_void_p]),
    ("bpf_map_lookup_and_delete_elem", c_int, [c_int, c_void_p, c_void_p]),
    ("bpf_map_update_batch", c_int, [c_int, c_void_p, c_void_p, POINTER(c_uint32), POINTER(MapBatchOpts)]),
    ("bpf_map_delete_batch", c_int, [c_int, c_void_p, POINTER(c_uint32), POINTER(MapBatchOpts)]),
    (
        "bpf_map_lookup_batch",
        c_int,
        [c_int, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), POINTER(MapBatchOpts)],
    ),
    (
        "bpf_map_lookup_and_delete_batch",
        c_int,
        [c_int, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), POINTER(MapBatchOpts)],
    ),
    ("bpf_link_create", c_int, [c_int, c_int, c_int, POINTER(LinkCreateOpts)]),
    ("bpf_link_update", c_int, [c_int, c_int, c_void_p]),
    ("bpf_tc_hook_create", c_int, [POINTER(TcHook)]),
    ("bpf_tc_attach", c_int, [POINTER(TcHook), POINTER(TcOpts)]),
    ("bpf_tc_detach", c_int, [POINTER(TcHook), POINTER(TcOpts)]),
    ("bpf_prog_test_run_opts", c_int, [c_int, POINTER(TestRunOpts)]),
    ("libbpf_num_possible_cpus", c_int, []),
    ("libbpf_set_print", c_void_p, [c_void_p]),
]

# int (*libbpf_print_fn_t)(enum libbpf_print_level level, const char *, va_list ap)
_PRINT_FN = ctypes.CFUNCTYPE(c_int, c_int, c_char_p, c_void_p)
_LEVELS = {0: logging.WARNING, 1: logging.DEBUG, 2: logging.NOTSET}
# Warnings libbpf prints for outcomes podmeter expects and handles (an existing clsact qdisc).
_BENIGN = ("Exclusivity flag on, cannot modify",)
_VA_LIST_BYTES = 24  # x86-64 va_list: {u32 gp_offset; u32 fp_offset; void *overflow_arg_area, *reg_save_area}
_KEEP_CHARS = 4000  # of a longer message (a verifier log), the end is kept: that is where the verdict is


class Libbpf:
    """The loaded library. One per process (see :func:`libbpf`); every method raises BpfCallError."""

    def __init__(self, path: str = LIBRARY) -> None:
        try:
            self.lib = ctypes.CDLL(path, use_errno=True)
        except OSError as error:
            raise LibbpfMissing(
                f"cannot load {path} ({error}); install the system libbpf: apt-get install libbpf1"
            ) from error
        for name, restype, argtypes in _SIGNATURES:
            function = getattr(self.lib, name)
            function.restype = restype
            function.argtypes = argtypes
        self.recent_warnings: deque[str] = deque(maxlen=40)
        self._printer = self._install_printer()  # keep a reference: libbpf holds a raw pointer
        self.possible_cpus = self.check("libbpf_num_possible_cpus", self.lib.libbpf_num_possible_cpus())

    def check(self, function: str, ret: int) -> int:
        """Return ``ret`` if it is not a libbpf error (negative errno), else raise BpfCallError."""
        if ret < 0:
            raise BpfCallError(function, -ret)
        return ret

    def pointer(self, function: str, ret: int | None) -> int:
        """Return a non-NULL pointer result, else raise BpfCallError with the errno libbpf set."""
        if not ret:
            raise BpfCallError(function, ctypes.get_errno() or errno_mod.EINVAL)
        return ret

    def call(self, function: str, *args: Any) -> int:
        """Call an int-returning libbpf function and check it."""
        return self.check(function, getattr(self.lib, function)(*args))

    def _install_printer(self) -> Any:
        """Route libbpf's messages to logging. Formatting a va_list needs libc's vsnprintf, whose
        ABI takes va_list as a pointer only on x86-64; elsewhere libbpf keeps printing to stderr."""
        if platform.machine() != "x86_64":
            return None
        libc = ctypes.CDLL(None)
        vsnprintf = libc.vsnprintf
        vsnprintf.restype = c_int
        vsnprintf.argtypes = [c_char_p, c_size_t, c_char_p, c_void_p]

        def printer(level: int, fmt: bytes, args: int) -> int:
            saved = ctypes.string_at(args, _VA_LIST_BYTES)
            buffer = ctypes.create_string_buffer(2048)
            needed = vsnprintf(buffer, len(buffer), fmt, args)
            if needed >= len(buffer):  # format it again, whole: restoring the struct is what va_copy does
                ctypes.memmove(args, saved, _VA_LIST_BYTES)
                buffer = ctypes.create_string_buffer(needed + 1)
                vsnprintf(buffer, len(buffer), fmt, args)
            text = buffer.value.decode(errors="replace").rstrip()
            if len(text) > _KEEP_CHARS:
                text = f"[... {len(text) - _KEEP_CHARS} characters ...]\n" + text[-_KEEP_CHARS:]
            if level == 0 and any(benign in text for benign in _BENIGN):
                level = 1
            if level == 0:
                self.recent_warnings.append(text)
            if _LEVELS.get(level, logging.NOTSET) >= logging.DEBUG:
                log.log(_LEVELS[level], "%s", text)
            return 0

        callback = _PRINT_FN(printer)
        self.lib.libbpf_set_print(ctypes.cast(callback, c_void_p))
        return callback


@cache
def libbpf() -> Libbpf:
    """The process-wide library handle, loaded on first use."""
    return Libbpf()
