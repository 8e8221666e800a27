"""How a product x @ w.T goes into BLAS: the call that is fastest on the BLAS running here.

A learner may skip this module: `multiply(x, w)` is `x @ w.T`. It exists because a decode step
is a string of products of a weight matrix with a few vectors, and the way they go into BLAS
decides what the step costs. For M rows of x there are four ways to make the same numbers, all
over the one copy of w the model holds:

    flat     one matrix-matrix product, (w @ x.T).T: every weight read once for all M rows
             (with many rows OpenBLAS runs it faster this way round than x @ w.T); for one
             row, NumPy's matrix-vector product w @ x
    rows     M matrix-vector products, w @ x[m]: every weight read M times, but no packing
    slices   x @ w[r0:r1].T, a few hundred rows of w at a time: products small enough for
             a BLAS's small-matrix path (where it has one) multiply without repacking w;
             for one row, row blocks of w times the vector
    dots     one dot product per row of w and row of x: the read a BLAS dot product makes,
             the fastest streaming read on some CPUs, where the matrix-vector kernel is not

Which is fastest depends on the BLAS kernel and the CPU, not on the arithmetic. Measured here,
one thread, a (9728, 896) matrix: with OpenBLAS's SkylakeX kernel 4 rows cost 2.4 ms flat, 4.8 ms
as rows, 1.4 ms as slices; with its Haswell kernel 2.9, 4.7 and 2.6 ms. One row is no simpler:
on some CPUs the matrix-vector product streams a weight well below the rate of a dot product
over the same bytes (scripts/bench_decode.py times every route: docs/benchmarks/). So nothing
here is tuned to one kernel: more than FEW_ROWS rows take one flat product, and for 1..FEW_ROWS
rows the first product of each shape times the ways (for one row, `rows` is the very call
`flat` makes, so three) on its own operands and keeps the fastest for that shape, for the rest
of the process. A weight of COLD_BYTES or more is timed as a decode step reads it, from memory:
the caches are flushed before each timing (a decode step reads every weight once, so none of
them is still cached when its turn comes), by reading FLUSH_BYTES of other data: one buffer,
allocated on the first large weight measured and kept for the process.

The ways sum in different orders, so their last bits differ. Within a process a shape always
takes the same way, so the same calls give the same bits (a row of a batch-invariant step makes
the very call the row alone makes, linear.py); across processes the measured choice may differ,
and `MT_PRODUCTS=flat|rows|slices|dots` fixes it for every shape of 1..FEW_ROWS rows (read at
import, as MT_BACKEND) for a comparison of bits between two runs. On CuPy every product is one
cuBLAS call (flat); the strict test backend runs exactly NumPy's calls on the data it wraps
(backend.numpy_kernel).
"""
import os
import time

import numpy as np

from minitransformer.backend import BACKEND, numpy_kernel, xp

ROUTES = ("flat", "rows", "slices", "dots")
ONE_ROW = ("flat", "slices", "dots")  # for one row, `rows` is `flat`'s own matrix-vector call
FEW_ROWS = 16            # up to this many rows, the way is measured; above it, flat
FIXED = os.environ.get("MT_PRODUCTS", "").strip().lower() or None
if FIXED is not None and FIXED not in ROUTES:
    raise ValueError(f"MT_PRODUCTS={FIXED!r} is not a way to multiply: use one of "
                     f"{', '.join(ROUTES)}, or leave it unset to measure")
TRIALS = 3               # timings per way when a shape is measured (the fastest counts)
COLD_BYTES = 1 << 20     # a weight this large is timed from memory, as a decode step reads it
FLUSH_BYTES = 1 << 27    # read between timings of a large weight: above the CPU's caches
flush = None             # FLUSH_BYTES of ones, allocated on the first large weight's timing
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
    """The way M rows of x multiply w here: flat for more than FEW_ROWS rows; for 1..FEW_ROWS,
    FIXED, or the way measured fastest the first time this shape came."""
    M = len(x)
    if M > FEW_ROWS:
        return "flat"
    if FIXED is not None:
        return FIXED
    key = (M, *w.shape, x.dtype.str, w.dtype.str)
    if key not in chosen:
        chosen[key] = fastest(x, w)
    return chosen[key]


def candidates(M: int) -> tuple:
    """The ways worth timing for M rows: every way, but for one row `rows` is `flat`."""
    return ONE_ROW if M == 1 else ROUTES


def fastest(x, w) -> str:
    """Time the ways for len(x) rows on these operands (TRIALS each, interleaved) -> the fastest.

    `rows` and `dots` make M alike passes over w: timed as one of them, times M (on a large
    matrix, such as a vocabulary's head, that keeps the measuring short). A weight of
    COLD_BYTES or more is timed from memory: FLUSH_BYTES of other data are read before each
    timing, so no way is timed on a w the previous one left in the cache (one buffer for the
    process, flush_buffer(), not one per shape measured)."""
    out = np.empty((len(x), len(w)), np.result_type(x, w))
    calls = {"flat": lambda: flat(x, w, out), "rows": lambda: rows(x[:1], w, out),
             "slices": lambda: slices(x, w, out), "dots": lambda: dots(x[:1], w, out)}
    ways = candidates(len(x))
    cold = w.nbytes >= COLD_BYTES
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(TRIALS):
        for route in ways:
            if cold:
                flush_caches(flush_buffer())
            start = time.perf_counter()
            calls[route]()
            best[route] = min(best[route], time.perf_counter() - start)
    for route in {"rows", "dots"} & set(ways):
        best[route] *= len(x)
    return min(ways, key=best.get)


def flush_buffer():
    """The data read to flush the caches: FLUSH_BYTES, allocated once, when first needed, and
    kept for the process (a model's weights take up to a few dozen shapes to measure)."""
    global flush
    if flush is None:
        flush = np.ones(FLUSH_BYTES // 4, np.float32)
    return flush


def flush_caches(buffer):
    """Read a buffer larger than the CPU's caches: what they held before is gone from them."""
    np.dot(buffer, buffer)


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


def dots(x, w, out):
    """One dot product per row of w for each row of x: w[n] . x[m] is out[m, n].

    NumPy's matmul over a stack of (1, in) @ (in, 1) products makes each a BLAS dot product,
    in one call per row of x."""
    for m in range(len(x)):
        np.matmul(w[:, None, :], x[m, :, None], out=out[m, :, None, None])  # (n, 1, 1)
    return out


CALLS = {"flat": flat, "rows": rows, "slices": slices, "dots": dots}

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
