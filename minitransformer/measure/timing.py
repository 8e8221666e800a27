"""Measuring on a noisy machine: times you can trust, and the peak bytes the allocator handed out.

Serves the measured experiments of the chapter: 1-2 (cache against recompute), 4 (memory with
and without the cache), 5-7 (prefill and decode costs), 12-13 (batched steps), 22 (speculative
runs), and the benchmarks.

Time. One run of anything is a sample of the machine's mood (other processes, frequency
scaling, first-call allocations). So ``time_together`` runs ``warmup`` untimed calls, then
``repeat`` timed ones, and keeps every sample: a ``Timing`` reports the fastest (``best``, the
least disturbed run, the one ratios are built from) and the median (which one slow outlier cannot
move). When the median sits far above the best (``spread`` above ``max_spread``) the machine was
busy while it measured, so it measures another round and pools the samples, up to ``retries``
times. Several functions are timed side by side, round after round, so a burst of load elsewhere
hits them alike and their ratio holds up. On CuPy the device is synchronized before the clock is
read: kernels are queued, not finished, when a CuPy call returns.

Threads. BLAS splits a matrix product over every core, and a thread that waits for a core another
process holds stalls the whole product: on a 2-core machine with one core busy a decode step on
2 BLAS threads can take many times as long as on 1. ``limit_threads`` fixes the count (through
threadpoolctl) and says what it set, for the table's header.

Memory. ``peak_bytes`` runs a function and reports the most bytes that were held at once by
allocations made *during* the call, above what was held when it started; what was allocated
before (the model's weights) is not counted. It asks the allocator itself, not a formula:
- NumPy reports every array's data buffer to Python's ``tracemalloc``, so the traced peak is the
  array bytes (plus the small Python objects made on the way, a few KB);
- CuPy's memory pool calls registered hooks on every malloc; the pool's ``used_bytes()`` after
  each one gives the peak of the bytes in live arrays (the pool's rounding to 512 B included,
  the pool's cached free blocks not).

Leaves out: cycle counters and CUDA events (wall clock is enough at these sizes), and the
process's resident set size, which counts pages and cannot see one array freed and another
allocated in its place.
"""
import os
import statistics
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from minitransformer.backend import BACKEND, synchronize, to_numpy
from minitransformer.generate import last_logits, last_logits_alone
from minitransformer.kernels import threads
from minitransformer.kernels.tuning import blas_pools, cpu
from minitransformer.kvcache import KVCache
from minitransformer.model import forward, head

MAX_SPREAD = 0.25   # median more than 25% above the best: the machine was busy, measure again
RETRIES = 2         # extra rounds at most, so a machine that stays busy cannot stall a script


@dataclass(frozen=True)
class Timing:
    """Every timed sample of one function, in seconds per call.

    >>> t = Timing((0.012, 0.010, 0.011, 0.030, 0.010))
    >>> t.best, t.median, t.worst, t.repeat
    (0.01, 0.011, 0.03, 5)
    >>> round(t.spread, 2)       # the median is 10% above the best: a quiet measurement
    0.1
    """
    samples: tuple
    rounds: int = 1            # 1 + how many times it was re-measured, its spread being large
    load: float | None = None  # the highest 1-minute load average seen measuring (None: unknown)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def worst(self) -> float:
        return max(self.samples)

    @property
    def repeat(self) -> int:
        return len(self.samples)

    @property
    def spread(self) -> float:
        """How far the median sits above the best, relative: the noise of this measurement."""
        return self.median / self.best - 1 if self.best > 0 else 0.0


