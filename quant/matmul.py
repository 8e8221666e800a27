"""Multiplying by a quantized matrix without ever holding it in float: a block of rows at a time.

Serves experiments 21 and 22 and every quantized decode step. `QWeight.dequantize` is the
specification: level of each code times its group's scale, the whole (out, in) matrix in
float32. Multiplying through it costs more than the float model does, because every step
writes and re-reads 4 bytes per weight on top of reading the codes. Here the matrix is
converted a block of rows at a time into a small float buffer that stays in the CPU's cache,
multiplied, and the buffer reused for the next block: memory traffic is the codes (1 or 1/2
byte a weight), and the conversion runs at cache speed.

    for each block of ~512 KB of float rows:
        buffer <- levels of the block's codes        (integer grids: a cast, no table)
        y[:, block] = x @ buffer.T                    (per-row / per-tensor schemes)
        y[:, block] = sum over groups g of scale_g * (x_g @ buffer_g.T)   (group schemes)
                      (or, for many rows of x, a prefill: buffer *= its scales, one product)
    y *= each row's scale                             (per-row / per-tensor schemes)

Equal to `x @ dequantize().T` up to float summation order: the scale multiplies a sum of
products ((x . c) s) where the specification scales each weight first (x . (c s)).
The integer grids need no lookup: their codes are two's complement (quant/packing.py), so an
8-bit code read as a signed byte is its level, and a 4-bit code moved into the top half of a
byte is 16 x its level, two at a time in 16-bit integers. NF4's levels are a table, looked up
one byte (two codes) at a time: a gather, slower than a cast, which is why NF4 is the slowest
scheme here (a compiled kernel keeps its 16 levels in a SIMD register and looks them up at the
speed of a cast).
The cost that is left is NumPy's: the cast writes 4 bytes a weight into the buffer and BLAS
reads them back, at cache speed but not free, where a compiled kernel converts in registers.
Each block's product goes into BLAS by the route minitransformer/kernels/blas.py takes for its
shape (timed on the BLAS running here). The strict test backend runs this very code on the data
it wraps.
Leaves out: integer matmuls (the activations stay float), multithreaded blocks, CuPy (on a
GPU the whole-matrix path is used: bandwidth there makes the temporary cheap).
"""
import threading

import numpy as np

from minitransformer.backend import BACKEND, numpy_kernel
from minitransformer.kernels.blas import FEW_ROWS, numpy_multiply
from minitransformer.shape import ceil_div
from quant.packing import integer_levels

BLOCK_FLOATS = 1 << 17   # 512 KB of float32 per block: in L2, few Python steps (measured best)
_scratch = threading.local()  # one reusable buffer per thread (no page faults per call)
_tables: dict = {}            # id(levels) -> (levels, lookup table or None): lookup_table


def blocked_matmul(q, x):
    """x (..., in) @ q.dequantize().T -> (..., out), float32, a block of rows at a time."""
    if BACKEND == "cupy" or not fast_layout(q):
        return x @ q.dequantize().T                   # the specification, whole matrix
    return on_device(q, x)


def numpy_blocked_matmul(q, x):
    """blocked_matmul on NumPy arrays (under the strict backend: on the data it wraps)."""
    out, cols = q.shape
    table = lookup_table(q)
    xb = block_columns(q, table, x.reshape(-1, cols))                  # (M, in), block order
    y = np.empty((xb.shape[0], out), np.float32)                       # (M, out)
    rows = block_rows(cols)
    floats, ints = scratch(q, table, rows)
    per_row = q.group >= cols                         # one scale per row, or per tensor
    scales = q.scales.astype(np.float32)              # (out or 1, G), once per call
    for r0 in range(0, out, rows):
        r1 = min(out, r0 + rows)
        w = levels_block(q, r0, r1, table, floats, ints)  # (n, in) levels, in scale units
        if per_row:
            numpy_multiply(xb, w, y[:, r0:r1])
        elif len(xb) > FEW_ROWS:  # a prefill: one pass scaling the block, one large product
            w *= np.repeat(scales[r0:r1], q.group, axis=1)[:, :cols]
            numpy_multiply(xb, w, y[:, r0:r1])
        else:  # up to FEW_ROWS rows: faster than scaling the block (measured on OpenBLAS's
            #    SkylakeX and Haswell kernels alike, groups of 64 and 128, blocks of Qwen2.5)
            grouped_matmul(xb, w, scales[r0:r1], q.group, y[:, r0:r1])
    if per_row:
        y *= scales.reshape(1, -1)                    # (1, out) or (1, 1): scale outputs
    return y.reshape(x.shape[:-1] + (out,))


on_device = numpy_kernel(numpy_blocked_matmul)  # strict: NumPy's calls on the data it wraps


def grouped_matmul(x, w, scales, group: int, out):
    """x (M, in) @ (w times each group's scale).T -> out (M, n), with no pass over w.

    w (n, in) in scale units, scales (n, ceil(in/group)). One dot product per group (numpy's
    stacked matmul, a BLAS call a group), then each weighted by its scale and summed; a short
    last group (in not a multiple of group) is one more product.
    """
    n, cols = w.shape
    full = cols // group * group                                       # columns in whole groups
    G = full // group
    parts = np.matmul(w[:, :full].reshape(n, G, group).transpose(1, 0, 2),
                      x[:, :full].reshape(-1, G, group).transpose(1, 2, 0))   # (G, n, M)
    np.einsum("gnm,ng->mn", parts, scales[:, :G], out=out)
    if full < cols:
        out += (x[:, full:] @ w[:, full:].T) * scales[:, G]


