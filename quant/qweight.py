"""The quantized weight: a matrix held as small integer codes plus scales, never as floats.

Serves experiments 15 (memory is `.nbytes` of what is held), 16 (`.error`) and 21 (the model
runs on these). Every scheme in quant/ is the same three things:

    code  -> level    a table of 2**bits levels (evenly spaced for absmax, normal quantiles
                      for NF4), in units of the scale
    level -> weight   times the scale of the code's group: `group` consecutive weights of a
                      row share one float16 scale (group = in for one scale per row; one
                      scale for the whole matrix is scales of shape (1, 1))

8-bit codes are one uint8 each; 4-bit codes are packed two per byte (packing.py).
`dequantize` is the specification: the whole float matrix. `matmul` gives the same numbers
(up to float summation order) without ever holding it: it converts a block of rows at a time
into a small reusable buffer (matmul.py), so only the codes and scales stay resident and a
decode step runs near the speed of the float one. With `outlier_threshold` set it also
quantizes the activations to INT8 per token, keeping the input columns whose magnitude
passes the threshold in float (LLM.int8's mixed-precision decomposition, int8.py).
The quantizers that make QWeights are absmax.py and nf4.py (their shared steps: scales.py).
Leaves out: integer kernels, zero points (asymmetric schemes), double quantization of scales.
"""
from dataclasses import dataclass, field

from minitransformer.backend import Array, xp
from quant.int8 import int8_activations
from quant.matmul import blocked_matmul
from quant.packing import unpack_nibbles


@dataclass(frozen=True)
class QWeight:
    scheme: str          # e.g. "INT4 group-128"
    shape: tuple         # (out, in) of the float matrix this stands for
    bits: int            # 8 or 4 bits per code
    group: int           # consecutive weights of a row that share one scale
    codes: Array = field(repr=False)    # uint8 (out*in,) for 8 bits;
    #                                     (ceil(out*in/2),) for 4 bits, two codes per byte
    scales: Array = field(repr=False)   # float16 (out, ceil(in/group)), or (1, 1) per tensor
    levels: Array = field(repr=False)   # float32 (2**bits,): each code's value, in scale units
    error: float = 0.0   # ||W - W_hat|| / ||W||, measured when the matrix was quantized
    outlier_threshold: float | None = None  # None: weight-only; else INT8 activations too

    @property
    def nbytes(self) -> int:
        """Bytes held for this matrix: the codes and the scales (levels are shared)."""
        return int(self.codes.nbytes + self.scales.nbytes)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def buffers(self) -> dict:
        """What is held, by kind (qmodel.resident_bytes): codes and scales; the shared table."""
        return {"projections": [self.codes, self.scales], "levels": [self.levels]}

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
        """x (..., in) @ W_hat.T -> (..., out), W_hat = dequantize(), never held whole."""
        if self.outlier_threshold is not None:
            x = int8_activations(x, self.outlier_threshold)
        return blocked_matmul(self, x)
