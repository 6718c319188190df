"""The one shrink rule (``model.compaction.PeakTracker``, failure mode F14 in docs/design.md).

It must say "rebuild" once a table fell to a small fraction of its peak or emptied, exactly once per
shrink (the peak restarts from what is left), and never for a table too small to matter.
"""

from __future__ import annotations

import pytest

from podmeter.model.compaction import EMPTY_PEAK, MIN_PEAK, PeakTracker

pytestmark = pytest.mark.fast  # the pure tier: make test-fast


def test_the_peak_only_grows() -> None:
    peak = PeakTracker()
    for size in (3, 10, 7, 2):
        peak.grew_to(size)
    assert peak.peak == 10


def test_a_large_table_is_rebuilt_once_when_it_falls_below_a_quarter_of_its_peak() -> None:
    peak = PeakTracker()
    peak.grew_to(4 * MIN_PEAK)
    assert not peak.should_rebuild(MIN_PEAK)  # exactly a quarter: not yet
    assert peak.should_rebuild(MIN_PEAK - 1)
    assert peak.peak == MIN_PEAK - 1  # restarted from what is left: the next call does not rebuild again
    assert not peak.should_rebuild(MIN_PEAK - 2)


def test_a_small_table_is_rebuilt_only_when_emptied() -> None:
    small = PeakTracker()
    small.grew_to(MIN_PEAK - 1)
    assert not small.should_rebuild(1)  # a few KiB: not worth a copy
    assert small.should_rebuild(0) and small.peak == 0
    tiny = PeakTracker()
    tiny.grew_to(EMPTY_PEAK)
    assert not tiny.should_rebuild(0)  # it never grew past a minimal table


def test_the_factor_is_the_owners_choice() -> None:
    peak = PeakTracker(factor=2)
    peak.grew_to(2 * MIN_PEAK)
    assert not peak.should_rebuild(MIN_PEAK) and peak.should_rebuild(MIN_PEAK - 1)
