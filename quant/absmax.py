"""Symmetric absmax quantization at 8 and 4 bits, with one scale per tensor, row or group.

Serves experiments 15, 16 and 21. The chapter's three lines, for `bits`:

    qmax  = 2 ** (bits - 1) - 1
    scale = max |W| / qmax              over the scale's territory
    Wq    = round(W / scale).clamp(-qmax - 1, qmax),   W_hat = Wq * scale

The only difference between the three functions is the territory: the whole matrix, one
output row, or `group` consecutive weights of a row (128 by default, as in GPTQ/AWQ and most
4-bit formats). A smaller territory means an outlier sets the step for fewer neighbours,
paid for with one 16-bit scale per territory: 4 + 16/128 = 4.125 bits per weight at group 128.

Each function returns a QWeight: the packed codes, the float16 scales and the measured
relative error. A code is the integer's own low `bits` bits (two's complement: -1 is code
255 or 15), so it is a table index like NF4's, the table holding the signed integers, and
read as a signed number it is the integer itself (which quant/matmul.py uses). Symmetric absmax
never uses the most negative integer (-128 or -8): the grid is kept symmetric around zero.
Leaves out: asymmetric (zero-point) quantization, rounding other than to nearest.
"""
import numpy as np

from quant.packing import integer_levels
from quant.qweight import QWeight
from quant.scales import build, check_weight, expand, float16_scales, group_absmax


def absmax_per_tensor(w, bits: int) -> QWeight:
    """One scale for the whole matrix: its largest weight sets the step for all."""
    w = check_weight(w)
    absmax = np.abs(w).max().reshape(1, 1)            # (1, 1)
    return _quantize(w, bits, absmax, group=w.shape[1], label="per-tensor")


def absmax_per_row(w, bits: int) -> QWeight:
    """One scale per output row (per output channel)."""
    w = check_weight(w)
    return _quantize(w, bits, group_absmax(w, w.shape[1]), group=w.shape[1], label="per-row")


def absmax_per_group(w, bits: int, group: int = 128) -> QWeight:
    """One scale per `group` consecutive weights of a row; a short last group is allowed."""
    w = check_weight(w)
    return _quantize(w, bits, group_absmax(w, group), group=group, label=f"group-{group}")


# The table for code c is c read as a signed integer: 0..127, -128..-1 (or 0..7, -8..-1).
# One shared copy per width.
INTEGER_LEVELS = {bits: integer_levels(bits) for bits in (8, 4)}


def _quantize(w: np.ndarray, bits: int, absmax: np.ndarray, group: int, label: str) -> QWeight:
    """Codes and scales for given per-territory maxima absmax (out or 1, G)."""
    if bits not in INTEGER_LEVELS:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    levels = INTEGER_LEVELS[bits]
    qmax = 2 ** (bits - 1) - 1
    scales = float16_scales(absmax, qmax)               # (out or 1, G)
    scale = expand(scales, group, w.shape[1])           # (out or 1, in)
    safe = np.where(scale == 0, 1, scale)               # an all-zero territory: codes 0
    q = np.clip(np.round(w / safe), -qmax - 1, qmax)    # (out, in) integers, as float
    codes = (q.astype(np.int64) & (2 ** bits - 1)).astype(np.uint8)  # two's complement
    return build(f"INT{bits} {label}", w, codes, scales, group, bits, levels)
