"""The measuring helpers: median time over repeats, and the allocator's peak during a call."""
import os
import tracemalloc

import numpy as np
import pytest

from minitransformer import measure
from minitransformer.backend import BACKEND
from minitransformer.measure import median_time, peak_bytes, timed


def fake_clock(*readings):
    it = iter(readings)
    return lambda: next(it)


def test_median_time_discards_warmup_and_takes_the_median():
    calls = []
    # 3 timed calls lasting 5, 1 and 3 time units; the 2 warm-up calls read no clock.
    t = median_time(lambda: calls.append(1), warmup=2, repeat=3,
                    clock=fake_clock(0, 5, 10, 11, 20, 23))
    assert len(calls) == 5
    assert (t.median, t.best, t.worst, t.repeat) == (3, 1, 5, 3)


def test_median_time_rejects_nonsense():
    with pytest.raises(ValueError, match="repeat"):
        median_time(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="warmup"):
        median_time(lambda: None, warmup=-1)


def test_timed_returns_the_result():
    assert timed(lambda: 42, clock=fake_clock(1.0, 3.5)) == (42, 2.5)


@pytest.mark.skipif(BACKEND != "numpy", reason="tracemalloc counts NumPy's allocations")
def test_peak_counts_an_array_made_and_freed_during_the_call():
    def make_and_drop():
        a = np.ones(1_000_000)  # 8,000,000 bytes, freed on return
        return float(a[0])
    peak = peak_bytes(make_and_drop)
    assert peak.result == 1.0
    assert 8_000_000 <= peak.peak_bytes < 8_000_000 + 64 * 1024  # plus a few Python objects
    assert not tracemalloc.is_tracing()  # left as it was found


@pytest.mark.skipif(BACKEND != "numpy", reason="tracemalloc counts NumPy's allocations")
def test_peak_does_not_count_what_was_allocated_before():
    resident = np.ones(2_000_000)  # the 'weights'
    peak = peak_bytes(lambda: float(resident.sum()))
    assert peak.peak_bytes < 64 * 1024


@pytest.mark.skipif(BACKEND != "numpy", reason="tracemalloc counts NumPy's allocations")
def test_peak_inside_an_outer_trace_keeps_it_running():
    tracemalloc.start()
    try:
        outer = np.ones(500_000)  # traced by the outer session, held throughout
        peak = peak_bytes(lambda: np.ones(250_000).sum())
        assert 2_000_000 <= peak.peak_bytes < 2_000_000 + 64 * 1024
        assert tracemalloc.is_tracing() and outer.size == 500_000
    finally:
        tracemalloc.stop()


@pytest.mark.skipif(BACKEND != "numpy", reason="the load note is about CPU timings")
def test_busy_note_only_when_other_processes_hold_half_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 0.0, 0.0))
    assert measure.busy_note() is None
    assert measure.machine() == "numpy on 4 CPU cores, load average 1.9 at start"
    monkeypatch.setattr(os, "getloadavg", lambda: (6.5, 0.0, 0.0))
    assert "load average 6.5 on 4 cores" in measure.busy_note()
