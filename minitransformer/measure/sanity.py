"""Sanity checks on measured figures: invariants a timing cannot break unless the machine lied.

Serves the measured experiments of the chapter (2, 4, 6, 7, 12, 13, 22). A timing taken while
something else ran on the machine can come out impossible: a batch of 7 cheaper than a batch of
1, a speculative speedup above what the accepted tokens allow. Each check here takes measured
``Timing``s (minitransformer/measure/timing.py) and returns a message per row that breaks its
invariant, None or {} when all is well. The checks compare the fastest samples: a fastest sample
cannot be too fast (a clock does not run early), only too slow (every sample of that row was
disturbed), so the tolerance is the small difference two quiet runs of the same code show
(``NOISE_FLOOR``).
A wide spread is no excuse: it is the sign of a disturbed row, which is measured again.

``recheck`` is the loop every script runs around a check: measure, check, and while a check
fires measure again; a message that survives is printed beside its row.

Steady rows and conclusions. The project's test of a row is that its repeats agree: after
re-measuring (time_together's extra rounds, then ``recheck``), the median sits within
``MAX_SPREAD`` (25%) of the fastest (``unsteady`` names the rows that fail it). A line derived
from rows (a knee, a best gamma, a speedup, "the step costs 1.2x") is printed by ``conclude``
only when every row it rests on is steady and no check still fires on it; otherwise the line
says that the machine was too noisy to conclude, why, and the load average it saw. The rows
themselves are printed either way, with their warnings beside them: hiding a row would hide
the noise.

Leaves out: statistical tests (a handful of samples per row cannot carry them), and invariants
of things that are not timed (tokens, bytes), which the tests assert exactly.
"""
from minitransformer.measure.timing import MAX_SPREAD, load_average, max_load, quiet

NOISE_FLOOR = 0.10  # two runs of the same code on a quiet machine differ by up to ~10%


def cost_falls(labels, timings, what="step", tolerance=NOISE_FLOOR) -> dict:
    """Costs that must not fall as the work grows (a larger batch, a longer cache or prompt):
    {row index: message} for each row whose best time is below the previous row's beyond the
    tolerance.

    >>> from minitransformer.measure.timing import Timing
    >>> steps = [Timing((0.010,) * 3), Timing((0.012,) * 3), Timing((0.004,) * 3)]
    >>> cost_falls([1, 2, 4], steps, "batch")
    {2: 'batch 4 costs 0.33x batch 2 (4.0 vs 12.0 ms): a larger one cannot be cheaper'}
    """
    found = {}
    for i in range(1, len(timings)):
        before, now = timings[i - 1], timings[i]
        if now.best < before.best * (1 - tolerance):
            found[i] = (f"{what} {labels[i]} costs {now.best / before.best:.2f}x {what} "
                        f"{labels[i - 1]} ({now.best * 1e3:.1f} vs {before.best * 1e3:.1f} ms): "
                        "a larger one cannot be cheaper")
    return found


def slower(fast, slow, fast_name="cached", slow_name="recompute", tolerance=NOISE_FLOOR):
    """A message if the timing that must be faster (the cached one) is not, beyond the tolerance.

    >>> from minitransformer.measure.timing import Timing
    >>> slower(Timing((2.0, 2.1)), Timing((1.0, 1.0)))
    'cached takes 2.00x recompute (2000.0 vs 1000.0 ms): it does less work, it cannot be slower'
    >>> slower(Timing((1.0, 1.0)), Timing((2.0, 2.1))) is None
    True
    """
    if fast.best <= slow.best * (1 + tolerance):
        return None
    return (f"{fast_name} takes {fast.best / slow.best:.2f}x {slow_name} ({fast.best * 1e3:.1f} "
            f"vs {slow.best * 1e3:.1f} ms): it does less work, it cannot be slower")


def spikes(labels, sizes, timings, unit="token", tolerance=NOISE_FLOOR) -> dict:
    """Per-unit costs (best time / size) that stand above both neighbours beyond the tolerance: one
    disturbed row in a series that should be smooth. {row index: message}.

    >>> from minitransformer.measure.timing import Timing
    >>> runs = [Timing((0.08,) * 3), Timing((0.50,) * 3), Timing((0.30,) * 3)]
    >>> spikes([8, 16, 32], [8, 16, 32], runs)
    {1: 'P=16 costs 31.25 ms per token, 3.1x its neighbours: one disturbed measurement'}
    """
    per = [t.best / n for t, n in zip(timings, sizes, strict=True)]
    found = {}
    for i in range(1, len(per) - 1):
        around = max(per[i - 1], per[i + 1])
        if per[i] > around * (1 + tolerance):
            found[i] = (f"P={labels[i]} costs {per[i] * 1e3:.2f} ms per {unit}, "
                        f"{per[i] / around:.1f}x its neighbours: one disturbed measurement")
    return found


