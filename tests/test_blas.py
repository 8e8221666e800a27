"""The ways a product x @ w.T goes into BLAS (blas.py): each is the product, up to the order of
its sums; the way a shape takes is fixed once per process, so the same calls give the same bits.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minitransformer import blas
from minitransformer.backend import to_device, to_numpy


def operands(M, n=None, cols=96, seed=0):
    rng = np.random.default_rng(seed)
    n = n or blas.slice_rows(M, cols) * 2 + 5        # two slices and a short third
    return (rng.standard_normal((M, cols)).astype(np.float32),
            rng.standard_normal((n, cols)).astype(np.float32))


def within_summation_error(y, x, w):
    bound = 4 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)
    assert y.shape == (len(x), len(w)) and y.dtype == np.float32
    assert np.all(np.abs(y - x @ w.T) <= bound)


@pytest.mark.parametrize("route", blas.ROUTES)
@pytest.mark.parametrize("M", [1, 2, 5, 16, 17])
def test_every_way_is_the_product(route, M):
    x, w = operands(M)
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
    assert list(blas.chosen.values()) in (["flat"], ["rows"], ["slices"])  # measured once
    again = [to_numpy(blas.multiply(to_device(x), to_device(w))) for _ in range(3)]
    assert len(blas.chosen) == 1 and all(np.array_equal(a, first) for a in again)
    assert blas.way(x[:1], w) == "flat" and blas.way(np.ones((17, 96), np.float32), w) == "flat"


def test_a_fixed_way_is_taken_for_every_shape(monkeypatch):
    monkeypatch.setattr(blas, "chosen", {})
    for route in blas.ROUTES:
        monkeypatch.setattr(blas, "FIXED", route)
        for M in (1, 4, 40):
            x, w = operands(M, n=50)
            assert blas.way(x, w) == (route if 1 < M <= blas.FEW_ROWS else "flat")
            within_summation_error(to_numpy(blas.multiply(to_device(x), to_device(w))), x, w)
    assert blas.chosen == {}                                  # nothing measured


def test_an_unknown_fixed_way_is_refused_at_import():
    done = subprocess.run([sys.executable, "-c", "import minitransformer.blas"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MT_PRODUCTS="fastest"))
    assert done.returncode != 0
    assert "MT_PRODUCTS='fastest' is not a way to multiply: use one of flat, rows, slices" \
        in done.stderr
