"""Entering a network namespace from one thread (Python 3.11 has no ``os.setns``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
_CURRENT = "/proc/thread-self/ns/net"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int


def enter_netns(path: str) -> None:
    """Move the calling thread (only) into the network namespace at ``path`` (e.g. /run/netns/X).

    Unlike ``ip netns exec`` this leaves the mount namespace alone, so /sys/fs/bpf stays visible.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def netns(path: str) -> Iterator[None]:
    """Run a block of the calling thread inside ``path``'s netns, then return to the previous one.

    Sockets created inside the block stay in that namespace after it ends.
    """
    home = os.open(_CURRENT, os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_netns(path)
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back: {os.strerror(err)}")
    finally:
        os.close(home)
