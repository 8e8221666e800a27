"""INT8 activations: values rounded onto the grid of one absmax scale, kept in float units.

Serves experiments 19 (levels used), 20 (W8A8 techniques) and 21 (LLM.int8 on a quantized
model). One rule, three territories for the scale: the whole tensor (`fake_int8` with one
scale), each token (`int8_activations`, vector-wise), and each token without its outlier
columns (`int8_activations` with a threshold: LLM.int8's mixed-precision decomposition).
"Fake" quantization: the codes times the scale, back in float32. A real kernel multiplies the
INT8 codes as integers and scales the sum once, which gives the same numbers up to float
rounding.
Leaves out: asymmetric (zero-point) activation quantization, static calibrated scales.
"""
from minitransformer.backend import xp


def int8_codes(x, scale):
    """x and a scale that broadcasts to it -> round(x / scale) clipped to -128..127, as floats.

    A zero scale (an all-zero territory) gives code 0. Works on host or device arrays alike.

    >>> import numpy as np
    >>> int8_codes(np.array([0.26, -1.0, 2.0]), 2.0 / 127)
    array([ 17., -64., 127.])
    """
    safe = scale + (scale == 0)  # scale, or 1 where it is 0: the codes are then all 0
    return (x / safe).round().clip(-128, 127)


def fake_int8(x, scale):
    """x -> x on the INT8 grid of `scale` (one number, or one per token (..., 1))."""
    return int8_codes(x, scale) * scale


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
    return xp.where(outlier, x, fake_int8(regular, scale)).astype(x.dtype)