def per_unit_rises(labels, sizes, timings, what="batch", unit="token", tolerance=NOISE_FLOOR):
    """Work done per second that must not fall as the batch grows (one step over B rows cannot
    cost more than B / b steps over b rows: it could run them in turns): {row index: message}
    for each row whose rate (size / best time) is below the previous row's beyond the tolerance.

    >>> from minitransformer.measure.timing import Timing
    >>> found = per_unit_rises([1, 2], [1, 2], [Timing((0.0186,)), Timing((0.0417,))])
    >>> for part in found[1].split(": "): print(part)
    batch 2 makes 48.0 tokens/s, 0.89x batch 1 (53.8)
    batching cannot be slower than taking turns
    """
    rate = [n / t.best for t, n in zip(timings, sizes, strict=True)]
    found = {}
    for i in range(1, len(rate)):
        if rate[i] < rate[i - 1] / (1 + tolerance):
            found[i] = (f"{what} {labels[i]} makes {rate[i]:.1f} {unit}s/s, "
                        f"{rate[i] / rate[i - 1]:.2f}x {what} {labels[i - 1]} "
                        f"({rate[i - 1]:.1f}): batching cannot be slower than taking turns")
    return found


def unsteady(labels, timings, what="", max_spread=MAX_SPREAD, scale=1e3, unit="ms",
             fmt=".1f") -> dict:
    """Rows whose repeats disagree: the median more than ``max_spread`` above the fastest.
    {row index: message}, quoting the fastest and the median as the table prints them
    (seconds x ``scale`` in ``unit``, format ``fmt``).

    >>> from minitransformer.measure.timing import Timing
    >>> unsteady([1, 2], [Timing((0.010, 0.011, 0.012)), Timing((0.010, 0.020, 0.030))], "B=")
    {1: 'B=2: median 20.0 ms, 2.00x the fastest 10.0 ms: repeats disagree beyond 25%'}
    """
    found = {}
    for i, (label, t) in enumerate(zip(labels, timings, strict=True)):
        if t.spread > max_spread:
            found[i] = (f"{what}{label}: median {format(t.median * scale, fmt)} {unit}, "
                        f"{t.median / t.best:.2f}x the fastest {format(t.best * scale, fmt)} "
                        f"{unit}: repeats disagree beyond {max_spread:.0%}")
    return found


def merged(*found) -> dict:
    """Several checks' {row: message} as one, the first message of a row kept."""
    out: dict = {}
    for messages in found:
        for i, message in messages.items():
            out.setdefault(i, message)
    return out


def conclude(what, line, rows, max_spread=MAX_SPREAD) -> str:
    """The derived line when the rows it rests on are steady, else why not.

    what: the conclusion's name ('knee'); line: the line to print (a string, or a callable
    returning it, not called when the rows are doubted); rows: {label: (Timing, warning or
    None)}, the rows it rests on and what a check still says of them.

    >>> from minitransformer.measure.timing import Timing
    >>> quiet, busy = Timing((0.010, 0.011), load=1.0), Timing((0.010, 0.030), load=3.2)
    >>> conclude("knee", "knee: B = 16", {"B=1": (quiet, None), "B=2": (quiet, None)})
    'knee: B = 16'
    >>> conclude("knee", "knee: B = 1", {"B=1": (quiet, None), "B=2": (busy, None)})
    'knee: not concluded, the machine was too noisy (B=2: repeats 100% apart); load average 3.2'
    >>> line = conclude("knee", "knee: B = 1", {"B=2": (quiet, "batch 2 costs less")})
    >>> for part in line.split("; "): print(part)
    knee: not concluded, the machine was too noisy (B=2: still flagged, see its row)
    load average 1.0
    """
    doubts = {}
    for label, (timing, warning) in rows.items():
        if warning:
            doubts[label] = f"{label}: still flagged, see its row"
        elif timing.spread > max_spread:
            doubts[label] = f"{label}: repeats {timing.spread:.0%} apart"
    return conclude_on(what, line, doubts, load_seen(t for t, _ in rows.values()))


def conclude_on(what, line, doubts: dict, seen: str = "") -> str:
    """The derived line when nothing it rests on is doubted, else why not: ``conclude`` for
    figures a check judged elsewhere (step costs experiment 12 measured and flagged, read by
    experiment 13). doubts: {label: why}; seen: what is said last (the load average).

    >>> conclude_on("throughput", "throughput 2.53x", {})
    'throughput 2.53x'
    >>> conclude_on("throughput", "throughput 2.53x", {8: "B=8 below B=4"})
    'throughput: not concluded, the machine was too noisy (B=8 below B=4)'
    """
    if not doubts:
        return line() if callable(line) else line
    return (f"{what}: not concluded, the machine was too noisy ({'; '.join(doubts.values())})"
            + (f"; {seen}" if seen else ""))


def load_seen(timings=()) -> str:
    """'load average X' : the highest 1-minute load average seen while the timings measured (now,
    when they do not say), the machine's cores beside it in the table's header."""
    load = max_load(*(t.load for t in timings))
    load = load_average() if load is None else load
    return "load average unknown" if load is None else f"load average {load:.1f}"


