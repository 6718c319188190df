"""What reading the node's socket table costs at a scrape: parsing 100,000 lines of ``/proc/net/tcp``
(podmeter.model.node_stats.parse_sockets) and, as a reference in the same run, splitting the same text
into fields and nothing else (the least any parser of it does).

Run: ``.venv/bin/python -m bench.node_stats [--lines N]``. The lines are the kernel's format, with 1,000
distinct remote addresses (each converted once) and the states of a busy node. Prints one line per figure;
the last line is one JSON object: ``{"lines", "parse_ms", "split_ms", "ratio"}``.
"""

from __future__ import annotations

import argparse
import json
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


def best_ms(run: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    args = parser.parse_args()
    text = table(args.lines)
    parsed = parse_sockets(text)
    assert parsed.sockets == args.lines and parsed.errors == 0
    parse_ms = best_ms(lambda: parse_sockets(text))
    split_ms = best_ms(lambda: [line.split() for line in text.splitlines()])
    print(f"parse_sockets, {args.lines} lines: {parse_ms:.1f} ms ({len(text) / 1e6:.1f} MB of text)")
    print(f"reference, splitting the lines only: {split_ms:.1f} ms")
    print(json.dumps({"lines": args.lines, "parse_ms": round(parse_ms, 1), "split_ms": round(split_ms, 1),
                      "ratio": round(parse_ms / split_ms, 2)}))


if __name__ == "__main__":
    main()
