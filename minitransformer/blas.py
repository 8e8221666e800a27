"""How a product x @ w.T goes into BLAS: the call that is fastest on the BLAS running here.

A learner may skip this module: `multiply(x, w)` is `x @ w.T`. It exists because a decode step
is a string of products of a weight matrix with a few vectors, and the way they go into BLAS
decides what the step costs. For M rows of x there are three ways to make the same numbers:

    flat     one matrix-matrix product, (w @ x.T).T: every weight read once for all M rows
             (with many rows OpenBLAS runs it faster this way round than x @ w.T)
    rows     M matrix-vector products, w @ x[m]: every weight read M times, but no packing
    slices   x @ w[r0:r1].T, a few hundred rows of w at a time: products small enough for
             a BLAS's small-matrix path (where it has one) multiply without repacking w

Which is fastest depends on the BLAS kernel, not on the arithmetic. Measured here, one thread,
a (9728, 896) matrix: with OpenBLAS's SkylakeX kernel 4 rows cost 2.4 ms flat, 4.8 ms as rows,
1.4 ms as slices; with its Haswell kernel 2.9, 4.7 and 2.6 ms, and 2 rows 2.5, 2.4 and 2.8 ms.
So nothing here is tuned to one kernel: one row is one matrix-vector product, more than FEW_ROWS
rows one flat product, and for 2..FEW_ROWS rows the first product of each shape times the three
ways on its own operands and keeps the fastest for that shape, for the rest of the process.

The three ways sum in different orders, so their last bits differ. Within a process a shape
always takes the same way, so the same calls give the same bits; across processes the measured
choice may differ, and `MT_PRODUCTS=flat|rows|slices` fixes it (read at import, as MT_BACKEND)
for a comparison of bits between two runs. On CuPy every product is one cuBLAS call (flat); the
strict test backend runs exactly NumPy's calls on the data it wraps (backend.numpy_kernel).
"""
import os
import time

import numpy as np

from minitransformer.backend import BACKEND, numpy_kernel, xp

ROUTES = ("flat", "rows", "slices")
FEW_ROWS = 16            # up to this many rows, the way is measured; above it, flat
FIXED = os.environ.get("MT_PRODUCTS", "").strip().lower() or None
if FIXED is not None and FIXED not in ROUTES:
    raise ValueError(f"MT_PRODUCTS={FIXED!r} is not a way to multiply: use one of "
                     f"{', '.join(ROUTES)}, or leave it unset to measure")
TRIALS = 3               # timings per way when a shape is measured (the fastest counts)
chosen = {}              # (M, n, in, dtypes) -> the way measured fastest for that shape


def multiply(x, w, out=None):
    """x (M, in) @ w (n, in).T -> (M, n), by the way chosen for M rows (see the docstring).

    >>> from minitransformer.backend import to_device, to_numpy
    >>> a, b = xp.ones((2, 3), xp.float32), to_device(np.arange(12.0, dtype=np.float32))
    >>> to_numpy(multiply(a, b.reshape(4, 3))).tolist()
    [[3.0, 12.0, 21.0, 30.0], [3.0, 12.0, 21.0, 30.0]]
    """
    if BACKEND == "cupy":                                            # one cuBLAS call
        return flat(x, w, out)
    return on_device(x, w, out)


def numpy_multiply(x, w, out=None):
    """multiply on NumPy arrays: for code already running on NumPy's data (quant/matmul.py)."""
    route = way(x, w)
    if out is None and route != "flat":
        out = np.empty((len(x), len(w)), np.result_type(x, w)).view(type(x))  # (M, n)
    return CALLS[route](x, w, out)


def way(x, w) -> str:
    """The way M rows of x multiply w here: by rule for 1 or many rows; for 2..FEW_ROWS,
    FIXED, or the way measured fastest the first time this shape came."""
    M = len(x)
    if M == 1 or M > FEW_ROWS:
        return "flat"  # one row: w @ x.T with x.T (in, 1), NumPy's matrix-vector product
    if FIXED is not None:
        return FIXED
    key = (M, *w.shape, x.dtype.str, w.dtype.str)
    if key not in chosen:
        chosen[key] = fastest(x, w)
    return chosen[key]


def fastest(x, w) -> str:
    """Time the three ways on these operands (TRIALS each, interleaved) -> the fastest.

    `rows` is M alike matrix-vector products: timed as one of them, times M (on a large
    matrix, such as a vocabulary's head, that keeps the measuring short)."""
    out = np.empty((len(x), len(w)), np.result_type(x, w))
    calls = {"flat": lambda: flat(x, w, out), "rows": lambda: rows(x[:1], w, out),
             "slices": lambda: slices(x, w, out)}
    best = dict.fromkeys(ROUTES, float("inf"))
    for _ in range(TRIALS):
        for route in ROUTES:
            start = time.perf_counter()
            calls[route]()
            best[route] = min(best[route], time.perf_counter() - start)
    best["rows"] *= len(x)
    return min(ROUTES, key=best.get)


def flat(x, w, out=None):
    """One matrix-matrix product: w @ x.T is (n, M), given back transposed (a view), or
    copied into out."""
    y = (w @ x.T).T                                                  # (M, n)
    if out is None:
        return y
    out[...] = y
    return out


def rows(x, w, out):
    """One matrix-vector product per row of x."""
    for m in range(len(x)):
        np.matmul(w, x[m], out=out[m])
    return out


def slices(x, w, out):
    """x @ w[r0:r1].T for slices of slice_rows(M, in) rows of w."""
    step = slice_rows(len(x), w.shape[1])
    for r0 in range(0, len(w), step):
        np.matmul(x, w[r0:r0 + step].T, out=out[:, r0:r0 + step])
    return out


CALLS = {"flat": flat, "rows": rows, "slices": slices}

# The slice size: OpenBLAS (x86-64) multiplies without repacking when its small-matrix path
# is permitted, M*N*K <= 10**6 and, for x @ w.T, M*N <= 1200, on the kernels that have one
# (SkylakeX); elsewhere the slices are simply small products, and measured like the rest.
SMALL_PRODUCT, SMALL_OUTPUT = 10 ** 6, 1200


def slice_rows(M: int, cols: int) -> int:
    """Rows of w per call when M rows of `cols` multiply it in slices.

    >>> slice_rows(4, 576), slice_rows(16, 576), slice_rows(16, 4864)
    (300, 75, 12)
    """
    return max(1, min(SMALL_PRODUCT // (M * cols), SMALL_OUTPUT // M))


on_device = numpy_kernel(numpy_multiply)  # strict: NumPy's calls on the data it wraps
