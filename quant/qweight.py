"""The quantized weight: a matrix held as small integer codes plus scales, never as floats.

Serves experiments 15 (memory is `.nbytes` of what is held), 16 (`.error`) and 21 (the model
runs on these). Every scheme in quant/ is the same three things:

    code  -> level    a table of 2**bits levels (evenly spaced for absmax, normal quantiles
                      for NF4), in units of the scale
    level -> weight   times the scale of the code's group: `group` consecutive weights of a
                      row share one float16 scale (group = in for one scale per row; one
                      scale for the whole matrix is scales of shape (1, 1))

8-bit codes are one uint8 each; 4-bit codes are packed two per byte (packing.py). `matmul`
dequantizes the whole matrix into a float32 temporary, multiplies, and drops it: only the
codes and scales stay resident. With `outlier_threshold` set it also quantizes the
activations to INT8 per token, keeping the input columns whose magnitude passes the threshold
in float (LLM.int8's mixed-precision decomposition, simulated in float32: real kernels run
the INT8 part as an integer matmul, which gives the same numbers up to float rounding).
Leaves out: integer kernels, zero points (asymmetric schemes), double quantization of scales.
"""
from dataclasses import dataclass, field, replace

import numpy as np

from minitransformer.backend import to_device, to_numpy, xp
from quant.packing import pack_nibbles, unpack_nibbles


@dataclass(frozen=True)
class QWeight:
    scheme: str          # e.g. "INT4 group-128"
    shape: tuple         # (out, in) of the float matrix this stands for
    bits: int            # 8 or 4 bits per code
    group: int           # consecutive weights of a row that share one scale
    codes: object = field(repr=False)   # uint8 (out*in,) for 8 bits;
    #                                     (ceil(out*in/2),) for 4 bits, two codes per byte
    scales: object = field(repr=False)  # float16 (out, ceil(in/group)), or (1, 1) per tensor
    levels: object = field(repr=False)  # float32 (2**bits,): each code's value, in scale units
    error: float = 0.0   # ||W - W_hat|| / ||W||, measured when the matrix was quantized
    outlier_threshold: float | None = None  # None: weight-only; else INT8 activations too

    @property
    def nbytes(self) -> int:
        """Bytes held for this matrix: the codes and the scales (levels are shared)."""
        return int(self.codes.nbytes + self.scales.nbytes)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def unpacked_codes(self):
        """-> uint8 (out*in,): one code per weight, as the quantizer chose it."""
        n = self.shape[0] * self.shape[1]
        if self.bits == 8:
            return self.codes
        return unpack_nibbles(self.codes, n, xp.arange(16, dtype=xp.uint8))

    def dequantize(self):
        """-> float32 (out, in) on the backend: level of each code times its group's scale."""
        out, cols = self.shape
        if self.bits == 8:
            values = xp.take(self.levels, self.codes)                       # (out*in,)
        else:
            values = unpack_nibbles(self.codes, out * cols, self.levels)    # (out*in,)
        scale = xp.repeat(self.scales.astype(xp.float32), self.group, axis=1)[:, :cols]
        return values.reshape(out, cols) * scale                            # (out, in)

    def matmul(self, x):
        """x (..., in) @ W_hat.T -> (..., out). The float matrix lives only inside this call."""
        if self.outlier_threshold is not None:
            x = int8_activations(x, self.outlier_threshold)
        return x @ self.dequantize().T


def int8_activations(x, threshold: float):
    """x (..., in) -> x with every value on its token's INT8 grid, except outlier columns.

    A column (input feature) is an outlier when any token's |x| in it exceeds `threshold`;
    those stay in float. The rest get one absmax scale per token (vector-wise quantization).
    threshold = inf quantizes every column: plain W8A8, no decomposition.
    """
    flat = x.reshape(-1, x.shape[-1])                                       # (N, in)
    outlier = xp.abs(flat).max(axis=0) > threshold                          # (in,)
    regular = xp.where(outlier, 0, x)                                       # (..., in)
    scale = xp.abs(regular).max(axis=-1, keepdims=True) / 127               # (..., 1)
    scale = xp.where(scale == 0, 1, scale)      # an all-zero token: any scale gives zeros
    fake = xp.round(regular / scale) * scale    # on the INT8 grid, back in float units
    return xp.where(outlier, x, fake).astype(x.dtype)


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
    """
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group size must be a positive integer, got {group!r}")
    out, cols = w.shape
    n_groups = -(-cols // group)
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


def build(scheme, w, codes, scales, group, bits, levels) -> QWeight:
    """Pack the codes (out, in) uint8, move everything to the backend, measure the error."""
    flat = codes.reshape(-1)
    q = QWeight(scheme=scheme, shape=tuple(w.shape), bits=bits, group=group,
                codes=to_device(flat if bits == 8 else pack_nibbles(flat)),
                scales=to_device(scales), levels=to_device(levels))
    return replace(q, error=relative_error(w, to_numpy(q.dequantize())))


def relative_error(w: np.ndarray, w_hat: np.ndarray) -> float:
    """||W - W_hat|| / ||W|| (Frobenius); 0 for an all-zero W, which every scheme keeps exact."""
    norm = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - w_hat)) / norm if norm > 0 else 0.0
