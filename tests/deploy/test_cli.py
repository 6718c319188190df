"""The ``podmeter`` command: every long option also from ``PODMETER_<NAME>`` (a value the option refuses is a
usage error); the demo runs; ``--version``; shell completion (bash and zsh, run in the real shells); help
texts in plain text with every default; a bad ``--log-level`` is a usage error; ``lab --datapath ebpf``
without its privileges fails at once; ``apiserver`` serves HTTPS by default, and kubectl uses its
kubeconfig."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from podmeter.cli.main import build_parser
from podmeter.cli.parsing import plain, shown, shows_default, walk
from waiting import stop_process, wait_for


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


# --- --version ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
ENTRY = [sys.executable, "-m", "podmeter"]


def podmeter(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_version_names_the_package_version_and_the_commit() -> None:
    result = podmeter("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"podmeter {importlib.metadata.version('podmeter')}")
    if shutil.which("git") and (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        if head:
            assert f"(commit {head}" in result.stdout
    assert "--version" in podmeter("--help").stdout


def test_a_commit_baked_into_the_package_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image has no git: its build writes podmeter/COMMIT (the Dockerfile's PODMETER_COMMIT)."""
    from podmeter import version

    baked = tmp_path / "COMMIT"
    baked.write_text("0123456789ab\n")
    monkeypatch.setattr(version, "COMMIT_FILE", baked)
    version.commit.cache_clear()
    try:
        assert version.describe() == f"podmeter {version.version()} (commit 0123456789ab)"
        monkeypatch.setattr(version, "COMMIT_FILE", tmp_path / "absent")
        monkeypatch.setattr(version, "PACKAGE", tmp_path / "site-packages" / "podmeter")  # not a checkout
        version.commit.cache_clear()
        assert version.describe() == f"podmeter {version.version()}"
    finally:
        version.commit.cache_clear()


# --- help texts ---------------------------------------------------------------------------------------------


# What a Python repr leaves in a help text: True/False/None, a tuple or list of strings.
REPR_WORDS = re.compile(r"\b(True|False|None)\b")
REPR_SEQUENCE = re.compile(r"[(\[]\s*'[^']*'\s*[,)\]]|[(\[]\s*-?\d[\d.]*\s*,\s*-?\d[\d.]*\s*[,)\]]")
REPR_CHARS = re.compile(r"['\"()\[\]{}]")


def test_help_is_plain_text_and_shows_every_default() -> None:
    parser = build_parser()
    for each in walk(parser):
        text = each.format_help()
        assert "``" not in text, each.prog
        assert not re.search(r":(mod|class|func|meth):`", text), each.prog
        formatter = each._get_formatter()
        for action in each._actions:
            if action.help == argparse.SUPPRESS:
                continue
            where = f"{each.prog} {action.option_strings or action.dest}"
            line = formatter._expand_help(action) if action.help else ""
            assert not REPR_WORDS.search(line), f"{where}: {line!r}"
            assert not REPR_SEQUENCE.search(line), f"{where}: {line!r}"
            if shows_default(action):
                assert "default" in line, f"{where}: {line!r}"
                if "default" not in plain(action.help or "").replace(" (default: %(default)s)", "").lower():
                    _assert_default_as_typed(where, action, line)
    agent = next(p for p in walk(parser) if p.prog == "podmeter agent").format_help()
    assert "`podmeter agent`: watch this node's pods" in agent  # the docstring, markup made plain
    assert "(default: 60)" in agent  # --resync-interval: 60, not 60.0
    assert "the least severe messages logged (default: info)" in agent


def _assert_default_as_typed(where: str, action: argparse.Action, line: str) -> None:
    """The default the formatter wrote is what a person would type: no repr characters, a boolean as
    on/off, and, read back through the option's own type, the default itself (so HOST:PORT, not a tuple's
    parts joined by a comma)."""
    value = shown(action.default)
    assert line.endswith(f"(default: {value})"), f"{where}: {line!r}"
    assert not REPR_CHARS.search(value), f"{where}: default shown as {value!r}"
    if isinstance(action.default, bool):
        assert value == ("on" if action.default else "off"), f"{where}: {value!r}"
    elif callable(action.type) and not isinstance(action.default, (str, list)):
        assert action.type(value) == action.default, f"{where}: {value!r} does not read back as the default"


