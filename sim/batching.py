"""Experiment 13: static vs continuous batching, simulated one decode step at a time.

A step decodes one token for every request in the batch and costs t(B) seconds, B the
batch size (the measured curve of experiment 12, or the affine default below).

static      when the previous batch ends, starts the next with whatever is waiting (up to
            `slots` requests; when nothing is, with what arrives first), runs them together,
            and returns nobody before the longest member ends: a finished request keeps its
            slot, as padding, and its step cost is still t(B). The real engine's rule
            (minitransformer/serve/engine.py): it does not wait for a batch to fill.
continuous  the batch is a set of slots: a slot freed at the end of a step admits the next
            waiting request at the very next step (Orca's iteration-level scheduling).

Both take requests first come, first served. Prefill: the chapter prices its simulation at
the measured decode-step cost only, so `prefill_s` (seconds per admitted request, added to the
step that admits it and so stalling the whole batch for it) defaults to 0. TTFT is when the
first token is computed (what a streaming server could send); end-to-end latency is when the
response is returned, which for static batching is the end of its batch. The records (Result,
Run) and `metrics` are the real engine's, from minitransformer/serve/records.py.
Leaves out: memory limits on slots (experiment 14), preemption, prompt-length-dependent
prefill, and the gap between a finished step and the host noticing it.

`sweep` runs both policies over a range of Poisson arrival rates: how much continuous batching
wins depends on the load as much as on the lengths (at a low load batches are small and seldom
hold anyone back; as the load grows a request waits for the whole batch before it, and a short
one is returned with the longest), and scripts/exp13_batching_sim.py prints
where the chapter's two figures fall.

Example: outputs of 3, 1 and 2 tokens, all at t = 0, 2 slots, every step 1 s. Static runs
[0 1] for 3 steps (1 finishes after step 1 and is padded) and [2] after them; continuous gives
request 1's slot to request 2 at step 2. (first token, returned) per request:

>>> from sim.workload import Arrival
>>> arrivals = [Arrival(0, 0.0, 3), Arrival(1, 0.0, 1), Arrival(2, 0.0, 2)]
>>> for simulate in (simulate_static, simulate_continuous):
...     run = simulate(arrivals, slots=2, step_cost=lambda batch: 1.0)
...     print(run.policy, run.steps, [(r.first_token, r.returned) for r in run.results])
static 5 [(1.0, 3.0), (1.0, 3.0), (4.0, 5.0)]
continuous 3 [(1.0, 3.0), (1.0, 1.0), (2.0, 3.0)]
"""
import json
from dataclasses import astuple, dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

from minitransformer.measure.sanity import NOISE_FLOOR
from minitransformer.serve.records import Metrics, Result, Run, metrics
from sim.workload import Arrival, make_workload

# The static policy in words, for the tables that use it (the engine's rule, no batching window)
STATIC_RULE = ("static: when a batch ends, the next starts with whatever is waiting (the "
               "engine's rule; no batching window)")


@dataclass(frozen=True)
class AffineCost:
    """Default step cost t(B) = a + b * B seconds: a fixed cost (reading every weight once
    per step) plus a per-request part. a = 20 ms, b = 2.5 ms make t(16) / t(1) = 2.67 and
    16 / 2.67 = 6.0x the throughput, the chapter's measured 1 -> 16 figures (experiment 12).
    An affine cost has no knee: beyond the compute-bound point use a measured table."""
    a: float = 0.020
    b: float = 0.0025

    def __post_init__(self):
        if not (self.a >= 0 and self.b >= 0 and self.a + self.b > 0):
            raise ValueError(f"step cost a={self.a!r}, b={self.b!r}: expected a, b >= 0 and "
                             "a positive t(1)")

    def __call__(self, batch):
        return self.a + self.b * batch

    def doubts(self) -> dict:
        """Nothing measured, nothing doubted (TableCost.doubts)."""
        return {}


