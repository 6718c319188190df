"""Why the eBPF datapath cannot run, each with a message that says what to do about it.

The agent treats every :class:`DatapathSetupError` as fatal at start-up: it refuses to run rather than
run half-blind (an agent that cannot write the filter map or attach its programs would report nothing
while looking healthy).
"""

from __future__ import annotations


class DatapathSetupError(Exception):
    """The eBPF datapath cannot be set up. ``str(error)`` is a complete, actionable sentence."""


class NotPrivileged(DatapathSetupError):
    """The process lacks CAP_BPF / CAP_NET_ADMIN (not root)."""


class BpffsNotMounted(DatapathSetupError):
    """The pin directory is not on a bpf filesystem."""


class LibbpfMissing(DatapathSetupError):
    """``libbpf.so.1`` cannot be loaded."""


class KernelTooOld(DatapathSetupError):
    """The running kernel lacks a BPF feature podmeter needs."""


class ObjectMissing(DatapathSetupError):
    """The compiled BPF object is not installed next to the package."""


class PinMismatch(DatapathSetupError):
    """A pinned map exists with a layout this version of podmeter cannot use."""


class PinDirBusy(DatapathSetupError):
    """Another live process owns the pin directory."""


class LoadFailed(DatapathSetupError):
    """libbpf or the verifier rejected the BPF object."""


class AttachError(DatapathSetupError):
    """A program could not be attached to an interface."""