def time_together(fns, warmup: int = 1, repeat: int = 5, after=None, max_spread=MAX_SPREAD,
                  retries=RETRIES, clock=time.perf_counter) -> list:
    """Time functions side by side -> [Timing, ...], one per function.

    Each round calls every function once, in turn (and its ``after`` callable, untimed: a
    rollback that puts the state back for the next call). ``warmup`` rounds are discarded, then
    ``repeat`` rounds are timed; while any function's spread is above ``max_spread``, ``repeat``
    more rounds are pooled in, at most ``retries`` times.

    >>> ticks = iter(range(100))                        # a fake clock: one tick per reading
    >>> [t.samples for t in time_together([lambda: None], repeat=3, clock=lambda: next(ticks))]
    [(1, 1, 1)]
    """
    if warmup < 0 or repeat < 1 or retries < 0:
        raise ValueError(f"need warmup >= 0, repeat >= 1 and retries >= 0, got warmup={warmup}, "
                         f"repeat={repeat}, retries={retries}")
    after = list(after) if after is not None else [None] * len(fns)
    if len(after) != len(fns):
        raise ValueError(f"{len(fns)} functions but {len(after)} 'after' callables")
    samples: list[list[float]] = [[] for _ in fns]

    def one_round(keep):
        for fn, undo, kept in zip(fns, after, samples, strict=True):
            seconds = timed(fn, clock)[1]
            if keep:
                kept.append(seconds)
            if undo is not None:
                undo()

    seen = load_average()
    for _ in range(warmup):
        one_round(keep=False)
    for rounds in range(1, retries + 2):
        for _ in range(repeat):
            one_round(keep=True)
        seen = max_load(seen, load_average())
        timings = [Timing(tuple(s), rounds, seen) for s in samples]
        if all(t.spread <= max_spread for t in timings):
            break
    return timings


def median_time(fn, warmup: int = 1, repeat: int = 5, clock=time.perf_counter,
                max_spread=MAX_SPREAD, retries=RETRIES, after=None) -> Timing:
    """One function timed: ``time_together([fn], ..., after=[after])[0]``."""
    return time_together([fn], warmup, repeat, [after], max_spread=max_spread, retries=retries,
                         clock=clock)[0]


def step_with_rollback(model, cache, tokens, batch_invariant=False) -> tuple:
    """A forward pass to time over and over on one cache -> (step, rollback).

    step() runs tokens (B, n) on top of what the cache holds and returns the host logits of
    the n new positions (B, n, V): n = 1 is a decode step, n > 1 a verification pass (which
    reads every position it checks). rollback() trims the n positions back off, so each call
    sees the very same cache: pass it as time_together's ``after``, which is not timed.
    batch_invariant: each row by the very call a batch of one makes (on cache.row(b)), so
    each gets exactly the bits it gets alone.
    """
    tokens = np.asarray(tokens)                                              # (B, n)
    rows = [(tokens[b:b + 1], cache.row(b)) for b in range(len(tokens))] \
        if batch_invariant else [(tokens, cache)]

    def step():
        out = [to_numpy(head(model, forward(model, ids, held))) for ids, held in rows]
        return out[0] if len(out) == 1 else np.concatenate(out)                 # (B, n, V)
    return step, lambda: cache.trim(tokens.shape[1])


def quiet(count, what=""):
    """The default progress of a long measurement: progress(count, what) -> tick(message="",
    done=1), saying nothing. A script passes its own (scripts/_common.Progress), a line on
    stderr per unit of work."""
    return lambda message="", done=1: None


def batched_steps(model, cache, tokens, contiguous=None) -> tuple:
    """One decode step of rows 0..B-1 of a paged cache (B = len(tokens)) to time over and over
    -> ([step, step batch-invariant, (step on contiguous)], [their rollbacks]) for
    time_together's fns and ``after``.

    The paged step is the engine's: room for one more token in each row's blocks, then the
    forward pass and head over cache.view(rows) (generate.last_logits), host logits (B, V)
    back; its rollback trims the token off every row, so each call sees the same cache.
    contiguous: a KVCache holding the same rows' keys and values (PagedCache.to_contiguous),
    whose step (step_with_rollback) is timed beside them: what the block table costs.
    """
    rows, tokens = list(range(len(tokens))), np.asarray(tokens).reshape(-1, 1)   # (B, 1)

    def paged(batch_invariant):     # batch-invariant: row by row, each as a batch of one
        decode = last_logits_alone if batch_invariant else last_logits

        def step():
            cache.books.make_room(rows, 1)
            return decode(model, tokens, cache.view(rows))
        return step

    def rollback():
        for b in rows:
            cache.books.trim(b, 1)
    steps, rollbacks = [paged(False), paged(True)], [rollback, rollback]
    if contiguous is not None:
        step, undo = step_with_rollback(model, contiguous, tokens)
        steps, rollbacks = steps + [step], rollbacks + [undo]
    return steps, rollbacks