@dataclass(frozen=True)
class TableCost:
    """Measured step latencies per batch size, linearly interpolated in between. flagged:
    {batch size: why} for each latency the experiment that measured it doubted (experiment
    12's warnings: repeats that disagree, a larger batch cheaper), kept with the costs so that
    nothing concluded from them forgets it (``doubts``)."""
    batch_sizes: tuple
    seconds: tuple
    flagged: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.batch_sizes) == 0 or len(self.batch_sizes) != len(self.seconds):
            raise ValueError("a step-cost table needs one latency per batch size, and some")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes {self.batch_sizes}: expected increasing, >= 1")
        if not all(s > 0 for s in self.seconds):
            raise ValueError(f"step latencies {self.seconds}: expected positive seconds")
        if not set(self.flagged) <= set(self.batch_sizes):
            raise ValueError(f"flagged batch sizes {sorted(self.flagged)}: expected some of "
                             f"{self.batch_sizes}")

    def doubts(self, tolerance=NOISE_FLOOR) -> dict:
        """{batch size: why} of the costs no conclusion may rest on: those flagged where they
        were measured, and those below a smaller batch's beyond the tolerance (a larger batch
        cannot be cheaper; against the dearest smaller one, so a slow drift past several sizes
        is caught too).

        >>> TableCost((1, 4, 8), (0.010, 0.020, 0.015), {4: "B=4: repeats disagree"}).doubts()
        {4: 'flagged where measured: B=4: repeats disagree', \
8: 'B=8 15.0 ms below B=4 20.0 ms: a larger batch cannot be cheaper'}
        """
        found = {b: f"flagged where measured: {why}" for b, why in self.flagged.items()}
        pairs = list(zip(self.batch_sizes, self.seconds, strict=True))
        for i, (b1, s1) in enumerate(pairs[1:], 1):
            b0, s0 = max(pairs[:i], key=lambda pair: pair[1])     # the dearest smaller batch
            if s1 < s0 * (1 - tolerance):
                found.setdefault(b1, f"B={b1} {s1 * 1e3:.1f} ms below B={b0} {s0 * 1e3:.1f} "
                                     "ms: a larger batch cannot be cheaper")
        return dict(sorted(found.items()))

    def __call__(self, batch):
        if not self.batch_sizes[0] <= batch <= self.batch_sizes[-1]:
            raise ValueError(f"batch size {batch} is outside the measured step costs "
                             f"({self.batch_sizes[0]}..{self.batch_sizes[-1]})")
        return float(np.interp(batch, self.batch_sizes, self.seconds))

    def write_json(self, path) -> None:
        """{"seconds": {"batch size": seconds}, "flagged": {"batch size": why}}: from_json's."""
        Path(path).write_text(json.dumps({
            "seconds": {str(b): s for b, s in zip(self.batch_sizes, self.seconds, strict=True)},
            "flagged": {str(b): why for b, why in self.flagged.items()}}, indent=1))

    @classmethod
    def from_json(cls, path):
        """What write_json writes (experiment 12's --save-step-costs), or a plain JSON object
        {"batch size": seconds, ...}: costs nobody flagged."""
        try:
            table = json.loads(Path(path).read_text())
            seconds, flagged = (table["seconds"], table.get("flagged", {})) \
                if "seconds" in table else (table, {})
            pairs = sorted((int(b), float(s)) for b, s in seconds.items())
            flagged = {int(b): why for b, why in flagged.items()}
            if not all(isinstance(why, str) for why in flagged.values()):
                raise ValueError(f"flagged {flagged}: expected a reason per batch size")
            return cls(tuple(b for b, _ in pairs), tuple(s for _, s in pairs), flagged)
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"{str(path)!r}: expected a JSON object of batch size -> "
                             f"seconds ({e})") from None

    @classmethod
    def from_steps(cls, steps, slots):
        """(batch size, seconds) of real engine steps -> the median per batch size; sizes never
        seen at the ends (1, slots) take the nearest measured one's cost.

        >>> TableCost.from_steps([(2, 0.03), (2, 0.01), (2, 0.02), (4, 0.05)], slots=8)
        TableCost(batch_sizes=(1, 2, 4, 8), seconds=(0.02, 0.02, 0.05, 0.05), flagged={})
        """
        by_size: dict[int, list[float]] = {}
        for batch, seconds in steps:
            by_size.setdefault(batch, []).append(seconds)
        if not by_size:
            raise ValueError("no measured steps to build a step-cost table from")
        table = {b: float(np.median(t)) for b, t in by_size.items()}
        table.setdefault(1, table[min(table)])
        table.setdefault(slots, table[max(table)])
        return cls(tuple(sorted(table)), tuple(table[b] for b in sorted(table)))


def _check(arrivals, slots):
    if not arrivals:
        raise ValueError("no requests to simulate")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots={slots!r}: expected an integer >= 1")
    if any(a.output_len < 1 for a in arrivals):
        raise ValueError("every request must generate at least one token")
    if any(b.time < a.time for a, b in pairwise(arrivals)):
        raise ValueError("requests must be in arrival order")


