"""podmeter's kernel datapath: TC programs counting per-pod traffic, pinned maps, attach manager.

Public API (see docs/datapath.md):
* :class:`EbpfDatapath` — the ``Datapath`` over the pinned ``filter`` and ``counters`` maps, and the
  ``FlowSource`` over ``flows`` and ``flows_lost``; ``EbpfDatapath.open(bpffs, filter_size, flow_size=...)``
  for the agent, ``EbpfDatapath.open_pinned(bpffs)`` for readers;
* :class:`AttachManager` — keeps the programs attached to the host side of every pod veth (with
  :attr:`LinkSelection.PODS`, only links that carry this node's pods' IPs);
* :class:`DatapathSetupError` and subclasses — why the datapath cannot run, with what to do.
"""

from podmeter.adapters.datapath.ebpf.attach import AttachManager, AttachMode, InterfaceRule, LinkSelection
from podmeter.adapters.datapath.ebpf.datapath import (
    DEFAULT_FILTER_SIZE,
    DEFAULT_FLOW_SIZE,
    EbpfDatapath,
    Programs,
)
from podmeter.adapters.datapath.ebpf.errors import (
    AttachError,
    BpffsNotMounted,
    DatapathSetupError,
    KernelTooOld,
    LibbpfMissing,
    LoadFailed,
    NotPrivileged,
    ObjectMissing,
    PinDirBusy,
    PinMismatch,
)
from podmeter.adapters.datapath.ebpf.pins import DEFAULT_BPFFS

__all__ = [
    "DEFAULT_BPFFS",
    "DEFAULT_FILTER_SIZE",
    "DEFAULT_FLOW_SIZE",
    "AttachError",
    "AttachManager",
    "AttachMode",
    "BpffsNotMounted",
    "DatapathSetupError",
    "EbpfDatapath",
    "InterfaceRule",
    "KernelTooOld",
    "LibbpfMissing",
    "LinkSelection",
    "LoadFailed",
    "NotPrivileged",
    "ObjectMissing",
    "PinDirBusy",
    "PinMismatch",
    "Programs",
]