def timed(fn, clock=time.perf_counter):
    """fn() -> (its result, seconds it took, device work included): one sample, for
    ``time_together`` and for progress lines, never a table's figure on its own."""
    synchronize()
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
    import cupy
    pool = cupy.get_default_memory_pool()

    class PoolPeak(cupy.cuda.MemoryHook):
        name = "minitransformer.measure.timing.PoolPeak"

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


def limit_threads(threads) -> str:
    """Fix the BLAS thread count for the rest of the process (None: leave it) -> the header's
    words for it, e.g. 'BLAS threads: 1 (openblas)'."""
    from threadpoolctl import threadpool_info, threadpool_limits
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        threadpool_limits(limits=threads, user_api="blas")
    pools = [p for p in threadpool_info() if p["user_api"] == "blas"]
    counts = sorted({p["num_threads"] for p in pools})
    names = sorted({p["internal_api"] for p in pools})
    set_by = "set" if threads is not None else "library default"
    return (f"BLAS threads: {', '.join(map(str, counts)) or '?'} "
            f"({', '.join(names) or 'no BLAS found'}, {set_by})")


def load_average():
    """The 1-minute load average (runnable processes, ours included), None where the system
    does not say."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def max_load(*loads):
    """The highest of the known loads, None when none is known."""
    known = [x for x in loads if x is not None]
    return max(known) if known else None


def machine() -> str:
    """A line saying what the timings ran on, for the table's header: a number measured on a
    machine that was busy with something else means little without it."""
    text = f"{BACKEND} on {os.cpu_count()} CPU cores"
    if BACKEND == "cupy":
        import cupy
        text = f"cupy on {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}"
    if hasattr(os, "getloadavg"):
        text += f", load average {os.getloadavg()[0]:.1f} at start"
    return text


def blas_kernel() -> str:
    """The BLAS kernel in one word, e.g. 'SkylakeX' (for a file name), or the library's name."""
    pools = blas_pools()
    if not pools:
        return "no-BLAS"
    return pools[0].get("architecture") or pools[0]["internal_api"]


def where_it_ran() -> str:
    """One line: the CPU, AVX-512 or not, and every BLAS library, version, kernel and threads.

    What a figure means depends on all of them: OpenBLAS picks a different kernel on a CPU
    without AVX-512, and its products then take other times (and sum in other orders)."""
    c = cpu()
    avx = {True: "yes", False: "no", None: "unknown"}[c["avx512"]]
    pools = [f"{p['internal_api']} {p.get('version') or '?'} "
             f"({os.path.basename(p.get('filepath', ''))}), kernel "
             f"{p.get('architecture') or '?'}, {p['num_threads']} thread"
             f"{'s' if p['num_threads'] != 1 else ''}" for p in blas_pools()]
    return (f"CPU: {c['model']} ({os.cpu_count()} cores), AVX-512: {avx}; "
            f"BLAS: {'; '.join(pools) or 'none found'}; {threads.describe()}")


def verification_costs(model, ids, largest: int, repeat: int = 5) -> dict:
    """{n: one pass over n + 1 new positions, in one-token decode steps} for n = 1..largest
    (the ratios of ``verification_timings``)."""
    times = verification_timings(model, ids, largest, repeat)
    return {n: times[n].best / times[0].best for n in range(1, largest + 1)}


def verification_timings(model, ids, largest: int, repeat: int = 5) -> list:
    """[Timing of one target pass over k new positions, k = 1..largest + 1]: k = 1 is the
    one-token decode step, k = n + 1 verifies n proposals.

    What verifying n proposals costs on this machine (the chapter's formula takes 1: on a GPU
    both passes read the weights once). Timed side by side (time_together), each pass
    on a cache holding ids[:-largest-1] and trimmed back after, the head included: verification
    reads the logits of every position it checks.
    """
    kv = KVCache.allocate(model.config, 1, len(ids))
    forward(model, np.array([ids[:-largest - 1]]), kv)
    tail = np.array([ids[-largest - 1:]])
    passes, rollbacks = zip(*(step_with_rollback(model, kv, tail[:, :k])
                              for k in range(1, largest + 2)), strict=True)
    return time_together(passes, repeat=repeat, after=rollbacks)
