"""What reading the node's socket table costs at a scrape: parsing 100,000 lines of ``/proc/net/tcp``
(podmeter.model.node_stats.parse_sockets) and, as a reference in the same run, splitting the same text
into fields and nothing else (the least any parser of it does).

Run: ``.venv/bin/python -m bench.node_stats [--lines N] [--rounds R]``: medians of R interleaved
rounds. The lines are the kernel's format, with 1,000
distinct remote addresses (each converted once) and the states of a busy node. Prints one line per figure;
the last line is one JSON object: ``{"lines", "parse_ms", "split_ms", "ratio"}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from podmeter.model.node_stats import parse_sockets

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def table(lines: int) -> str:
    """``lines`` sockets as /proc/net/tcp writes them."""
    rows = [f"{i:4}: 0100A8C0:{8000 + i % 1000:04X} {i % 1000:04X}000A:{i % 60000:04X} {(1, 6, 1, 10)[i % 4]:02X} "
            f"00000000:00000000 00:00000000 00000000     0        0 {100000 + i} 1 0000000000000000 20 4 30 10 -1"
            for i in range(lines)]
    return HEADER + "\n".join(rows) + "\n"


def median_ms(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each figure's median over ``rounds``, the runs interleaved (the machine is noisy)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1000 for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    text = table(args.lines)
    parsed = parse_sockets(text)
    assert parsed.sockets == args.lines and parsed.errors == 0
    figures = median_ms({"parse": lambda: parse_sockets(text),
                         "split": lambda: [line.split() for line in text.splitlines()]}, args.rounds)
    parse_ms, split_ms = figures["parse"], figures["split"]
    print(f"parse_sockets, {args.lines} lines: {parse_ms:.1f} ms ({len(text) / 1e6:.1f} MB of text)")
    print(f"reference, splitting the lines only: {split_ms:.1f} ms")
    print(json.dumps({"lines": args.lines, "parse_ms": round(parse_ms, 1), "split_ms": round(split_ms, 1),
                      "ratio": round(parse_ms / split_ms, 2)}))


if __name__ == "__main__":
    main()
