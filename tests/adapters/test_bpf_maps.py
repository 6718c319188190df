"""The pinned maps through EbpfDatapath: batches with partial counts, full filter, resize, pins, ownership."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bpf_support import BPFFS, needs_root, remove_pin_dir, run, unique
from core_harness import Core
from factories import make_pod
from podmeter.adapters.datapath.ebpf import (
    EbpfDatapath,
    PinDirBusy,
    PinMismatch,
    layout,
)
from podmeter.adapters.datapath.ebpf import frames as f
from podmeter.adapters.datapath.ebpf.libbpf import BPF_MAP_TYPE_HASH
from podmeter.adapters.datapath.ebpf.maps import BpfMap
from podmeter.adapters.datapath.memory import MemoryDatapath
from podmeter.model.datapath import DatapathError, Direction, FilterFull, Traffic

pytestmark = needs_root

Opener = Callable[..., EbpfDatapath]


def ips(count: int, start: int = 0) -> list[str]:
    """Distinct pod IPs, alternating IPv4 and IPv6."""
    out = []
    for n in range(start, start + count):
        if n % 2:
            out.append(str(ipaddress.IPv6Address(f"fd00:77::{n:x}")))
        else:
            out.append(str(ipaddress.IPv4Address(0x0A4D0000 + n)))
    return out


def test_insert_delete_contents_round_trip(open_datapath: Opener) -> None:
    dp = open_datapath(16)
    wanted = ips(10)
    assert dp.insert(wanted).applied == 10
    assert dp.insert(wanted[:3]).error is None  # inserting again is a no-op, as in memory
    assert dp.contents() == set(wanted)
    assert dp.delete(wanted[:4]).applied == 4
    assert dp.contents() == set(wanted[4:])


def test_full_trie_stops_the_batch_with_filter_full_and_an_exact_count(open_datapath: Opener) -> None:
    dp = open_datapath(8)
    batch = ips(11)
    result = dp.insert(batch)
    assert result.applied == 8
    assert isinstance(result.error, FilterFull)
    assert result.error.errno_name == "ENOSPC"
    assert dp.contents() == set(batch[:8])  # the applied prefix, nothing half-written
    assert _counter_ips(dp) == set(batch[:8])  # no counters left for the IPs the filter did not take
    assert dp.delete(batch[:2]).error is None
    assert dp.insert(batch[8:]).applied == 2  # two slots freed: two of the three fit
    assert dp.contents() == set(batch[2:10])


def test_element_wise_fallback_has_the_batch_semantics(open_datapath: Opener) -> None:
    """What kernels without batch writes get: same counts, same errors (E2BIG: the filter is a hash)."""
    dp = open_datapath(4)
    keys = [layout.filter_key(ip) for ip in ips(6)]
    outcome = dp.filter_map.update_each(keys, [layout.FILTER_VALUE] * 6)
    assert outcome.applied == 4
    assert outcome.error is not None
    assert outcome.error.errno_name == "E2BIG"
    outcome = dp.filter_map.delete_each([keys[0], keys[5], keys[1]])
    assert outcome.applied == 1
    assert outcome.error is not None
    assert outcome.error.errno_name == "ENOENT"
    assert dp.contents() == set(ips(4)[1:])


def test_delete_of_an_absent_ip_stops_the_batch_with_enoent(open_datapath: Opener) -> None:
    dp = open_datapath(16)
    present = ips(4)
    dp.insert(present)
    result = dp.delete([present[0], "10.99.99.99", present[1]])
    assert result.applied == 1
    assert isinstance(result.error, DatapathError)
    assert result.error.errno_name == "ENOENT"
    assert dp.contents() == set(present[1:])


def test_writer_accounts_for_a_partial_batch(open_datapath: Opener) -> None:
    """More desired IPs than slots: the kernel holds exactly what the writer says it installed."""
    dp = open_datapath(8)
    writer = Core(dp)
    for n, ip in enumerate(ips(12)):
        writer.upsert_pod(make_pod(f"p{n}", ips=(ip,), observe=True))
    writer.flush()
    assert len(writer.installed) == 8
    assert writer.overflow == 4
    assert dp.contents() == writer.installed
    writer.resync()
    assert dp.contents() == writer.installed
    assert sum(writer.stats.drift_repaired.values()) == 0


def test_counters_are_summed_over_cpus_and_taken_atomically(open_datapath: Opener) -> None:
    dp = open_datapath(16)
    ip = "10.77.1.1"
    dp.insert([ip])
    cpus = dp.counters_map.value_bytes // layout.COUNTER_STRIDE
    per_cpu = b"".join(layout.COUNTER_VALUE.pack(cpu + 1, 100 * (cpu + 1)) for cpu in range(cpus))
    dp.counters_map.update(layout.counter_key(ip, Direction.INGRESS), per_cpu)
    total = cpus * (cpus + 1) // 2
    assert dp.read_counters() == {(ip, Direction.INGRESS): Traffic(total, 100 * total)}
    assert dp.take_counters([ip, "10.77.1.2"]) == {(ip, Direction.INGRESS): Traffic(total, 100 * total)}
    assert dp.read_counters() == {}


def test_resize_from_255_to_1024_keeps_every_entry_and_counter(open_datapath: Opener) -> None:
    small = open_datapath(255)
    entries = ips(255)
    assert small.insert(entries).applied == 255
    assert isinstance(small.insert(ips(1, start=255)).error, FilterFull)
    assert small.programs is not None
    frame = f.udp_frame(entries[0], "192.0.2.1")
    small.programs.from_pod.test_run(frame, repeat=5)
    small.close()

    big = open_datapath(1024)
    assert big.capacity == 1024
    assert big.counters_map.shape.max_entries == 2048
    assert big.contents() == set(entries)
    assert big.read_counters() == {(entries[0], Direction.EGRESS): Traffic(5, 5 * len(frame))}
    assert big.insert(ips(769, start=255)).applied == 769
    assert isinstance(big.insert(ips(1, start=1024)).error, FilterFull)
    assert big.programs is not None
    big.programs.from_pod.test_run(frame)  # the new programs count into the migrated counters
    assert big.read_counters()[(entries[0], Direction.EGRESS)] == Traffic(6, 6 * len(frame))


def test_shrinking_keeps_what_fits(open_datapath: Opener) -> None:
    dp = open_datapath(16)
    dp.insert(ips(12))
    dp.close()
    smaller = open_datapath(8)
    assert smaller.capacity == 8
    assert len(smaller.contents()) == 8
    assert smaller.contents() <= set(ips(12))
    assert _counter_ips(smaller) == smaller.contents()  # the counters of the IPs that did not fit are gone
    assert len(smaller.counters_map.collect_keys()) == 16


def test_reopening_reuses_the_pinned_maps(open_datapath: Opener, pin_dir: Path) -> None:
    first = open_datapath(32)
    first.insert(ips(5))
    map_id = _map_id(pin_dir / "filter")
    first.close()
    second = open_datapath(32)
    assert _map_id(pin_dir / "filter") == map_id
    assert second.contents() == set(ips(5))


def test_pins_are_private(open_datapath: Opener, pin_dir: Path) -> None:
    open_datapath(8)
    assert stat.S_IMODE(os.stat(pin_dir).st_mode) == 0o700
    for name in ("filter", "counters"):
        assert stat.S_IMODE(os.stat(pin_dir / name).st_mode) == 0o600


def test_a_second_owner_is_refused_until_the_first_closes(open_datapath: Opener, pin_dir: Path) -> None:
    first = open_datapath(8)
    with pytest.raises(PinDirBusy, match="owns"):
        EbpfDatapath.open(pin_dir, filter_size=8)
    reader = EbpfDatapath.open_pinned(pin_dir)  # readers never take ownership
    reader.close()
    first.close()
    open_datapath(8)


def test_a_pin_with_another_layout_is_refused_with_the_fix(open_datapath: Opener, pin_dir: Path) -> None:
    pin_dir.mkdir(mode=0o700)
    run("bpftool", "map", "create", str(pin_dir / "filter"), "type", "hash", "key", "4", "value", "4",
        "entries", "8", "name", "filter")
    with pytest.raises(PinMismatch, match=r"rm .*filter"):
        open_datapath(8)


def test_a_swap_interrupted_by_a_crash_is_cleaned_up(open_datapath: Opener, pin_dir: Path) -> None:
    open_datapath(8).close()
    leftover = pin_dir / "filter__swap"
    subprocess.run(["bpftool", "map", "create", str(leftover), "type", "hash", "key", "4", "value", "4",
                    "entries", "8", "name", "leftover"], check=True)
    dp = open_datapath(8)
    assert not leftover.exists()
    assert dp.capacity == 8


def _counter_ips(dp: EbpfDatapath) -> set[str]:
    return {layout.decode_counter_key(key)[0] for key in dp.counters_map.collect_keys()}


def test_insert_creates_both_counters_and_readers_see_them_from_the_first_packet(open_datapath: Opener) -> None:
    """The counters map is the counting path's filter: an IP has both entries exactly while it is in
    the filter; entries no packet reached are not reported; an unobserved IP gets none."""
    dp = open_datapath(16)
    observed, other = ips(2)
    assert dp.insert([observed]).error is None
    assert {layout.decode_counter_key(key) for key in dp.counters_map.collect_keys()} == {
        (observed, Direction.INGRESS), (observed, Direction.EGRESS)}
    assert dp.read_counters() == {}
    assert dp.take_counters([other]) == {}
    assert dp.programs is not None
    frame = f.udp_frame(observed, "192.0.2.1")
    dp.programs.from_pod.test_run(frame, repeat=3)
    dp.programs.from_pod.test_run(f.udp_frame("10.255.0.9", "192.0.2.1"))  # unobserved: no entry made
    assert dp.insert([observed]).error is None  # again: a no-op, the count is kept
    assert dp.read_counters() == {(observed, Direction.EGRESS): Traffic(3, 3 * len(frame))}
    assert dp.read_counters_of([observed]) == dp.read_counters()
    assert _counter_ips(dp) == {observed}
    assert dp.delete([observed]).error is None
    assert dp.take_counters([observed]) == {(observed, Direction.EGRESS): Traffic(3, 3 * len(frame))}
    assert dp.counters_map.collect_keys() == []
    dp.programs.from_pod.test_run(frame)  # gone from the filter and its counters taken: not counted
    assert dp.counters_map.collect_keys() == []


def test_the_owners_start_repairs_the_counters_invariant(open_datapath: Opener) -> None:
    """What a crash or an older agent left: an IP without counters gets them, counters of an IP outside
    the filter go."""
    dp = open_datapath(16)
    kept, orphan = ips(2)
    dp.insert([kept, orphan])
    dp.counters_map.delete(layout.counter_key(kept, Direction.INGRESS))  # an older program's lazy entries
    dp.filter_map.delete(layout.filter_key(orphan))  # a writer killed between its two removal steps
    dp.close()
    again = open_datapath(16)
    assert {layout.decode_counter_key(key) for key in again.counters_map.collect_keys()} == {
        (kept, Direction.INGRESS), (kept, Direction.EGRESS)}


def test_an_lpm_trie_filter_of_an_older_release_migrates_to_the_hash(open_datapath: Opener, pin_dir: Path) -> None:
    """Until issue 29 the filter was an LPM trie of the same keys: the new agent copies its entries into
    the hash, swaps the pin, and gives every IP its counters."""
    pin_dir.mkdir(mode=0o700)
    trie = pin_dir / "filter"
    run("bpftool", "map", "create", str(trie), "type", "lpm_trie", "key", "20", "value", "1", "entries", "16",
        "name", "filter", "flags", "1")
    old = ips(3)
    with contextlib.closing(BpfMap.open_pinned(str(trie))) as pinned:
        for ip in old:
            pinned.update(layout.filter_key(ip), layout.FILTER_VALUE)
    dp = open_datapath(16)
    assert dp.filter_map.shape.type == BPF_MAP_TYPE_HASH
    assert dp.contents() == set(old)
    assert _counter_ips(dp) == set(old)
    assert dp.programs is not None
    frame = f.udp_frame(old[0], "192.0.2.1")
    dp.programs.from_pod.test_run(frame)
    assert dp.read_counters() == {(old[0], Direction.EGRESS): Traffic(1, len(frame))}


def _map_id(pin: Path) -> int:
    out = run("bpftool", "-j", "map", "show", "pinned", str(pin))
    return int(json.loads(out)["id"])


def test_batched_reads_match_key_by_key_reads_across_chunks(open_datapath: Opener) -> None:
    """6,000 counter entries: more than one BPF_MAP_LOOKUP_BATCH chunk (4,096)."""
    dp = open_datapath(3000)
    observed = ips(3000)
    assert dp.insert(observed).error is None
    keys = [layout.counter_key(ip, direction) for ip in observed for direction in Direction]
    values = [layout.COUNTER_VALUE.pack(n, 10 * n).ljust(dp.counters_map.value_bytes, b"\0")
              for n in range(len(keys))]
    assert dp.counters_map.update_batch(keys, values).error is None
    batched = dp.counters_map.collect_items()
    assert len(batched) == 6000
    assert sorted(batched) == sorted(dp.counters_map.collect_items_one_by_one())
    counters = dp.read_counters()
    assert counters[(observed[7], Direction.EGRESS)] == Traffic(15, 150)
    assert dp.contents() == set(observed)


POOL = ips(10)


@pytest.fixture(scope="module")
def kernel_datapath() -> Iterator[EbpfDatapath]:
    """One small map for all Hypothesis examples (loading per example would dominate the run time)."""
    path = BPFFS / unique("pmhyp")
    try:
        with EbpfDatapath.open(path, filter_size=6) as datapath:
            yield datapath
    finally:
        remove_pin_dir(path)


batches = st.lists(
    st.tuples(st.sampled_from(["insert", "delete"]), st.lists(st.sampled_from(POOL), max_size=5)),
    max_size=12,
)


@settings(max_examples=80, deadline=None)
@given(batches)
def test_the_kernel_map_has_the_memory_datapaths_semantics(
    kernel_datapath: EbpfDatapath, operations: list[tuple[str, list[str]]]
) -> None:
    """Same batches, same applied counts, same errors, same contents: the writer can rely on either."""
    kernel_datapath.delete(sorted(kernel_datapath.contents()))
    memory = MemoryDatapath(capacity=6)
    for op, batch in operations:
        expected = getattr(memory, op)(batch)
        got = getattr(kernel_datapath, op)(batch)
        assert got.applied == expected.applied, (op, batch)
        assert _errno(got.error) == _errno(expected.error), (op, batch)
        assert type(got.error) is type(expected.error)
        assert kernel_datapath.contents() == memory.contents()


def _errno(error: DatapathError | None) -> str | None:
    return None if error is None else error.errno_name
