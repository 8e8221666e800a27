"""How a projection multiplies: x @ w.T, for a batch, one row, a few rows or quantized weights.

Serves every forward pass (model.py) and experiment 12 (batching). A decode step is a string of
products of a weight matrix with a few vectors, and how they go into BLAS decides what a step
costs: one flat matrix for the whole batch reads each weight once (what batching buys); a few
rows go in slices that OpenBLAS multiplies without repacking the weights; a quantized weight
multiplies itself from its codes (quant/matmul.py).
"""
from minitransformer.backend import BACKEND, xp


def is_quantized(w) -> bool:
    """Is w held as codes and scales (a quant.QWeight) rather than as a float array?

    The one test for it: a weight that is not an array multiplies itself (`w.matmul(x)`).
    """
    return not isinstance(w, xp.ndarray)


def linear(x, w, bias=None, per_row=False):
    """x (B, T, in) @ w (out, in).T + b -> (B, T, out). A quantized weight multiplies itself.

    By default the B x T vectors go in as one flat (B*T, in) matrix: every weight is read once
    for the whole batch, which is what batching buys (a decode step reads weights, and one
    read now serves B tokens). per_row=True multiplies each row's (T, in) on its own, by the
    same call a batch of one would make: B reads of every weight, but each row gets the very
    bits it gets alone. BLAS chooses its kernel, and so the order of its sums, by the number
    of rows M; with OpenBLAS a row's bits change between M = 1, 2, 16 and 32, so no flat
    shape is batch-invariant.

    Two to FEW_ROWS vectors go through few_rows_matmul; one vector, or many (a prefill), as
    w @ x.T transposed back: the same numbers, and with many vectors OpenBLAS runs it faster
    that way round than x @ w.T (measured 1.3x at 64 and 1.6x at 256 vectors on a (9728, 896)
    matrix); one vector makes the same matrix-vector product either way.
    """
    if per_row and len(x) > 1:  # each row exactly as alone: the very call a batch of one makes
        return xp.concatenate([linear(x[b:b + 1], w, bias) for b in range(len(x))])
    flat = x.reshape(-1, x.shape[-1])                            # (B*T, in)
    if is_quantized(w):
        y = w.matmul(flat)
    elif 1 < len(flat) <= FEW_ROWS and BACKEND == "numpy":
        y = few_rows_matmul(flat, w)
    else:
        y = (w @ flat.T).T                                       # (out, B*T) -> (B*T, out)
    y = y.reshape(*x.shape[:-1], y.shape[-1])                    # (B, T, out)
    return y if bias is None else y + bias


FEW_ROWS = 16            # up to this many rows, few_rows_matmul beats one flat product
# OpenBLAS (x86-64, AVX-512) multiplies without repacking when its small-matrix kernel is
# permitted: M*N*K <= 10**6 and, for our x @ w.T, M*N <= 1200 (sgemm_small_kernel_permit).
SMALL_PRODUCT, SMALL_OUTPUT = 10 ** 6, 1200


def few_rows_block(M: int, cols: int) -> int:
    """Weight rows per BLAS call when M rows of `cols` multiply a slice of w (few_rows_matmul).

    >>> few_rows_block(4, 576), few_rows_block(16, 576), few_rows_block(16, 4864)
    (300, 75, 12)
    """
    return max(1, min(SMALL_PRODUCT // (M * cols), SMALL_OUTPUT // M))


def few_rows_matmul(x, w, out=None):
    """x (M, in) @ w (n, in).T -> out (M, n) for a few rows M (2..16), a slice of w at a time.

    On a CPU, OpenBLAS's matrix-matrix product repacks every panel of w before it multiplies,
    a second pass over the weights that one matrix-vector product never pays: measured on
    SmolLM2, 5 rows cost 3 to 4 single-row products. A product small enough for its
    small-matrix kernel (few_rows_block) multiplies in place, and 4 rows then cost about 1.5
    single-row products (speculative verification, small batches, quantized blocks). The sums
    are BLAS's either way: the same numbers up to summation order.
    """
    n, cols = w.shape
    if out is None:
        out = xp.empty((len(x), n), dtype=xp.result_type(x, w))        # (M, n)
    rows = few_rows_block(len(x), cols)
    for r0 in range(0, n, rows):
        xp.matmul(x, w[r0:r0 + rows].T, out=out[:, r0:r0 + rows])
    return out