def test_help_shows_addresses_and_on_off_options_as_typed() -> None:
    helps = {p.prog: p.format_help() for p in walk(build_parser())}
    assert "(default: 127.0.0.1:6443)" in helps["podmeter apiserver"]
    assert "(default: on)" in helps["podmeter operator"] and "True" not in helps["podmeter operator"]
    assert (shown(("::1", 9978)), shown(True), shown(False), shown([1.0, "a"])) == ("[::1]:9978", "on", "off", "1,a")


# --- bad values: usage errors, never tracebacks --------------------------------------------------------------


@pytest.mark.parametrize("command", ["agent", "operator"])
def test_a_bad_log_level_is_a_usage_error(command: str) -> None:
    args = ["--node-name", "n"] if command == "agent" else []
    for result, names in ((podmeter(command, *args, "--log-level", "verbose"), "--log-level"),
                          (podmeter(command, *args, env={"PODMETER_LOG_LEVEL": "verbose"}), "PODMETER_LOG_LEVEL")):
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert f"usage: podmeter {command}" in result.stderr
        assert names in result.stderr and "'verbose'" in result.stderr


def test_log_levels_are_taken_in_any_case() -> None:
    assert build_parser().parse_args(["agent", "--node-name", "n", "--log-level", "WARNING"]).log_level == "warning"
    assert build_parser().parse_args(["operator", "--log-level", "Debug"]).log_level == "debug"


