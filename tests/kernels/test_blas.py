"""The routes a product x @ w.T takes into BLAS (blas.py): each is the product, up to the order of
its sums; the route a shape takes is measured (one row too) and fixed once per process, so the same
calls give the same bits. What is measured here is kept in a file of the test's own (tuning.py:
test_tuning.py tests the file), so every test measures afresh.
"""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from minitransformer.backend import to_device, to_numpy
from minitransformer.kernels import blas, tuning
from minitransformer.linear import linear


@pytest.fixture(autouse=True)
def own_tuning_file(monkeypatch, tmp_path):
    """Nothing recalled from this machine's file, nothing written to it; the row counts as a
    process starts with."""
    monkeypatch.setenv("MT_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(tuning, "MODE", "remember")
    monkeypatch.setattr(blas, "rows_run", {1, blas.FEW_ROWS})


def operands(M, n=None, cols=96, seed=0):
    rng = np.random.default_rng(seed)
    n = n or blas.slice_rows(M, cols) * 2 + 5        # two slices and a short third
    return (rng.standard_normal((M, cols)).astype(np.float32),
            rng.standard_normal((n, cols)).astype(np.float32))


def within_summation_error(y, x, w):
    bound = 4 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)
    assert y.shape == (len(x), len(w)) and y.dtype == np.float32
    assert np.all(np.abs(y - x @ w.T) <= bound)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("route", blas.ROUTES)
@pytest.mark.parametrize("M", [1, 2, 5, 16, 17])
def test_every_way_is_the_product(route, M, order):
    """In either layout of w (row-major, column-major: blas.arrange's two)."""
    x, w = operands(M)
    w = np.asarray(w, order=order)
    assert blas.layout(w) == {"C": "row-major", "F": "column-major"}[order]
    within_summation_error(blas.CALLS[route](x, w, np.empty((M, len(w)), np.float32)), x, w)
    out = np.full((M, len(w) + 3), np.nan, np.float32)   # into a column slice, as blocks do
    blas.CALLS[route](x, w, out[:, 2:-1])
    within_summation_error(out[:, 2:-1], x, w)
    assert np.isnan(out[:, :2]).all() and np.isnan(out[:, -1]).all()


@pytest.mark.parametrize("M", [1, 3, 16, 40])
def test_multiply_is_the_product_on_the_backend(M):
    x, w = operands(M, n=37)
    within_summation_error(to_numpy(blas.multiply(to_device(x), to_device(w))), x, w)


def test_a_shape_keeps_its_way_so_the_same_calls_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(blas, "FIXED", None)
    monkeypatch.setattr(blas, "chosen", {})
    x, w = operands(4, n=300)
    first = to_numpy(blas.multiply(to_device(x), to_device(w)))
    assert list(blas.chosen.values()) in [[route] for route in blas.ROUTES]  # measured once
    again = [to_numpy(blas.multiply(to_device(x), to_device(w))) for _ in range(3)]
    assert len(blas.chosen) == 1 and all(np.array_equal(a, first) for a in again)
    one = to_numpy(blas.multiply(to_device(x[:1]), to_device(w)))  # one row: measured too
    assert len(blas.chosen) == 2 and blas.chosen[(1, *w.shape, "row-major", "<f4", "<f4")] in blas.ONE_ROW
    assert all(np.array_equal(to_numpy(blas.multiply(to_device(x[:1]), to_device(w))), one)
               for _ in range(3))
    assert blas.route_for(np.ones((17, 96), np.float32), w) == "flat" and len(blas.chosen) == 2


def test_a_fixed_way_is_taken_for_every_shape(monkeypatch):
    monkeypatch.setattr(blas, "chosen", {})
    for route in blas.ROUTES:
        monkeypatch.setattr(blas, "FIXED", route)
        for M in (1, 4, 40):
            x, w = operands(M, n=50)
            assert blas.route_for(x, w) == (route if M <= blas.FEW_ROWS else "flat")
            within_summation_error(to_numpy(blas.multiply(to_device(x), to_device(w))), x, w)
    assert blas.chosen == {}                                  # nothing measured


