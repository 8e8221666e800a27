"""Experiment 13's requests: skewed output lengths with exact statistics, and their arrivals.

The chapter simulates 64 requests "with a realistic skew of output lengths: median 18 tokens,
maximum 231, 1,874 in all". `skewed_lengths` draws log-normal lengths (most answers short, a
long tail) from a seed and then bends them onto exactly those statistics:

1. sort the draws; pin the maximum and the one or two middle values (the median);
2. clip the lower half into [1, median] and the upper half into [median, maximum];
3. scale the excess over the median of the free values above it by one factor, so the total
   comes out right (values that would pass the maximum are held at it and the rest scaled
   again), then round by largest remainder, which keeps the sum exact. Only those values
   move, so a total the lower half cannot leave room for is a ValueError;
4. shuffle, so arrival order is not length order.

Arrivals: a Poisson process, i.e. exponential gaps of mean 1/rate seconds, seeded; rate=inf
means everything is already waiting at t = 0.
Leaves out: prompt lengths (the simulator charges prefill per request, see sim/batching.py).
"""
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Arrival:
    """A simulated request: when it arrives and how many tokens it will generate. (The
    engine's minitransformer.serve.records.Request also has a prompt; the simulation needs none.)"""
    id: int
    time: float        # seconds
    output_len: int    # tokens to generate


def _stretch_to_sum(excess, room, target):
    """Scale `excess` (>= 0) by one factor to sum to `target`, each capped at `room`."""
    out = np.zeros_like(excess)
    capped = np.zeros(len(excess), dtype=bool)
    while True:
        free = ~capped
        need = target - room[capped].sum()
        if excess[free].sum() == 0:
            raise ValueError("the draws leave nothing to stretch: try another seed or sigma")
        out[free] = excess[free] * (need / excess[free].sum())
        out[capped] = room[capped]
        over = free & (out > room)
        if not over.any():
            return out
        capped |= over


def skewed_lengths(n=64, median=18, max_len=231, total=1874, sigma=1.0, seed=0):
    """n positive integer lengths with exactly this median, max and sum, in random order."""
    if n < 3 or not 1 <= median <= max_len:
        raise ValueError(f"n={n}, median={median}, max_len={max_len}: need n >= 3 and "
                         "1 <= median <= max_len")
    if 2 * median != int(2 * median) or (n % 2 and median != int(median)):
        raise ValueError(f"median={median}: the median of {n} integers cannot be that")
    rng = np.random.default_rng(seed)
    draws = np.sort(rng.lognormal(math.log(median), sigma, n))
    mid = n // 2
    lower = np.clip(np.round(draws[:mid - 1 + n % 2]), 1, math.floor(median))  # below the median
    middle = [median] if n % 2 else [math.floor(median), math.ceil(median)]
    upper = np.clip(draws[mid + 1:n - 1], math.ceil(median), max_len)  # free values above it
    base = math.ceil(median)
    target = total - lower.sum() - sum(middle) - max_len - base * len(upper)
    if not 0 <= target <= (max_len - base) * len(upper):
        raise ValueError(f"total={total} cannot be reached with n={n}, median={median}, "
                         f"max_len={max_len} from these draws")
    stretched = _stretch_to_sum(upper - base, np.full(len(upper), float(max_len - base)), target)
    rounded = np.floor(stretched)
    short = int(round(target - rounded.sum()))  # units lost to flooring, given back by
    rounded[np.argsort(rounded - stretched)[:short]] += 1  # largest remainder first
    lengths = np.concatenate([lower, middle, base + rounded, [max_len]]).astype(int)
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def poisson_arrivals(n, rate, seed=0):
    """n arrival times (seconds, starting at 0) with exponential gaps of mean 1/rate."""
    if not rate > 0:
        raise ValueError(f"rate={rate!r}: an arrival rate (requests/s) must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]


def make_workload(lengths, rate=math.inf, seed=0):
    """Arrivals in time order: lengths[i] arrives at the i-th Poisson arrival time."""
    times = poisson_arrivals(len(lengths), rate, seed)
    return [Arrival(i, t, n) for i, (t, n) in enumerate(zip(times, lengths, strict=True))]