def test_an_environment_value_the_option_refuses_is_a_usage_error_unless_the_flag_wins(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PODMETER_FILTER_MAP_SIZE", "lots")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["agent", "--node-name", "n"])
    assert exited.value.code == 2
    assert "PODMETER_FILTER_MAP_SIZE='lots' (for --filter-map-size)" in capsys.readouterr().err
    assert build_parser().parse_args(["agent", "--node-name", "n", "--filter-map-size", "8"]).filter_map_size == 8
    monkeypatch.setenv("PODMETER_DATAPATH", "kernel")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", "--node-name", "n", "--filter-map-size", "8"])
    assert "invalid choice 'kernel'" in capsys.readouterr().err
    assert build_parser().parse_args(["operator"]).identity_backend == "memory"  # the agent's variables only


def test_on_off_options_take_their_value_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PODMETER_PUBLISH_ENDPOINTS", "false")
    assert build_parser().parse_args(["operator"]).publish_endpoints is False
    monkeypatch.setenv("PODMETER_PUBLISH_ENDPOINTS", "true")
    assert build_parser().parse_args(["operator"]).publish_endpoints is True


def test_the_operator_logs_json_like_the_agent(tmp_path: Path) -> None:
    result = podmeter("operator", "--log-format", "json", "--kubeconfig", str(tmp_path / "absent"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and record["logger"] == "podmeter.operator"
    assert "absent" in record["msg"]


@pytest.mark.parametrize("command", ["operator", "agent"])
def test_the_log_format_comes_from_the_environment(tmp_path: Path, command: str) -> None:
    """PODMETER_LOG_FORMAT=json, as the manifests set it, without the flag: the same JSON lines."""
    env = {"PODMETER_LOG_FORMAT": "json", "PODMETER_KUBECONFIG": str(tmp_path / "absent"),
           "PODMETER_NODE_NAME": "node-a"}
    result = podmeter(command, env=env)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    record = json.loads(line)
    assert record["level"] == "error" and record["logger"] == f"podmeter.{command}" and "absent" in record["msg"]
    text = podmeter(command, env={**env, "PODMETER_LOG_FORMAT": "text"})
    assert text.returncode == 2 and not text.stderr.lstrip().startswith("{")


# --- shell completion ----------------------------------------------------------------------------------------


def completion_script(shell: str, tmp_path: Path) -> Path:
    result = podmeter("completion", shell)
    assert result.returncode == 0, result.stderr
    path = tmp_path / f"podmeter.{shell}"
    path.write_text(result.stdout)
    return path


BASH_CASES = {
    "podmeter ''": "agent operator observe apiserver node lab inspect doctor demo bpffs completion",
    "podmeter ag": "agent",
    "podmeter agent --data": "--datapath",
    "podmeter agent --datapath ''": "ebpf memory",
    "podmeter agent --datapath = e": "ebpf",  # bash splits at "=" (COMP_WORDBREAKS)
    "podmeter agent --datapath=m": "--datapath=memory",  # where it does not
    "podmeter agent --node-name --datapath --log-level ''": "debug info warning error",  # --node-name's value
    "podmeter operator --identity-backend ''": "memory etcd",
    "podmeter inspect ''": "filter counters flows",
    "podmeter inspect filter --bp": "--bpffs",
    "podmeter completion ''": "bash zsh",
    "podmeter --ver": "--version",
    "podmeter agent --interface-p": "--interface-pattern",
}


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completion_completes_commands_options_and_choices(tmp_path: Path) -> None:
    script = completion_script("bash", tmp_path)
    lines = [f"source {script}",
             't() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=(); _podmeter;'
             ' echo "${COMPREPLY[*]}"; }']
    lines += [f"t {case}" for case in BASH_CASES]
    result = subprocess.run(["bash", "--norc", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    got = result.stdout.splitlines()
    assert dict(zip(BASH_CASES, got, strict=True)) == BASH_CASES
    files = subprocess.run(["bash", "--norc", "-c", f"source {script}; cd {tmp_path}; COMP_WORDS=(podmeter agent "
                            "--kubeconfig podm); COMP_CWORD=3; _podmeter; echo ${COMPREPLY[*]}"],
                           capture_output=True, text=True, timeout=30)
    assert files.stdout.split() == ["podmeter.bash"]  # a path option completes file names


ZSH_CAPTURE = r"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z "PS1='>'; autoload -Uz compinit; compinit -u -D; source $1; setopt nobeep; print READY"
zpty -r -m z line '*READY*'
zpty -w -n z "$2"$'\t'
sleep 1.5
local out="" chunk
while zpty -r -t z chunk; do out+=$chunk; done
print -r -- "$out"
zpty -d z
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_completes_commands_options_and_choices(tmp_path: Path) -> None:
    """Through a real interactive zsh (zpty): what a TAB offers or inserts."""
    script = completion_script("zsh", tmp_path)
    assert subprocess.run(["zsh", "-n", str(script)], capture_output=True).returncode == 0
    capture = tmp_path / "capture.zsh"
    capture.write_text(ZSH_CAPTURE)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}

    def tab(line: str) -> str:
        shown = subprocess.run(["zsh", str(capture), str(script), line], capture_output=True, text=True,
                               timeout=30, env=env).stdout
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown)  # without the terminal's escape sequences

    commands = tab("podmeter ")
    assert "allocate label-set identities" in commands and "print a shell completion script" in commands
    assert "--datapath=" in tab("podmeter agent --data")
    choices = tab("podmeter agent --datapath ")
    assert "ebpf" in choices and "memory" in choices
    assert "counters" in tab("podmeter inspect ")


# --- podmeter lab --datapath ebpf without what it needs -------------------------------------------------------


def test_the_ebpf_lab_says_what_it_lacks() -> None:
    from podmeter.cli.lab import ebpf_lab_missing

    bpffs = "30 25 0:27 / /sys/fs/bpf rw,nosuid - bpf bpf rw\n"
    every = (1 << 21) | (1 << 12) | (1 << 39)
    assert ebpf_lab_missing(every, 0, bpffs) is None
    unprivileged = ebpf_lab_missing(0, 1000, "")
    assert unprivileged is not None
    for part in ("not root", "CAP_SYS_ADMIN and CAP_NET_ADMIN", "no bpf filesystem", "--datapath memory"):
        assert part in unprivileged
    no_net = ebpf_lab_missing(1 << 21, 0, bpffs)
    assert no_net is not None and "lacks CAP_NET_ADMIN" in no_net


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_ebpf_lab_without_capabilities_fails_at_once(tmp_path: Path) -> None:
    drop = "-bpf,-net_admin,-sys_admin,-perfmon"
    result = subprocess.run(["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *ENTRY, "lab", "--datapath",
                             "ebpf", "--out", str(tmp_path / "report"), "--no-progress"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "FAILED" not in result.stdout
    assert "lacks CAP_SYS_ADMIN and CAP_NET_ADMIN" in result.stderr and "--datapath memory" in result.stderr
    assert not (tmp_path / "report").exists()  # nothing started, no report


# --- podmeter apiserver: HTTPS by default, so its kubeconfig works with kubectl ---------------------------------


def start_apiserver(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    kubeconfig = tmp_path / "kubeconfig"
    log = open(tmp_path / "apiserver.log", "wb")  # noqa: SIM115 (the child's)
    with log:
        proc = subprocess.Popen([*ENTRY, "apiserver", "--listen", "127.0.0.1:0", "--kubeconfig-out", str(kubeconfig),
                                 *flags], stdout=log, stderr=subprocess.STDOUT)
    wait_for(lambda: kubeconfig.exists() and "server" in kubeconfig.read_text(), 30, "the kubeconfig",
             (tmp_path / "apiserver.log").read_text)
    cluster: dict[str, Any] = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]
    return proc, cluster


@pytest.mark.skipif(shutil.which("kubectl") is None or shutil.which("openssl") is None,
                    reason="needs kubectl and openssl")
def test_the_apiserver_serves_https_by_default_and_kubectl_uses_its_kubeconfig(tmp_path: Path) -> None:
    proc, cluster = start_apiserver(tmp_path)
    try:
        assert cluster["server"].startswith("https://127.0.0.1:")
        assert (tmp_path / cluster["certificate-authority"]).is_file()  # relative to the kubeconfig's directory
        env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"), "HOME": str(tmp_path)}
        created = subprocess.run(["kubectl", "create", "namespace", "shop"], capture_output=True, text=True,
                                 env=env, timeout=30)
        assert created.returncode == 0, created.stderr
        listed = subprocess.run(["kubectl", "get", "namespaces", "-o", "name"], capture_output=True, text=True,
                                env=env, timeout=30)
        assert "namespace/shop" in listed.stdout, listed.stderr
    finally:
        stop_process(proc)


@pytest.mark.skipif(shutil.which("kubectl") is None or shutil.which("openssl") is None,
                    reason="needs kubectl and openssl")
def test_a_relative_kubeconfig_out_resolves_from_any_working_directory(tmp_path: Path) -> None:
    """The README's `make lab` writes lab-report/kubeconfig from a relative --out: the CA it names must resolve
    by the readers' rule (relative to the kubeconfig's own directory), whatever directory the reader runs in."""
    writer, reader = tmp_path / "writer", tmp_path / "elsewhere"
    writer.mkdir()
    reader.mkdir()
    log = open(tmp_path / "apiserver.log", "wb")  # noqa: SIM115 (the child's)
    with log:
        proc = subprocess.Popen([*ENTRY, "apiserver", "--listen", "127.0.0.1:0", "--kubeconfig-out",
                                 "rel/dir/kubeconfig"], stdout=log, stderr=subprocess.STDOUT, cwd=writer)
    kubeconfig = writer / "rel" / "dir" / "kubeconfig"
    try:
        wait_for(lambda: kubeconfig.exists() and "server" in kubeconfig.read_text(), 30, "the kubeconfig",
                 (tmp_path / "apiserver.log").read_text)
        ca = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["certificate-authority"]
        assert (kubeconfig.parent / ca).is_file(), ca
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
        created = subprocess.run(["kubectl", "create", "namespace", "shop"], capture_output=True, text=True,
                                 env=env, timeout=30, cwd=reader)
        assert created.returncode == 0, created.stderr
        # podmeter's own clients: the lab's (kubectl-like) one and the product's reflector transport.
        script = ("import asyncio, sys\n"
                  "from podmeter.lab.kube import KubeClient\n"
                  "from podmeter.adapters.kube.connection import load_connection\n"
                  "names = [n['metadata']['name'] for n in KubeClient.from_kubeconfig(sys.argv[1])"
                  ".list('/api/v1/namespaces')['items']]\n"
                  "async def product():\n"
                  "    transport = load_connection(sys.argv[1]).transport()\n"
                  "    try:\n"
                  "        return (await transport.get('/api/v1/namespaces/shop', {}, 10)).status\n"
                  "    finally:\n"
                  "        await transport.close()\n"
                  "print(' '.join(names), asyncio.run(product()))\n")
        relative = os.path.relpath(kubeconfig, reader)
        listed = subprocess.run([sys.executable, "-c", script, relative], capture_output=True, text=True,
                                env=env, timeout=60, cwd=reader)
        assert listed.returncode == 0, listed.stderr
        names, status = listed.stdout.split()[:-1], listed.stdout.split()[-1]
        assert "shop" in names and status == "200", listed.stdout
    finally:
        stop_process(proc)


def test_the_apiserver_serves_plain_http_only_on_request(tmp_path: Path) -> None:
    proc, cluster = start_apiserver(tmp_path, "--plain-http")
    try:
        assert cluster["server"].startswith("http://127.0.0.1:")
        assert "certificate-authority" not in cluster
    finally:
        stop_process(proc)
    both = podmeter("apiserver", "--plain-http", "--tls", "--token", "t")
    assert both.returncode == 2 and "contradict" in both.stderr
