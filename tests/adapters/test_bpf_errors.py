"""Each missing prerequisite is named with what to do about it (the agent refuses to start on these)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bpf_support import needs_root
from podmeter.adapters.datapath.ebpf import (
    BpffsNotMounted,
    EbpfDatapath,
    KernelTooOld,
    LibbpfMissing,
    NotPrivileged,
    ObjectMissing,
    preflight,
)
from podmeter.adapters.datapath.ebpf.libbpf import Libbpf

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:26 / /sys rw,nosuid shared:7 - sysfs sysfs rw
41 30 0:35 / /sys/fs/bpf rw,relatime shared:15 - bpf bpf rw,mode=700
50 22 0:40 / /mnt/with\\040space rw - tmpfs tmpfs rw
"""


def test_kernel_version_is_parsed_and_old_kernels_are_refused() -> None:
    assert preflight.kernel_version("6.18.44-fc-v657") == (6, 18)
    assert preflight.check_kernel("5.15.0-91-generic") == (5, 15)
    with pytest.raises(KernelTooOld, match=r"5\.4 is too old.*--datapath memory"):
        preflight.check_kernel("5.4.0-150-generic")


def test_capabilities_are_required() -> None:
    bpf, net, sys_admin = 1 << 39, 1 << 12, 1 << 21
    preflight.check_privileges(bpf | net)
    preflight.check_privileges(sys_admin | net)
    for caps in (0, bpf, net):
        with pytest.raises(NotPrivileged, match=r"CAP_BPF.*CAP_NET_ADMIN.*run it as root"):
            preflight.check_privileges(caps)
    assert preflight.effective_capabilities("Name:\tx\nCapEff:\t0000008000001000\n") == bpf | net


def test_the_filesystem_of_the_pin_directory_is_found() -> None:
    assert preflight.filesystem_of("/sys/fs/bpf/podmeter", MOUNTINFO) == ("/sys/fs/bpf", "bpf")
    assert preflight.filesystem_of("/sys/fs/bpfx", MOUNTINFO) == ("/sys", "sysfs")
    assert preflight.filesystem_of("/mnt/with space/x", MOUNTINFO) == ("/mnt/with space", "tmpfs")
    preflight.check_bpffs("/sys/fs/bpf/podmeter/deeper", MOUNTINFO)
    with pytest.raises(BpffsNotMounted, match=r"mount -t bpf bpf /sys/fs/bpf"):
        preflight.check_bpffs("/var/run/podmeter", MOUNTINFO)


def test_a_missing_object_says_make_bpf() -> None:
    with pytest.raises(ObjectMissing, match="make bpf"):
        preflight.object_path("no-such-program.bpf.o")
    assert preflight.object_path().is_file()  # the build made the real one


def test_a_missing_libbpf_says_what_to_install() -> None:
    with pytest.raises(LibbpfMissing, match="apt-get install libbpf1"):
        Libbpf("libbpf-that-does-not-exist.so.9")


@needs_root
def test_a_pin_directory_outside_bpffs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BpffsNotMounted, match="mount -t bpf"):
        EbpfDatapath.open(tmp_path / "pins", filter_size=8)
    assert not (tmp_path / "pins").exists()  # refused before creating anything


@needs_root
def test_a_process_without_capabilities_is_refused(tmp_path: Path) -> None:
    """Root's uid with an empty capability set, as in a locked-down container."""
    code = (
        "from podmeter.adapters.datapath.ebpf import EbpfDatapath, DatapathSetupError\n"
        "try:\n"
        f"    EbpfDatapath.open('/sys/fs/bpf/pm-never-{os.getpid()}', filter_size=8)\n"
        "except DatapathSetupError as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    out = subprocess.run(
        ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("NotPrivileged ")
    assert "run it as root" in out
    assert not Path(f"/sys/fs/bpf/pm-never-{os.getpid()}").exists()