def _result(a, first, ended, returned):
    """The serving record of a simulated request (no token ids: None for each token)."""
    return Result(a.id, a.time, tokens=[None] * a.output_len, status="finished",
                  first_token=first, ended=ended, returned=returned)


def simulate_static(arrivals, slots=8, step_cost=AffineCost(), prefill_s=0.0) -> Run:
    """Batches of up to `slots` requests, each formed when the previous one ends from whatever
    is waiting (the engine's rule), and held until its longest member ends."""
    _check(arrivals, slots)
    t, steps, nxt, results = 0.0, 0, 0, []
    while nxt < len(arrivals):
        t = max(t, arrivals[nxt].time)      # idle: jump to the next arrival
        batch: list[Arrival] = []
        while nxt < len(arrivals) and len(batch) < slots and arrivals[nxt].time <= t:
            batch.append(arrivals[nxt])
            nxt += 1
        step = step_cost(len(batch))   # paid by every step, finished members included
        first = t + prefill_s * len(batch) + step
        longest = max(a.output_len for a in batch)
        t = first + step * (longest - 1)
        steps += longest
        results += [_result(a, first, first + step * (a.output_len - 1), t) for a in batch]
    return Run("static", tuple(results), steps, t)


def simulate_continuous(arrivals, slots=8, step_cost=AffineCost(), prefill_s=0.0) -> Run:
    """Iteration-level scheduling: any free slot takes the next arrived request each step."""
    _check(arrivals, slots)
    t, steps, nxt = 0.0, 0, 0
    active: dict[int, int] = {}  # arrival index -> tokens produced so far
    first, done = {}, {}
    while nxt < len(arrivals) or active:
        if not active:  # idle: jump to the next arrival
            t = max(t, arrivals[nxt].time)
        admitted = 0
        while nxt < len(arrivals) and len(active) < slots and arrivals[nxt].time <= t:
            active[nxt] = 0
            nxt += 1
            admitted += 1
        t += step_cost(len(active)) + prefill_s * admitted
        steps += 1
        for i in list(active):
            active[i] += 1
            if active[i] == 1:
                first[i] = t
            if active[i] == arrivals[i].output_len:
                done[i] = t
                del active[i]  # the slot is free for the next step
    results = tuple(_result(a, first[i], done[i], done[i]) for i, a in enumerate(arrivals))
    return Run("continuous", results, steps, t)


@dataclass(frozen=True)
class SweepPoint:
    rate: float             # requests / s (inf: all at t = 0)
    load: float             # offered tokens/s over what full continuous slots can serve
    static: Metrics         # each averaged over the arrival seeds
    continuous: Metrics

    @property
    def throughput_gain(self):
        return self.continuous.throughput / self.static.throughput

    @property
    def latency_gain(self):
        return self.static.latency_mean / self.continuous.latency_mean


def capacity_rate(lengths, slots=8, step_cost=AffineCost()):
    """Requests/s that `slots` always-busy slots can serve: slots / t(slots) / mean length."""
    return slots / step_cost(slots) / float(np.mean(lengths))


def _average(ms):
    return Metrics(*(float(x) for x in np.mean([astuple(m) for m in ms], axis=0)))


def sweep(lengths, rates, slots=8, step_cost=AffineCost(), prefill_s=0.0, seeds=range(5)):
    """Both policies on the same requests at each arrival rate, averaged over arrival seeds."""
    capacity = capacity_rate(lengths, slots, step_cost)
    points = []
    for rate in rates:
        static, continuous = [], []
        for seed in seeds:
            arrivals = make_workload(lengths, rate, seed)
            static.append(metrics(simulate_static(arrivals, slots, step_cost,
                                                  prefill_s).results))
            continuous.append(metrics(simulate_continuous(arrivals, slots, step_cost,
                                                          prefill_s).results))
        points.append(SweepPoint(rate, rate / capacity, _average(static),
                                 _average(continuous)))
    return points


def first_crossing(xs, ys, target):
    """Smallest x where the piecewise-linear curve (xs, ys) reaches target; None if never."""
    for (x0, y0), (x1, y1) in pairwise(zip(xs, ys, strict=True)):
        if y0 >= target:
            return x0
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return xs[-1] if ys and ys[-1] >= target else None
