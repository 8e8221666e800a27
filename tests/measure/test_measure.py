"""The measuring helpers: median time over repeats, and the allocator's peak during a call."""
import os
import tracemalloc

import numpy as np
import pytest

from conftest import NEAR_TIE, clock_of_durations, fake_clock
from minitransformer.backend import BACKEND
from minitransformer.kernels import tuning
from minitransformer.measure import timing as measure
from minitransformer.measure.timing import median_time, peak_bytes, time_together, timed


def test_median_time_discards_warmup_and_reports_best_and_median():
    calls = []
    # 2 warm-up calls read the clock but are not kept; 3 timed calls last 11, 10 and 12.
    t = median_time(lambda: calls.append(1), warmup=2, repeat=3,
                    clock=clock_of_durations(90, 90, 11, 10, 12))
    assert len(calls) == 5
    assert (t.median, t.best, t.worst, t.repeat, t.rounds) == (11, 10, 12, 3, 1)


def test_a_large_spread_is_measured_again_and_pooled():
    # first round: median 5 against best 1 (a busy machine); the second round is quiet
    t = median_time(lambda: None, warmup=0, repeat=3,
                    clock=clock_of_durations(1, 5, 5, 1, 1, 1))
    assert (t.samples, t.rounds, t.median, t.best) == ((1, 5, 5, 1, 1, 1), 2, 1, 1)


def test_a_machine_that_stays_busy_stops_after_the_retries():
    t = median_time(lambda: None, warmup=0, repeat=2, retries=1,
                    clock=clock_of_durations(1, 5, 1, 5))
    assert (t.rounds, t.repeat) == (2, 4) and t.spread == 2.0


def test_functions_timed_together_alternate_and_roll_back():
    order = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    undo = [lambda: order.append("undo a"), None]
    timings = time_together(fns, warmup=1, repeat=2, after=undo,
                            clock=clock_of_durations(*[1] * 6))
    assert order == ["a", "undo a", "b"] * 3
    assert [t.samples for t in timings] == [(1, 1), (1, 1)]


def test_median_time_rejects_nonsense():
    with pytest.raises(ValueError, match="repeat"):
        median_time(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="warmup"):
        median_time(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="'after'"):
        time_together([lambda: None], after=[None, None])


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


@pytest.mark.skipif(BACKEND != "numpy", reason="the load average is about CPU timings")
def test_machine_says_cores_and_load(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 0.0, 0.0))
    assert measure.machine() == "numpy on 4 CPU cores, load average 1.9 at start"


def test_limit_threads_sets_blas_and_says_so():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not [p for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]:
        pytest.skip("no BLAS library loaded")
    # Each BLAS library put back to its own count. (Not threadpool_limits(n, user_api="blas")
    # per library: that sets every BLAS library to n, and with SciPy's OpenBLAS loaded beside
    # NumPy's at another count, the last one's count won for both: seen failing in CI.)
    libraries = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.num_threads for lib in libraries]
    try:
        assert measure.limit_threads(1).startswith("BLAS threads: 1 (")
        assert {p["num_threads"] for p in threadpoolctl.threadpool_info()
                if p["user_api"] == "blas"} == {1}
    finally:
        for lib, n in zip(libraries, before, strict=True):
            lib.set_num_threads(n)
    with pytest.raises(ValueError, match="threads"):
        measure.limit_threads(0)


def test_where_it_ran_names_the_cpu_avx512_and_the_blas_kernel(monkeypatch):
    pools = [{"user_api": "blas", "internal_api": "openblas", "version": "0.3.31",
              "filepath": "/lib/libopenblas.so", "architecture": "Haswell", "num_threads": 1}]
    monkeypatch.setattr(measure, "blas_pools", lambda: pools)
    monkeypatch.setattr(measure, "cpu", lambda: {"model": "AMD EPYC 7B13", "avx512": False})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(measure.threads, "describe", lambda: "threads: 3 (MT_THREADS; ...)")
    assert measure.where_it_ran() == ("CPU: AMD EPYC 7B13 (2 cores), AVX-512: no; BLAS: "
                                      "openblas 0.3.31 (libopenblas.so), kernel Haswell, "
                                      "1 thread; threads: 3 (MT_THREADS; ...)")
    assert measure.blas_kernel() == "Haswell"
    monkeypatch.setattr(measure, "blas_pools", lambda: [])
    assert measure.blas_kernel() == "no-BLAS" and "BLAS: none found;" in measure.where_it_ran()


def test_the_cpu_is_read_from_this_machine():
    c = tuning.cpu()
    assert c["model"] and c["avx512"] in (True, False, None)
    if os.path.isfile("/proc/cpuinfo"):   # Linux on x86: the model name line, verbatim
        with open("/proc/cpuinfo") as f:
            lines = [x for x in f if x.startswith("model name")]
        if lines:
            assert c["model"] == " ".join(lines[0].split(":", 1)[1].split())


def test_batched_steps_are_one_decode_step_each_way_and_roll_back(tiny_model):
    """The paged step is the step a batch of B rows makes (its logits those of a batch of one
    per row, bit for bit in the batch-invariant way; the flat way's and the contiguous
    copy's within the project's rounding window NEAR_TIE of the largest |logit|), and each
    rollback leaves the caches as they were, so the steps can repeat."""
    from minitransformer.generate import last_logits
    from minitransformer.kvcache import KVCache
    from minitransformer.model import forward
    from minitransformer.serve.paged import PagedCache
    c, B, T = tiny_model.config, 3, 6
    prompts = np.random.default_rng(0).integers(0, c.vocab_size, (B, T))
    cache = PagedCache.allocate(c, num_blocks=B * 4, block_size=4)
    kv = KVCache.allocate(c, B, T + 1)
    for b in range(B):
        cache.books.add(b, prompts[b].tolist())
        forward(tiny_model, prompts[b:b + 1], cache.view([b]))
    forward(tiny_model, prompts, kv)
    tokens = np.array([5, 7, 11])
    steps, rollbacks = measure.batched_steps(tiny_model, cache, tokens, kv)
    alone = []
    for b in range(B):
        one = KVCache.allocate(c, 1, T + 1)
        forward(tiny_model, prompts[b:b + 1], one)
        alone.append(last_logits(tiny_model, tokens[b:b + 1, None], one)[0])
    for _ in range(2):                         # the second time round sees the same caches
        flat, exact, contiguous = [(step(), undo())[0]
                                   for step, undo in zip(steps, rollbacks, strict=True)]
        assert [cache.books.seqs[b].length for b in range(B)] == [T] * B
        assert kv.lengths.tolist() == [T] * B
        np.testing.assert_array_equal(exact, np.array(alone))
        window = NEAR_TIE * np.abs(exact).max()
        np.testing.assert_allclose(flat, exact, rtol=0, atol=window)
        np.testing.assert_allclose(contiguous[:, -1], exact, rtol=0, atol=window)
