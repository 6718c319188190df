"""Test-only faults planted in a real agent process, to show that the lab's checks can fail.

``drop-deletes``: the agent ignores every pod DELETE its watch delivers (the pod stays in its store, so
its IP stays in the kernel filter): the failure mode of prior-art items 1, 2 and 7. Relists still work,
as in the agents that had this bug; the lab's scenario for it avoids relists.

The fault is installed by ``python -m podmeter.cli.lab --faulty-agent KIND agent ...`` before the agent
starts; the product itself has no switch for it.
"""

from __future__ import annotations

from typing import Final

from podmeter.runtime.writer import Writer

FAULTS: Final = ("drop-deletes",)


def install(kind: str) -> None:
    if kind not in FAULTS:
        raise ValueError(f"unknown agent fault {kind!r} (known: {', '.join(FAULTS)})")

    def drop_delete(self: Writer, uid: str) -> bool:
        return False

    Writer.delete_pod = drop_delete  # type: ignore[method-assign]
