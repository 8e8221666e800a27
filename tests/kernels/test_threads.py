"""The threads setting and the pool a step's products are split across (kernels/threads.py), and
the split products themselves (blas.in_parts, blas.parts). Nothing here depends on the machine's
cores: the counts are set, and a pool of 2 threads runs on one core as on many."""
import os
import subprocess
import sys
import threading
import time
from itertools import pairwise

import numpy as np
import pytest
import threadpoolctl

from minitransformer.errors import SettingError
from minitransformer.kernels import blas, threads, tuning


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "", " "])
def test_a_thread_count_is_a_whole_number_of_at_least_one(value):
    with pytest.raises(SettingError, match="thread count"):
        threads.checked_count(value, "MT_THREADS")
    assert threads.checked_count(" 3 ") == 3


def test_mt_threads_is_read_at_import_and_a_bad_one_named():
    code = "from minitransformer.kernels import threads; print(threads.count(), threads.SET_BY)"
    env = os.environ | {"MT_THREADS": "3"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["3", "MT_THREADS"], done.stderr
    done = subprocess.run([sys.executable, "-c", code], env=env | {"MT_THREADS": "zero"},
                          capture_output=True, text=True)
    assert done.returncode != 0 and "MT_THREADS='zero' is not a thread count" in done.stderr


def test_the_default_is_the_cores_this_process_may_use():
    assert threads.default_count() == len(os.sched_getaffinity(0))


def test_the_pool_runs_every_task_once_on_its_threads():
    pool, ran = threads.Pool(3), []
    tasks = [lambda i=i: ran.append((i, threading.current_thread().name)) for i in range(5)]
    pool.run(tasks)
    assert sorted(i for i, _ in ran) == list(range(5))
    names = dict(ran)
    assert names[0] == threading.current_thread().name     # the caller's part
    assert {names[1], names[2]} == {"product-part-1", "product-part-2"}
    pool.stop()


def test_an_error_in_a_part_is_raised_after_every_part_is_done():
    pool, done = threads.Pool(2), []

    def fails():
        raise KeyError("part 1")
    with pytest.raises(KeyError, match="part 1"):
        pool.run([lambda: time.sleep(0.05) or done.append(0), fails])
    assert done == [0]
    pool.run([lambda: done.append(1), lambda: done.append(2)])     # the pool goes on
    assert sorted(done) == [0, 1, 2]
    pool.stop()


def test_a_second_caller_runs_its_parts_itself_while_the_pool_is_busy():
    pool, names = threads.Pool(2), []
    with pool.busy:                                  # another thread's product in flight
        pool.run([lambda: names.append(threading.current_thread().name)] * 2)
    assert names == [threading.current_thread().name] * 2
    pool.stop()


def test_an_idle_pool_blocks_and_takes_no_cpu():
    pool = threads.Pool(3)
    pool.run([lambda: None] * 3)                     # the workers started, now waiting
    before = time.process_time()
    time.sleep(0.5)
    idle = time.process_time() - before
    pool.stop()
    assert idle < 0.1, f"{idle:.2f} s of CPU while idle: the workers spin"


def test_blas_takes_one_thread_inside_the_parts_and_its_own_after():
    blas_libraries = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    if not blas_libraries:
        pytest.skip("no BLAS library loaded")
    seen = []
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        threads.run([lambda: seen.append([lib.get_num_threads() for lib in blas_libraries])] * 2)
        after = [lib.get_num_threads() for lib in blas_libraries]
    assert seen == [[1] * len(blas_libraries)] * 2
    assert after == [2] * len(blas_libraries)


def test_set_count_sets_the_pool_and_blas(step_threads):
    assert threads.count() == threads.pool.size == step_threads
    counts = {p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"}
    assert counts <= {step_threads}
    assert threads.describe().startswith(f"threads: {step_threads} (the test;")


@pytest.mark.parametrize("layout", blas.LAYOUTS)
@pytest.mark.parametrize("M", [1, 3, 16, 40])
@pytest.mark.parametrize("n", [100, 1201, 2500])
def test_a_product_in_parts_is_the_whole_product(layout, M, n):
    """Every output column is computed, once, by the way asked, whatever n (cut at multiples of
    16, or of a slice for `slices`, the last part shorter)."""
    rng = np.random.default_rng(n + M)
    w = blas.in_layout(rng.standard_normal((n, 64)).astype(np.float32), layout)
    x = rng.standard_normal((M, 64)).astype(np.float32)
    for route in blas.candidates(M, layout):
        for count in (2, 3):
            out = np.full((M, n), np.nan, np.float32)
            blas.in_parts(route, x, w, out, count)
            np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=1e-5, err_msg=route)


def test_part_bounds_cover_the_columns_once():
    for n in (1, 15, 16, 17, 100, 3072, 49152):
        for count in (1, 2, 3, 7):
            for align in (16, 1200):
                bounds = blas.part_bounds(n, count, align)
                assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) <= count
                assert all(a[1] == b[0] for a, b in pairwise(bounds))
                assert all(r0 % align == 0 for r0, _ in bounds)


