"""The pin directory: where the maps live between agent processes.

Invariants:
* the directory is mode 0700 and each pin 0600 (owner root): nobody else can read or write the maps;
* at most one live process owns the directory (an exclusive ``flock`` on it, released by the kernel
  when the owner dies, even by SIGKILL), so two agents never write the same filter;
* a pin is only ever replaced by an atomic rename, so a crash leaves either the old or the new map
  under the name, never none; leftovers of an interrupted swap (``NAME__swap``) are removed on start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from podmeter.adapters.datapath.ebpf.errors import PinDirBusy
from podmeter.adapters.datapath.ebpf.maps import BpfMap

DEFAULT_BPFFS = "/sys/fs/bpf/podmeter"
DIR_MODE = 0o700
PIN_MODE = 0o600
_SWAP_SUFFIX = "__swap"  # bpffs refuses names containing a dot


class PinDir:
    """A directory of pinned maps inside a bpffs."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock_fd = -1

    def ensure(self) -> None:
        """Create the directory (and parents) if needed and make it private."""
        self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(self.path, DIR_MODE)

    def lock(self) -> None:
        """Become the directory's only owner, or raise PinDirBusy."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PinDirBusy(
                f"another process (a running podmeter agent?) owns {self.path}; stop it first, "
                "or give this one its own --bpffs directory"
            ) from None
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the last fd releases the flock
            self._lock_fd = -1

    def pin_path(self, name: str) -> Path:
        return self.path / name

    def has(self, name: str) -> bool:
        return self.pin_path(name).exists()

    def open(self, name: str) -> BpfMap:
        return BpfMap.open_pinned(str(self.pin_path(name)))

    def install(self, bpf_map: BpfMap, name: str) -> None:
        """Pin ``bpf_map`` as ``name``, atomically replacing an existing pin of that name."""
        staging = self.path / f"{name}{_SWAP_SUFFIX}"
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        bpf_map.pin(str(staging))
        os.chmod(staging, PIN_MODE)
        os.rename(staging, self.pin_path(name))

    def unpin(self, name: str) -> None:
        """Remove the pin ``name`` (the map lives on while a program or a descriptor holds it)."""
        self.pin_path(name).unlink()

    def remove_leftovers(self) -> list[str]:
        """Delete staging pins of a swap that a crash interrupted; return their names."""
        removed = []
        for entry in self.path.iterdir():
            if entry.name.endswith(_SWAP_SUFFIX):
                entry.unlink()
                removed.append(entry.name)
        return removed

    def remove(self, names: list[str]) -> None:
        """Unpin the named maps and remove the directory if it is empty (tests, uninstall)."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self.pin_path(name).unlink()
        with contextlib.suppress(FileNotFoundError, OSError):
            self.path.rmdir()
