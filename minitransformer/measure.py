"""Measuring on a noisy machine: median wall time, and the peak bytes the allocator handed out.

Serves the measured experiments of the chapter: 2 (one attention head both ways), 4 (memory
with and without the cache), 5-7 (prefill and decode costs).

Time. One run of anything is a sample of the machine's mood (other processes, frequency
scaling, first-call allocations), so ``median_time`` runs ``warmup`` untimed calls, then
``repeat`` timed ones, and reports their median, which one slow outlier cannot move. On CuPy
the device is synchronized before the clock is read: kernels are queued, not finished, when a
CuPy call returns.

Memory. ``peak_bytes`` runs a function and reports the most bytes that were held at once by
allocations made *during* the call, above what was held when it started; what was allocated
before (the model's weights) is not counted. It asks the allocator itself, not a formula:
- NumPy reports every array's data buffer to Python's ``tracemalloc``, so the traced peak is the
  array bytes (plus the small Python objects made on the way, a few KB);
- CuPy's memory pool calls registered hooks on every malloc; the pool's ``used_bytes()`` after
  each one gives the peak of the bytes in live arrays (the pool's rounding to 512 B included,
  the pool's cached free blocks not).

The machine. ``machine()`` says what the numbers ran on, for the table's header, and
``busy_note()`` says when other processes are competing for the CPU.

Leaves out: cycle counters and CUDA events (wall clock is enough at these sizes), and the
process's resident set size, which counts pages and cannot see one array freed and another
allocated in its place.
"""
import os
import statistics
import time
import tracemalloc
from dataclasses import dataclass

from minitransformer.backend import BACKEND, synchronize, xp


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``repeat`` timed calls."""
    median: float
    best: float
    worst: float
    repeat: int


def median_time(fn, warmup: int = 1, repeat: int = 5, clock=time.perf_counter) -> Timing:
    """Call fn() ``warmup`` times untimed, then ``repeat`` times timed -> Timing."""
    if warmup < 0 or repeat < 1:
        raise ValueError(f"need warmup >= 0 and repeat >= 1, got warmup={warmup}, "
                         f"repeat={repeat}")
    for _ in range(warmup):
        fn()
    synchronize()
    times = [timed(fn, clock)[1] for _ in range(repeat)]
    return Timing(statistics.median(times), min(times), max(times), repeat)


def timed(fn, clock=time.perf_counter):
    """fn() -> (its result, seconds it took, device work included)."""
    start = clock()
    result = fn()
    synchronize()
    return result, clock() - start


@dataclass(frozen=True)
class Peak:
    """The result of a call and the most bytes its allocations held at once."""
    result: object
    peak_bytes: int
    counter: str      # what counted them, for the printed table


def peak_bytes(fn) -> Peak:
    """Run fn() once and measure the peak bytes allocated during it (see the module docstring)."""
    if BACKEND == "cupy":
        return _peak_cupy(fn)
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        # Subtle: tracemalloc only sees allocations made while it traces, so 'start' is what this
        # very call has not made yet, and the weights loaded earlier are outside by construction.
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return Peak(result, int(peak), "tracemalloc peak (NumPy array data + Python objects)")


def _peak_cupy(fn) -> Peak:
    pool = xp.get_default_memory_pool()

    class PoolPeak(xp.cuda.MemoryHook):
        name = "minitransformer.measure.PoolPeak"

        def __init__(self):
            self.peak = pool.used_bytes()

        def malloc_postprocess(self, **kwargs):
            self.peak = max(self.peak, pool.used_bytes())

    synchronize()
    start = pool.used_bytes()
    hook = PoolPeak()
    with hook:
        result = fn()
        synchronize()
    return Peak(result, int(hook.peak - start), "CuPy memory pool used_bytes() peak")


def machine() -> str:
    """A line saying what the timings ran on, for the table's header: a number measured on a
    machine that was busy with something else means little without it."""
    text = f"{BACKEND} on {os.cpu_count()} CPU cores"
    if BACKEND == "cupy":
        text = f"cupy on {xp.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    if hasattr(os, "getloadavg"):
        text += f", load average {os.getloadavg()[0]:.1f} at start"
    return text


def busy_note():
    """None on a mostly idle machine; else a sentence saying why its timings will be noisy."""
    if BACKEND != "numpy" or not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores / 2:
        return None
    # The trap: BLAS splits a matrix product over every core, and a thread that waits for a core
    # another process holds stalls the whole product. On a 2-core machine with one core busy a
    # decode step was measured 20x slower with 2 BLAS threads than with 1.
    return (f"load average {load:.1f} on {cores} cores: other processes compete for the CPU and "
            "the timings will be noisy; OPENBLAS_NUM_THREADS=1 (or OMP_NUM_THREADS=1) steadies "
            "them")
