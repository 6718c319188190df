"""The ``podmeter`` command: every long option also from ``PODMETER_<NAME>``; the demo runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from podmeter.cli.main import build_parser


def test_env_gives_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PODMETER_NODE_NAME", "from-env")
    monkeypatch.setenv("PODMETER_FILTER_MAP_SIZE", "1024")
    monkeypatch.setenv("PODMETER_DEBUG_REMOTE", "true")
    args = build_parser().parse_args(["agent"])
    assert (args.node_name, args.filter_map_size, args.debug_remote) == ("from-env", 1024, True)
    assert build_parser().parse_args(["agent", "--node-name", "flag"]).node_name == "flag"


def test_repeatable_options_take_a_comma_list_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PODMETER_NODE_NAME", "n")
    monkeypatch.setenv("PODMETER_INTERFACE", "eth1, eth2")
    assert build_parser().parse_args(["agent"]).interface == ["eth1", "eth2"]
    both = build_parser().parse_args(["agent", "--interface", "eth3"])
    assert both.interface == ["eth1", "eth2", "eth3"]  # argparse appends flags to the env's list


def test_demo_prints_what_it_did() -> None:
    result = subprocess.run([sys.executable, "-m", "podmeter", "demo"], capture_output=True, text=True,
                            timeout=60, check=True)
    assert "filter: (empty)" in result.stdout
    assert "resync removed ['10.9.9.9']" in result.stdout