class Clock:
    """time.perf_counter for blas.measured_split, advanced by the product it times: the whole
    product costs `whole` seconds, the parts `parted`."""

    def __init__(self, whole, parted):
        self.now, self.cost = 0.0, {1: whole, 2: parted}

    def perf_counter(self):
        return self.now

    def in_parts(self, route, x, w, out, count):
        self.now += self.cost[count]
        return out


@pytest.mark.parametrize("whole, parted, taken", [(1.0, 0.6, 2), (1.0, 0.97, 1),
                                                  (1.0, 1.4, 1)])
def test_the_split_is_taken_only_where_measured_faster(monkeypatch, capsys, whole, parted,
                                                       taken):
    """Two threads where their parts beat the whole by SPLIT_GAIN; one where they do not help
    (never slower at 2 threads than at 1): kept in the tuning file, read back after; quietly
    (measured mid-step, a line would land among a chat's tokens: test_cli's tmux test)."""
    clock = Clock(whole, parted)
    monkeypatch.setattr(blas, "time", clock)
    monkeypatch.setattr(blas, "in_parts", clock.in_parts)
    monkeypatch.setattr(blas, "split", {})
    monkeypatch.setattr(tuning, "MODE", "remember")
    kept = {}
    monkeypatch.setattr(tuning, "recall", kept.get)
    monkeypatch.setattr(tuning, "remember",
                        lambda key, answer, quiet: kept.update({key: answer, "quiet": quiet}))
    monkeypatch.setattr(threads, "COUNT", 2)
    x, w = np.ones((1, 64), np.float32), np.ones((300, 64), np.float32)
    assert blas.parts(x, w, "flat") == taken
    assert kept == {"split 1 300x64 row-major <f4 <f4 flat 2": taken, "quiet": True}
    assert capsys.readouterr().err == ""
    many = np.ones((40, 64), np.float32)              # more than FEW_ROWS: one choice for all
    assert blas.parts(many, w, "flat") == taken
    assert kept["split many 300x64 row-major <f4 <f4 flat 2"] == taken
    blas.split.clear()
    monkeypatch.setattr(blas, "in_parts", None)      # read back: nothing timed again
    assert blas.parts(x, w, "flat") == taken
    assert blas.parts(many[:23], w, "flat") == taken


@pytest.mark.parametrize("answer", [3, "2", True, None, [2]])
def test_a_split_the_file_holds_is_checked_not_trusted(monkeypatch, answer):
    monkeypatch.setattr(blas, "split", {})
    monkeypatch.setattr(threads, "COUNT", 2)
    monkeypatch.setattr(tuning, "recall", lambda key: answer)
    monkeypatch.setattr(blas, "measured_split", lambda x, w, key: "measured")
    x, w = np.ones((1, 8), np.float32), np.ones((32, 8), np.float32)
    assert blas.parts(x, w, "flat") == "measured"


def test_one_thread_fixed_products_or_mt_split_decide_without_measuring(monkeypatch):
    monkeypatch.setattr(blas, "measured_split", None)            # called: an error
    x, w = np.ones((1, 8), np.float32), np.ones((32, 8), np.float32)
    monkeypatch.setattr(threads, "COUNT", 1)
    assert blas.parts(x, w, "flat") == 1
    monkeypatch.setattr(threads, "COUNT", 2)
    monkeypatch.setattr(blas, "FIXED", "flat")                   # MT_PRODUCTS: whole
    assert blas.parts(x, w, "flat") == 1
    monkeypatch.setattr(blas, "FIXED_SPLIT", "parts")
    assert blas.parts(x, w, "flat") == 2
    monkeypatch.setattr(blas, "FIXED", None)
    monkeypatch.setattr(blas, "FIXED_SPLIT", "whole")
    assert blas.parts(x, w, "flat") == 1


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"]])
def test_the_commands_take_threads_and_refuse_a_bad_count(command, capsys):
    from minitransformer.__main__ import parser
    assert parser().parse_args([*command, "--threads", "3"]).threads == 3
    assert parser().parse_args(command).threads is None           # the setting's own default
    with pytest.raises(SystemExit):
        parser().parse_args([*command, "--threads", "0"])
    assert "--threads: expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_using_sets_both_counts_inside_and_puts_them_back():
    libraries = threads.controllers()
    blas_before = [lib.get_num_threads() for lib in libraries]
    before = threads.count(), threads.pool
    with threads.using(3):
        assert threads.count() == threads.pool.size == 3
        assert [lib.get_num_threads() for lib in libraries] == [3] * len(libraries)
        three = threads.pool
    assert (threads.count(), threads.pool) == before
    assert [lib.get_num_threads() for lib in libraries] == blas_before
    with threads.using(3):
        assert threads.pool is three                 # kept: its workers started once
