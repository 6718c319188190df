"""`podmeter inspect` reads the pins from a separate process while the owner keeps running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bpf_support import needs_root
from podmeter.adapters.datapath.ebpf import EbpfDatapath
from podmeter.adapters.datapath.ebpf import frames as f

pytestmark = needs_root

Opener = Callable[..., EbpfDatapath]


def inspect(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "podmeter", "inspect", *args],
        capture_output=True,
        check=False,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_inspect_prints_filter_and_counters(open_datapath: Opener, pin_dir: Path) -> None:
    dp = open_datapath(32)
    dp.insert(["10.70.0.2", "fd00:70::1", "10.70.0.10"])
    assert dp.programs is not None
    leaving = f.udp_frame("10.70.0.2", "192.0.2.1", size=58)
    dp.programs.from_pod.test_run(leaving, repeat=3)

    table = inspect("filter", "--bpffs", str(pin_dir))
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines() == ["filter: 3 of 32 entries", "10.70.0.2", "10.70.0.10", "fd00:70::1"]

    as_json = json.loads(inspect("filter", "--json", env={"PODMETER_BPFFS": str(pin_dir)}).stdout)
    assert as_json == {"capacity": 32, "entries": 3, "ips": ["10.70.0.2", "10.70.0.10", "fd00:70::1"]}

    counters = json.loads(inspect("counters", "--bpffs", str(pin_dir), "--json").stdout)
    assert counters == [{"ip": "10.70.0.2", "direction": "egress", "packets": 3, "bytes": 3 * len(leaving)}]
    rows = inspect("counters", "--bpffs", str(pin_dir)).stdout.splitlines()
    assert rows[0].split() == ["IP", "DIRECTION", "PACKETS", "BYTES"]
    assert rows[1].split() == ["10.70.0.2", "egress", "3", str(3 * len(leaving))]


def test_inspect_without_pins_fails_with_a_reason(pin_dir: Path) -> None:
    result = inspect("filter", "--bpffs", str(pin_dir))
    assert result.returncode == 1
    assert "no pinned maps there" in result.stderr