def fast_layout(q) -> bool:
    """4 bits: rows of whole bytes (a byte's two codes in one row); 8 bits: always."""
    return q.bits == 8 or q.shape[1] % 2 == 0


def block_columns(q, table, x):
    """x (M, in) -> float32 (M, in) in the order and units `levels_block` gives the levels.

    For the INT4 grid a block holds 16 x each level, with each byte's two codes swapped (see
    levels_block): so x's pairs are swapped and x is divided by 16, a power of two, which
    changes no product's bits.
    """
    x = np.asarray(x, dtype=np.float32)
    if q.bits == 4 and table is None:
        return np.ascontiguousarray(x.reshape(len(x), -1, 2)[:, :, ::-1]).reshape(x.shape) / 16
    return np.ascontiguousarray(x)


def block_rows(cols: int) -> int:
    """Rows per block: ~BLOCK_FLOATS floats, and even, so a 4-bit block starts on a byte."""
    return max(2, BLOCK_FLOATS // cols // 2 * 2)


def buffer(n: int, dtype):
    """A scratch array of n elements, reused across calls on this thread (contents junk)."""
    held = getattr(_scratch, dtype.__name__, None)
    if held is None or held.size < n:
        held = np.empty(n, dtype)
        setattr(_scratch, dtype.__name__, held)
    return held[:n]


def lookup_table(q):
    """None for the integer grids (a cast does); else the levels (8 bits) or `pair_table`.

    Worked out once per levels array (the quantizers share one per scheme), not per call:
    a decode step makes hundreds of these calls. The cache holds the levels themselves, so
    their id cannot be reused by another array while the entry lives.
    """
    held = _tables.get(id(q.levels))
    if held is None:
        if len(_tables) > 64:   # levels made one per matrix (not by our quantizers)
            _tables.clear()
        grid = np.array_equal(q.levels, integer_levels(q.bits))
        held = (q.levels, None if grid else q.levels if q.bits == 8 else pair_table(q.levels))
        _tables[id(q.levels)] = held
    return held[1]


def scratch(q, table, rows: int):
    """-> (float32, uint16 or None) scratch for blocks of `rows` rows (see levels_block)."""
    n = rows * q.shape[1]
    return (buffer(2 * ceil_div(n, 2), np.float32),                    # room for a pad nibble
            buffer(ceil_div(n, 2), np.uint16) if q.bits == 4 and table is None else None)


def levels_block(q, r0: int, r1: int, table, floats=None, ints=None):
    """Rows r0:r1 of the matrix in units of their scales -> float32 (n, in), in `floats`.

    In natural order, except the INT4 grid: 16 x each level, each byte's two codes swapped.
    floats (and ints for the INT4 grid) is scratch from `scratch`, made here when not given.
    """
    cols = q.shape[1]
    n = r1 - r0
    if floats is None:
        floats, ints = scratch(q, table, n)
    w = floats[:n * cols].reshape(n, cols)
    if q.bits == 8:
        codes = q.codes[r0 * cols:r1 * cols]
        if table is None:        # a two's complement code, read as a signed byte, is its level
            np.copyto(w.reshape(-1), codes.view(np.int8), casting="unsafe")
        else:
            np.take(table, codes, out=w.reshape(-1), mode="clip")  # see below
        return w
    # 4 bits: byte i holds code 2i (low nibble) and code 2i+1 (high nibble). r0 is even, so
    # the block starts on a byte; an odd total leaves one padding nibble at the very end.
    first, last = r0 * cols // 2, ceil_div(r1 * cols, 2)
    packed = q.codes[first:last]                                       # (ceil(n*in/2),)
    if table is None:
        # A byte b = (hi << 4) | lo, each nibble a two's complement code. Widened to 16 bits
        # and multiplied by 0x1001, the low byte keeps b and the high byte receives lo << 4;
        # masking with 0xF0F0 leaves (hi << 4, lo << 4): two signed bytes worth 16 x each
        # level, in swapped order, which block_columns undoes on x.
        wide = ints[:last - first]
        np.copyto(wide, packed, casting="unsafe")
        np.multiply(wide, 0x1001, out=wide)  # wraps at 16 bits, on purpose
        np.bitwise_and(wide, 0xF0F0, out=wide)
        np.copyto(floats[:2 * (last - first)], wide.view(np.int8), casting="unsafe")
    else:                        # a table: one gather per byte gives both of its levels
        # mode="clip": a byte cannot index past 255, and NumPy's default bounds check
        # ("raise") makes this gather several times slower
        np.take(table, packed, out=floats[:2 * (last - first)].view(np.float64), mode="clip")
    return w


def pair_table(levels) -> np.ndarray:
    """(16,) levels -> (256,) float64 whose 8 bytes are (levels[b & 15], levels[b >> 4]).

    >>> t = pair_table(np.arange(16, dtype=np.float32))
    >>> t[0x3A:0x3B].view(np.float32)    # byte 0x3A: low nibble A (10), high nibble 3
    array([10.,  3.], dtype=float32)
    """
    byte = np.arange(256)
    pairs = np.stack([levels[byte & 15], levels[byte >> 4]], axis=1)   # (256, 2) float32
    return np.ascontiguousarray(pairs, dtype=np.float32).view(np.float64).reshape(256)
