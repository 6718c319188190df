"""The node's bpffs step (``adapters.node_bpffs``, ``podmeter bpffs``): reading mountinfo, and the errors that
name what to do. The mount itself, in a node's mount namespace, runs in tests/deploy/test_deploy_agent.py
(the ``mount-bpffs`` component's init container on a node whose mounts are private)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from podmeter.adapters.node_bpffs import BpffsError, Mount, ensure_bpffs, mount_holding, parse_mountinfo

# /proc/1/mountinfo of a node: systemd's shared mounts, a private one, a space escaped in a mount point,
# a path mounted twice (the later mount hides the earlier).
MOUNTINFO = """\
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 27 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
45 23 0:40 / /sys/fs/bpf rw,nosuid,nodev,noexec,relatime shared:7 master:3 - bpf bpf rw,mode=700
60 27 0:50 / /mnt/with\\040space rw,relatime - tmpfs tmpfs rw
61 27 0:51 / /var/lib/x rw,relatime - tmpfs tmpfs rw
62 61 0:52 / /var/lib/x rw,relatime - bpf bpf rw
not a mountinfo line
"""


def test_mountinfo_lines_give_their_mount_point_and_type() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts == [Mount("/", "ext4"), Mount("/sys", "sysfs"), Mount("/sys/fs/bpf", "bpf"),
                      Mount("/mnt/with space", "tmpfs"), Mount("/var/lib/x", "tmpfs"), Mount("/var/lib/x", "bpf")]


@pytest.mark.parametrize(("path", "holding"), [
    ("/sys/fs/bpf", Mount("/sys/fs/bpf", "bpf")),
    ("/sys/fs/bpf/podmeter/", Mount("/sys/fs/bpf", "bpf")),   # inside it
    ("/sys/fs/bpfx", Mount("/sys", "sysfs")),                 # a longer name is not inside it
    ("/sys/fs/../fs/bpf", Mount("/sys/fs/bpf", "bpf")),
    ("/var/lib/x/y", Mount("/var/lib/x", "bpf")),             # the later of two mounts on one point
    ("/mnt/with space/a", Mount("/mnt/with space", "tmpfs")),
    ("/etc", Mount("/", "ext4")),
])
def test_the_mount_holding_a_path_is_the_last_of_the_longest_point_above_it(path: str, holding: Mount) -> None:
    assert mount_holding(path, parse_mountinfo(MOUNTINFO)) == holding


def test_a_node_without_its_proc_is_named(tmp_path: Path) -> None:
    with pytest.raises(BpffsError, match=r"cannot open PID 1 in .*: give the node's /proc .* as --host-proc"):
        ensure_bpffs("/sys/fs/bpf", str(tmp_path))
    with pytest.raises(BpffsError, match="must be an absolute path"):
        ensure_bpffs("sys/fs/bpf", "/proc")


def test_the_command_exits_1_with_the_reason(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "podmeter", "bpffs", "--host-proc", str(tmp_path),
                             "--log-format", "json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and "give the node's /proc" in record["msg"]
