"""The machine-limit probe of memory touched again after it sat untouched (``benchmarks.idle_pages``)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import idle_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps_rollup")


@pytest.mark.parametrize("kind", ["4 KiB pages", "huge pages", "Python objects"])
def test_each_kind_is_swept_and_read_scattered_at_each_idle_time(kind: str) -> None:
    samples, huge_given = idle_pages.measure(kind, 4 << 20, [0.0, 0.01], 2)
    assert sorted(samples) == [0.0, 0.01]
    for tries in samples.values():
        assert len(tries) == 2
        for sample in tries:
            assert sample.sweep_us > 0
            assert len(sample.reads_us) == idle_pages.SCATTERED
            assert min(sample.reads_us) >= 0
    if kind == "Python objects":
        assert not huge_given
    row = idle_pages.row(samples[0.01])
    assert 0.0 <= row.slow_share <= 1.0
    assert row.read_median_us <= max(s for t in samples[0.01] for s in t.reads_us)


def test_the_machine_tables_line_names_both_measures() -> None:
    line = idle_pages.summary(mib=4, idle=0.01, repeat=1)
    assert line.startswith("after 0.01 s untouched: a scattered read ")
    assert "a sweep " in line
    assert line.endswith("(4 MiB)")