@pytest.mark.parametrize("variable, value, message", [
    ("MT_PRODUCTS", "fastest", "MT_PRODUCTS='fastest' is not a BLAS route: use one of "
                               "flat, rows, slices, dots"),
    ("MT_LAYOUT", "diagonal", "MT_LAYOUT='diagonal' is not a layout: use one of row-major, "
                              "column-major")])
def test_an_unknown_fixed_way_or_layout_is_refused_at_import(variable, value, message):
    done = subprocess.run([sys.executable, "-c", "import minitransformer.kernels.blas"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **{variable: value}))
    assert done.returncode != 0 and message in done.stderr


def slowed(monkeypatch, routes, seconds=0.003):
    """Make each of `routes` (blas.py's functions) cost `seconds` a call (or routes[name] where
    routes is a dict: a cost, or a list of costs for its calls in turn) on a virtual clock -> the
    calls made. The chooser's clock reads that clock alone: a call advances it by its cost and
    by nothing else, so the real product's microseconds, and a call preempted on a busy
    machine, count for nothing and the timings are exact (no sleeps)."""
    made, now = [], [0.0]
    delays = routes if isinstance(routes, dict) else dict.fromkeys(routes, seconds)
    monkeypatch.setattr(blas, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    for name in blas.ROUTES:
        real = getattr(blas, name)

        def call(x, w, out=None, real=real, name=name):
            made.append(name)
            cost = delays.get(name, 0)
            now[0] += cost.pop(0) if isinstance(cost, list) else cost
            return real(x, w, out)
        monkeypatch.setattr(blas, name, call)
    return made


@pytest.mark.parametrize("M", [1, 4])
def test_the_way_measured_fastest_is_taken(monkeypatch, M):
    """For each route the chooser may take for M rows: all the others cost 3 ms a call (one pass
    of rows or dots: 3 ms / M), that route 2 ms -> that route is chosen; for one row `rows` is not
    timed (it is flat's own matrix-vector call)."""
    x, w = operands(M, n=300)
    assert blas.candidates(M) == (blas.ONE_ROW if M == 1 else blas.ROUTES)
    assert set(blas.ONE_ROW) == set(blas.ROUTES) - {"rows"}
    for route in blas.candidates(M):
        cost = {name: (0.002 if name == route else 0.003) / (M if name in ("rows", "dots")
                                                               else 1) for name in blas.ROUTES}
        made = slowed(monkeypatch, cost)
        assert blas.fastest(x, w) == route
        assert set(made) == set(blas.candidates(M))
        assert len(made) == blas.TRIALS * len(blas.candidates(M))
        monkeypatch.undo()


def test_a_way_far_slower_after_two_trials_is_timed_no_more(monkeypatch):
    """After PRUNE_AFTER trials a route more than PRUNE times slower than the fastest is not
    timed again (a slow route can cost a second a trial); one at PRUNE times is, and one slow
    in its first trial only (a spike) is timed on, and wins."""
    assert blas.TRIALS > blas.PRUNE_AFTER
    x, w = operands(4, n=300)
    made = slowed(monkeypatch, {"flat": 0.003, "rows": 0.0061 / 4, "dots": 0.006 / 4,
                                "slices": [0.05, 0.002] + [0.002] * blas.TRIALS})
    assert blas.fastest(x, w) == "slices"
    assert {name: made.count(name) for name in blas.ROUTES} == {
        "flat": blas.TRIALS, "rows": blas.PRUNE_AFTER, "dots": blas.TRIALS,
        "slices": blas.TRIALS}


def test_slices_stop_once_they_have_lost(monkeypatch):
    """slices, many calls, is made a slice at a time once another route has been timed, and
    stops when it has taken longer than the fastest route so far: here flat takes 1 ms and the
    first slice 7.5 ms, so no other is made; at 2 ms for all of w (under PRUNE times flat's)
    it stops within it every trial, and flat is taken, as timing it whole would; where slices
    keeps up it reads all of w, and wins at 0.2 ms."""
    x, w = operands(16, n=2000)
    block = blas.slice_rows(16, w.shape[1])
    assert 2000 > 2 * block
    per_row = [1e-4]
    made = reads(monkeypatch, lambda route, M, n: {"flat": 1e-3, "slices": n * per_row[0]}.get(
        route, 1.0))
    assert blas.fastest(x, w) == "flat"
    read = [n for route, _, n, *_ in made if route == "slices"]
    assert read == [block] * blas.PRUNE_AFTER                # stopped each time, then pruned
    made.clear()
    per_row[0] = 1e-6                                        # 2 ms: lost, not pruned
    assert blas.fastest(x, w) == "flat"
    read = [n for route, _, n, *_ in made if route == "slices"]
    assert 0 < sum(read) < blas.TRIALS * 2000 / 2 + blas.TRIALS * block, read
    made.clear()
    per_row[0] = 1e-7
    assert blas.fastest(x, w) == "slices"
    read = [n for route, _, n, *_ in made if route == "slices"]
    assert sum(read) == blas.TRIALS * 2000                    # all of w, every trial


def test_the_fastest_trial_of_a_way_counts(monkeypatch):
    """Each route is timed TRIALS times and its fastest trial counts: slices slow in every trial
    but its second (page faults, preemption) beats flat at a steady middle cost."""
    x, w = operands(4, n=300)
    slowed(monkeypatch, {"slices": [0.05, 0.001] + [0.05] * (blas.TRIALS - 2), "flat": 0.002,
                         "rows": 0.03, "dots": 0.03})
    assert blas.fastest(x, w) == "slices"


def test_rows_and_dots_count_one_pass_over_w_per_row(monkeypatch):
    """They are timed on one row of x: the chooser counts that time M times. A flat product of
    4 rows costing 8 ms beats one row costing 4 ms (16 ms for the 4)."""
    x, w = operands(4, n=300)
    for one_pass in ("rows", "dots"):
        slowed(monkeypatch, {"flat": 0.008, one_pass: 0.004, "slices": 0.03,
                             ({"rows", "dots"} - {one_pass}).pop(): 0.03})
        assert blas.fastest(x, w) == "flat"
        monkeypatch.undo()


def reads(monkeypatch, costs=None):
    """Record, for every call of a route, (route, the address of w's data, w's rows, w's bytes,
    w's layout, w's values); on the virtual clock a call costs costs(route, rows of x, rows of w)
    where given -> the records."""
    made, now = [], [0.0]
    monkeypatch.setattr(blas, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    for name in blas.ROUTES:
        real = getattr(blas, name)

        def call(x, w, out=None, real=real, name=name):
            made.append((name, w.__array_interface__["data"][0], len(w), w.nbytes,
                         blas.layout(w), w.copy()))
            now[0] += costs(name, len(x), len(w)) if costs else 0.0
            return real(x, w, out)
        monkeypatch.setattr(blas, name, call)
    return made


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_cold_weight_is_timed_over_copies_of_itself_in_turn(monkeypatch, order):
    """From COLD_BYTES to LARGE_BYTES no flush: each timing reads a copy of w (in w's layout,
    w's values) that at least FLUSH_BYTES of other copies were read after its last timing, so
    it comes from memory, as a decode step finds its weights, and what is timed is the product
    alone."""
    flushes = []
    monkeypatch.setattr(blas, "flush_caches", flushes.append)
    x, w = operands(4, n=300)
    w = np.asarray(w, order=order)
    for name, value in (("COLD_BYTES", w.nbytes), ("LARGE_BYTES", w.nbytes),
                        ("FLUSH_BYTES", 5 * w.nbytes - 100)):
        monkeypatch.setattr(blas, name, value)
    made = reads(monkeypatch)
    blas.fastest(x, w)
    assert flushes == [] and len(made) == blas.TRIALS * len(blas.candidates(4, blas.layout(w)))
    assert len({address for _, address, *_ in made}) == 1 + 5        # w and 5 copies
    assert all(held == blas.layout(w) and np.array_equal(values, w)
               for _, _, _, _, held, values in made)
    for i, (_, address, *_) in enumerate(made):
        before = [j for j in range(i) if made[j][1] == address]
        if before:
            between = {made[j][1]: made[j][3] for j in range(before[-1] + 1, i)}
            assert sum(between.values()) >= blas.FLUSH_BYTES, i


def test_a_small_weight_is_timed_as_it_is_and_a_larger_one_after_a_flush(monkeypatch):
    """Under COLD_BYTES, w itself every time, no flush; over LARGE_BYTES (and under
    FLUSH_BYTES), w itself after a flush before every timing. The data read to flush is
    FLUSH_BYTES of the one scratch memory, allocated when first needed, whatever the shapes,
    and written (fresh pages never written are one zero page: reading them flushes nothing)."""
    flushes = []
    monkeypatch.setattr(blas, "flush_caches", flushes.append)
    monkeypatch.setattr(blas, "room", None)
    x, w = operands(1, n=300)
    monkeypatch.setattr(blas, "FLUSH_BYTES", 8 * w.nbytes)
    made = reads(monkeypatch)
    monkeypatch.setattr(blas, "COLD_BYTES", w.nbytes + 1)
    blas.fastest(x, w)
    assert flushes == [] and blas.room is None                 # nothing allocated
    assert {address for _, address, *_ in made} == {w.__array_interface__["data"][0]}
    monkeypatch.setattr(blas, "COLD_BYTES", w.nbytes)
    monkeypatch.setattr(blas, "LARGE_BYTES", w.nbytes - 1)
    blas.fastest(x, w)
    assert len(flushes) == blas.TRIALS * len(blas.ONE_ROW)
    x4, w2 = operands(4, n=2 * len(w))
    blas.fastest(x4, w2)
    assert len(flushes) == blas.TRIALS * (len(blas.ONE_ROW) + len(blas.ROUTES))
    assert all(np.shares_memory(buffer, blas.room) and buffer.all() for buffer in flushes)
    assert {buffer.nbytes for buffer in flushes} == {8 * w.nbytes}
    assert {address for route, address, *_ in made if route != "slices"} == {  # slices: slice
        w.__array_interface__["data"][0], w2.__array_interface__["data"][0]}  # by slice


@pytest.mark.parametrize("slice_ms, flushed_before", [
    (0.6, ["flat"] + ["dots"] * 3),    # slices stops within w (lost to flat): flushed after
    (0.1, ["flat"]),                   # slices reads all of w: a whole pass, as every route
])
def test_a_weight_of_flush_bytes_is_flushed_first_and_after_a_timing_that_read_part_of_it(
        monkeypatch, slice_ms, flushed_before):
    """A weight over LARGE_BYTES of FLUSH_BYTES or more (a vocabulary's head) is flushed from
    the caches before its first timing and after a timing that read only a part of it (a
    slices stopped), never after a whole pass over it: that pass evicted the caches itself."""
    assert blas.TRIALS == 3
    x, w = operands(4)                                        # 3 slices of w for 4 rows
    for name, value in (("COLD_BYTES", 1), ("LARGE_BYTES", w.nbytes - 1),
                        ("FLUSH_BYTES", w.nbytes)):
        monkeypatch.setattr(blas, name, value)
    events = []
    monkeypatch.setattr(blas, "flush_caches", lambda buffer: events.append("flush"))
    step = blas.slice_rows(4, w.shape[1])
    costs = {"flat": 1e-3, "rows": 0.5e-3, "dots": 0.5e-3}
    made = reads(monkeypatch, lambda route, M, n: costs.get(route, slice_ms * 1e-3 * n / step))
    real = blas.timed

    def timed(call, route, *args, **kw):
        events.append(route)
        return real(call, route, *args, **kw)
    monkeypatch.setattr(blas, "timed", timed)
    assert blas.fastest(x, w) == ("slices" if slice_ms < 0.3 else "flat")
    # timed flushes, then calls: a flush follows the name of the route it was made for
    assert [events[i - 1] for i, event in enumerate(events) if event == "flush"] == \
        flushed_before
    assert len(made) >= blas.TRIALS * 4


@pytest.mark.parametrize("route", blas.ROUTES)
def test_a_row_of_a_per_row_product_has_the_bits_it_has_alone(monkeypatch, route):
    """Batch-invariant mode (each row multiplied as a batch of one, as the engine's decode
    does) under each route, one row's included: every row of a 5-row product made row by row is
    bit for bit the product of that row alone, made again, and within summation error."""
    monkeypatch.setattr(blas, "FIXED", route)
    x, w = operands(5, n=300)
    rows = np.concatenate([to_numpy(linear(to_device(x[b:b + 1, None, :]), to_device(w)))
                           for b in range(len(x))])                             # (5, 1, n)
    for b in range(len(x)):
        alone = to_numpy(linear(to_device(x[None, b:b + 1]), to_device(w)))        # (1, 1, n)
        assert np.array_equal(rows[b], alone[0])
    within_summation_error(rows[:, 0], x, w)


def layouts_slowed(monkeypatch, costs):
    """Make every route cost costs[(layout, rows)] a call on the chooser's virtual clock (as
    slowed) -> the (route, layout) of each call made."""
    made, now = [], [0.0]
    monkeypatch.setattr(blas, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    for name in blas.ROUTES:
        real = getattr(blas, name)

        def call(x, w, out=None, real=real, name=name):
            made.append((name, blas.layout(w)))
            now[0] += costs[blas.layout(w), 1 if name in ("rows", "dots") else len(x)]
            return real(x, w, out)
        monkeypatch.setattr(blas, name, call)
    return made


@pytest.mark.parametrize("one, few, taken", [
    (0.001, 0.001, "column-major"),    # faster at 1 and at FEW_ROWS rows: column-major
    (0.003, 0.001, "row-major"),       # faster for FEW_ROWS rows only: kept as it is
    (0.001, 0.009, "row-major"),       # faster for one row only
])
def test_a_weight_is_laid_out_column_major_only_where_that_is_faster_for_1_and_few_rows(
        monkeypatch, one, few, taken):
    """Row-major routes cost 2 ms a call (1 row) and 8 ms (FEW_ROWS rows); the column-major ones
    `one` and `few`. arrange gives the same values in the layout both counts run faster in,
    times both layouts in the same trials, never `dots` over column-major (strided rows), and
    keeps the fastest route of each count in the layout taken: nothing measured again."""
    monkeypatch.setattr(blas, "FIXED", None)
    monkeypatch.setattr(blas, "chosen", {})
    monkeypatch.setattr(blas, "laid_out", {})
    made = layouts_slowed(monkeypatch, {("row-major", 1): 0.002, ("column-major", 1): one,
                                        ("row-major", blas.FEW_ROWS): 0.008,
                                        ("column-major", blas.FEW_ROWS): few})
    _, w = operands(4, n=300)
    arranged = blas.arrange(to_device(w))
    assert np.array_equal(to_numpy(arranged), w) and blas.layout(arranged) == taken
    assert ("dots", "column-major") not in made and {layout for _, layout in made} == {
        "row-major", "column-major"}
    assert blas.laid_out == {(*w.shape, "<f4", (1, blas.FEW_ROWS)): taken}
    assert sorted(key[0] for key in blas.chosen) == [1, blas.FEW_ROWS]
    assert all(key[3] == taken for key in blas.chosen)
    calls = len(made)
    blas.arrange(to_device(w.copy()))                        # the same shape: not timed again
    for M in (1, blas.FEW_ROWS):
        blas.multiply(to_device(np.ones((M, w.shape[1]), np.float32)), arranged)
    assert len(made) == calls


def test_a_fixed_way_keeps_the_checkpoint_s_layout_and_a_fixed_layout_is_taken(monkeypatch):
    monkeypatch.setattr(blas, "FIXED", "flat")
    monkeypatch.setattr(blas, "laid_out", {})
    _, w = operands(4, n=300)
    held = to_device(np.asfortranarray(w))
    assert blas.arrange(held) is held                         # as it is, column-major or not
    for fixed in blas.LAYOUTS:
        monkeypatch.setattr(blas, "FIXED_LAYOUT", fixed)
        for given in (w, np.asfortranarray(w)):
            arranged = blas.arrange(to_device(given))
            assert blas.layout(arranged) == fixed and np.array_equal(to_numpy(arranged), w)
    assert blas.laid_out == {}                                # nothing measured


# Per (layout, route, rows in the call) on the virtual clock, in ms: the two layouts' winners
# differ at every count (1, 8 and FEW_ROWS rows), and column-major is the faster at each.
# `rows` and `dots` are timed on one row (their cost per call), counted M times.
WINNERS = {"column-major": {1: "slices", 8: "flat", 16: "rows"},
           "row-major": {1: "dots", 8: "slices", 16: "flat"}}
COSTS = {("column-major", "flat"): {1: 2, 8: 1, 16: 9},     # slices 1 | flat 1 | rows 8
         ("column-major", "slices"): {1: 1, 8: 3, 16: 9},
         ("column-major", "rows"): {1: 0.5},
         ("row-major", "flat"): {1: 5, 8: 6, 16: 10},       # dots 1.5 | slices 2 | flat 10
         ("row-major", "slices"): {1: 5, 8: 2, 16: 20},
         ("row-major", "rows"): {1: 3},
         ("row-major", "dots"): {1: 1.5}}


def winners_differ_by_layout(monkeypatch):
    """Every route costs COSTS on the chooser's virtual clock, and the products multiply calls
    (blas.CALLS) are the timed ones too -> the (route, layout, rows) of each call made."""
    made, now = [], [0.0]
    monkeypatch.setattr(blas, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    wrapped = {}
    for name in blas.ROUTES:
        real = getattr(blas, name)

        def call(x, w, out=None, real=real, name=name):
            held = "column-major" if w.strides[0] < w.strides[1] else "row-major"
            made.append((name, held, len(x)))
            per = COSTS[held, name]                 # rows, dots: a pass over w per row of x
            share = len(w) / 300                    # slices may be timed a slice at a time
            now[0] += (per[len(x)] if len(per) > 1 else per[1] * len(x)) * share / 1000
            return real(x, w, out)
        monkeypatch.setattr(blas, name, call)
        wrapped[name] = call
    monkeypatch.setattr(blas, "CALLS", wrapped)
    return made


def test_a_weight_held_in_the_layout_that_won_takes_the_way_measured_fastest_in_that_layout(
        monkeypatch):
    """For each row count measured (1, 8 through expect_rows, FEW_ROWS), a product over the
    weight arrange gave back (column-major, the faster at each) makes the call that was fastest
    in column-major, never row-major's fastest (nor another count's): in this process, and in
    the next one, which reads the choice back from the file and times nothing."""
    monkeypatch.setattr(blas, "FIXED", None)
    made = winners_differ_by_layout(monkeypatch)
    blas.expect_rows(8, 40)                                 # 40 rows: flat, nothing to measure
    _, w = operands(4, n=300)
    for process in ("measures", "reads the file"):
        monkeypatch.setattr(blas, "chosen", {})
        monkeypatch.setattr(blas, "laid_out", {})
        arranged = blas.arrange(to_device(w))
        assert blas.layout(arranged) == "column-major" and np.array_equal(to_numpy(arranged), w)
        assert {M for _, _, M in made} == ({1, 8, 16} if process == "measures" else set())
        for M, route in WINNERS["column-major"].items():
            made.clear()
            x = np.ones((M, w.shape[1]), np.float32)
            y = to_numpy(blas.multiply(to_device(x), arranged))
            assert made == [(route, "column-major", M)], (process, M)
            assert np.array_equal(y, blas.CALLS[route](x, np.asfortranarray(w),
                                                       np.empty((M, len(w)), np.float32)))
        made.clear()


def test_the_scratch_memory_is_given_back_once_a_model_is_built(monkeypatch, tiny_model):
    """Measuring's copies and flush data (up to a few hundred MiB) are not held by a model:
    fuse gives them back once every weight is laid out."""
    from minitransformer.kernels.fused import fuse
    monkeypatch.setattr(blas, "room", None)
    blas.flush_buffer()
    assert blas.room is not None
    fuse(tiny_model.config, tiny_model.weights)
    assert blas.room is None
    blas.flush_buffer()                          # a route measured at a new count of rows
    monkeypatch.setattr(blas, "FIXED", None)
    monkeypatch.setattr(blas, "chosen", {})
    blas.route_for(*operands(3))
    assert blas.room is None
