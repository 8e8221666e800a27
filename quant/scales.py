"""What every quantizer shares: the checked matrix, each territory's absmax, float16 scales.

Serves absmax.py and nf4.py (experiments 15, 16, 21). A quantizer picks a territory (the
whole matrix, a row, `group` consecutive weights of a row), finds the largest |w| in each,
turns it into a float16 scale, rounds every weight to a code, and hands the codes to `build`,
which packs them into a QWeight and measures the reconstruction error.
Leaves out: zero points (asymmetric schemes), scales chosen by search (GPTQ, AWQ).
"""
from dataclasses import replace

import numpy as np

from minitransformer.backend import to_device, to_numpy
from minitransformer.shape import ceil_div
from quant.packing import pack_nibbles
from quant.qweight import QWeight


def check_weight(w) -> np.ndarray:
    """Any backend array -> a float32 host matrix (out, in), or a ValueError saying why not."""
    w = to_numpy(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix (out, in), got shape {w.shape}")
    if w.size == 0:
        raise ValueError(f"cannot quantize an empty matrix of shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"expected a float matrix, got dtype {w.dtype}")
    bad = ~np.isfinite(w)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"weight [{i}, {j}] is {w[i, j]}: cannot quantize inf or nan "
                         f"({int(bad.sum())} non-finite values in the matrix)")
    return w.astype(np.float32, copy=False)


def group_absmax(w: np.ndarray, group: int) -> np.ndarray:
    """(out, in) -> (out, ceil(in/group)): max |w| over each run of `group` weights of a row.

    A row whose length is not a multiple of the group ends with a shorter group (padded with
    zeros here, which cannot change a maximum), with its own scale.

    >>> group_absmax(np.array([[1., -5., 2., 3., -4.]], np.float32), 2)
    array([[5., 3., 4.]], dtype=float32)
    """
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group size must be a positive integer, got {group!r}")
    out, cols = w.shape
    n_groups = ceil_div(cols, group)
    padded = np.zeros((out, n_groups * group), np.float32)
    padded[:, :cols] = np.abs(w)
    return padded.reshape(out, n_groups, group).max(axis=2)


def float16_scales(absmax: np.ndarray, top: float) -> np.ndarray:
    """Scales that map each absmax onto the top level, stored as float16.

    Rounding to float16 may land just below absmax / top; then the largest weight would need
    a level above the top and be clipped, so such scales are bumped up one float16 step.
    """
    with np.errstate(over="ignore"):  # overflow is reported below, by name
        scale = (absmax / np.float32(top)).astype(np.float16)
        short = scale.astype(np.float32) * np.float32(top) < absmax
        scale = np.where(short, np.nextafter(scale, np.float16(np.inf)), scale)
    if np.isinf(scale).any():
        raise ValueError(f"a scale of {absmax.max() / top:.4g} does not fit in float16 "
                         "(weights beyond ~65,000 x the top level)")
    return scale


def expand(scales: np.ndarray, group: int, cols: int) -> np.ndarray:
    """(out, G) float16 -> float32 (out, cols): each weight's own scale, on the host."""
    return np.repeat(scales.astype(np.float32), group, axis=1)[:, :cols]


SHARED_LEVELS: dict = {}  # id of a host level table -> (the table, its one device copy)


def shared_on_device(levels: np.ndarray):
    """The device copy of a level table, made once. to_device copies on a GPU: called per
    matrix it would hold one table per matrix, where the chapter counts one for the model.
    (The host table is kept in the dict too, so its id cannot be reused by another.)"""
    if id(levels) not in SHARED_LEVELS:
        SHARED_LEVELS[id(levels)] = (levels, to_device(levels))
    return SHARED_LEVELS[id(levels)][1]


def build(scheme, w, codes, scales, group, bits, levels) -> QWeight:
    """Pack the codes (out, in) uint8, move everything to the backend, measure the error."""
    flat = codes.reshape(-1)
    q = QWeight(scheme=scheme, shape=tuple(w.shape), bits=bits, group=group,
                codes=to_device(flat if bits == 8 else pack_nibbles(flat)),
                scales=to_device(scales), levels=shared_on_device(levels))
    return replace(q, error=relative_error(w, to_numpy(q.dequantize())))


def relative_error(w: np.ndarray, w_hat: np.ndarray) -> float:
    """||W - W_hat|| / ||W|| (Frobenius); 0 for an all-zero W, which every scheme keeps exact."""
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - w_hat)) / norm if norm > 0 else 0.0