def speedup_bound(speedup, tokens_per_pass, gamma, c, tolerance=NOISE_FLOOR):
    """A message if a speculative speedup beats its ceiling: each verification pass keeps
    ``tokens_per_pass`` tokens and costs at least gamma draft steps of cost c (relative to a
    target step) plus one target step, so speedup <= tokens_per_pass / (gamma * c + 1).

    >>> speedup_bound(4.18, 1.37, 4, 0.1)        # a busy machine's impossible figure
    'speedup 4.18x above its ceiling 0.98x = 1.37 tokens per pass / (4 x c 0.10 + 1)'
    >>> speedup_bound(0.95, 1.37, 4, 0.1) is None
    True
    """
    ceiling = tokens_per_pass / (gamma * c + 1)
    if speedup <= ceiling * (1 + tolerance):
        return None
    return (f"speedup {speedup:.2f}x above its ceiling {ceiling:.2f}x = {tokens_per_pass:.2f} "
            f"tokens per pass / ({gamma} x c {c:.2f} + 1)")


def recheck(measure, check, retries=1):
    """measure() -> figures; check(figures) -> {row: message} (or a message, or None).

    While the check fires, measure again (at most ``retries`` times): a burst of load elsewhere
    rarely strikes twice in the same place. -> (figures, what still fires: {} or None if all is
    well). ``measure`` gets the previous figures (None the first time), so it can pool samples.

    >>> runs = iter([[3.0, 1.0], [1.0, 2.0]])           # a falling cost, then a rising one
    >>> recheck(lambda previous: next(runs), lambda f: {1: "falls"} if f[1] < f[0] else {})
    ([1.0, 2.0], {})
    """
    figures = measure(None)
    for _ in range(retries):
        if not check(figures):
            break
        figures = measure(figures)
    return figures, check(figures)


def recheck_rows(labels, measure_row, check, progress=quiet, what: str = "rows",
                 retries: int = 1):
    """``recheck`` for a table of rows measured one by one, where a check judges each row
    against the one before it (a larger batch cannot be cheaper): the first pass measures
    every row; while the check fires, only the rows it flags and the row before each are
    measured again. -> (rows, {row: message} still firing).

    labels: the rows as a table names them ('B=4'); measure_row(i) -> row i's figures (a
    Timing, or a tuple whose first the check reads); check(rows) -> {row: message};
    progress(count, what) -> tick(message): a line per row measured (scripts/_common.Progress).

    >>> from minitransformer.measure.timing import Timing
    >>> runs = iter([0.010, 0.030, 0.012, 0.020, 0.040])     # row 2 disturbed: cheaper than 1
    >>> rows, warnings = recheck_rows(["B=1", "B=2", "B=4"], lambda i: Timing((next(runs),)),
    ...                               lambda t: cost_falls([1, 2, 4], t, "batch"))
    >>> [t.best for t in rows], warnings                     # rows 1 and 2 measured again
    ([0.01, 0.02, 0.04], {})
    """
    def measure(previous):
        redo = range(len(labels)) if previous is None else \
            sorted({j for i in check(previous) for j in (i - 1, i) if j >= 0})
        rows = list(previous or [None] * len(labels))
        tick = progress(len(redo), what if previous is None else "re-measuring")
        for i in redo:
            rows[i] = measure_row(i)
            t = rows[i][0] if isinstance(rows[i], tuple) else rows[i]
            tick(f"{labels[i]}: {t.best * 1e3:.1f} ms (median {t.median * 1e3:.1f})")
        return rows
    return recheck(measure, check, retries)


def rests_on(labels, timings, warnings, rows) -> dict:
    """{label: (Timing, warning or None)} for the given rows (indices): what ``conclude``
    takes, the rows a conclusion rests on and what a check still says of them. The rows grow
    in work and a check compares each with the one before it (a larger batch that costs less
    flags the larger), but either of the two may be the wrong one: a row rests on the next
    one too where that one is flagged.

    >>> from minitransformer.measure.timing import Timing
    >>> rests_on(["B=1", "B=2"], [Timing((0.01,)), Timing((0.02,))], {1: "flagged"}, [1])
    {'B=2': (Timing(samples=(0.02,), rounds=1, load=None), 'flagged')}
    >>> list(rests_on(["B=1", "B=2", "B=4"], [Timing((0.01,))] * 3, {1: "flagged"}, [0]))
    ['B=1', 'B=2']
    """
    rows = sorted(set(rows) | {i + 1 for i in rows if i + 1 in warnings})
    return {labels[i]: (timings[i], warnings.get(i)) for i in rows}


def unsteady_line(labels, timings, **formatting):
    """``unsteady`` of a few timings side by side as one message, or None when they agree.

    >>> from minitransformer.measure.timing import Timing
    >>> unsteady_line(["plain", "cached"], [Timing((1.0, 1.0)), Timing((1.0, 2.0, 3.0))],
    ...               scale=1, unit="s", fmt=".2f")
    'cached: median 2.00 s, 2.00x the fastest 1.00 s: repeats disagree beyond 25%'
    """
    return "; ".join(unsteady(labels, timings, **formatting).values()) or None
