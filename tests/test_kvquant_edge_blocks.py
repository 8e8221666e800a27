"""Quantized cache blocks at the edges of float16's scale: an all-zero block (scale 0) and a
block so small that its scale is a float16 subnormal, rounded by up to half its own size, so
that x / s lands past the format's last code unless it is clipped there."""
import warnings

import numpy as np
import pytest

from minitransformer.backend import to_numpy, xp
from minitransformer.kvquant import dequantize, quantize

SUBNORMAL = 2.0 ** -24      # float16's smallest subnormal, the spacing of its tiny numbers


@pytest.mark.parametrize("kv_dtype, zero_code", [("q8_0", 0), ("q4_0", 8 | 8 << 4)])
def test_an_all_zero_block_gets_the_code_of_zero_without_a_warning(kv_dtype, zero_code):
    """Scale 0: the codes are those of 0 (q4_0: nibble 8 in both halves of each byte), not
    whatever a 0 / 0 = NaN becomes when cast to an integer, and numpy warns of nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held = quantize(xp.zeros((2, 64), xp.float32), kv_dtype)
    assert (to_numpy(held.codes) == zero_code).all()


def alternating(value, d=32):
    """One block: value, -value, value, ..."""
    x = np.full((1, d), value, np.float32)
    x[0, 1::2] = -value
    return x


def test_q8_0_codes_stay_in_minus_127_to_127_when_the_scale_rounds_down():
    """max|x| / 127 = 1.4 subnormal steps, which float16 rounds to 1: x / s is then about
    +-178. The codes must stop at +-127, symmetric (not wrap around int8, nor reach -128)."""
    held = quantize(alternating(127 * 1.4 * SUBNORMAL), "q8_0")
    assert float(to_numpy(held.scales)[0, 0]) == SUBNORMAL       # the rounding this needs
    np.testing.assert_array_equal(to_numpy(held.codes)[0], [127, -127] * 16)
    back = to_numpy(dequantize(held))[0]
    np.testing.assert_array_equal(np.sign(back), np.sign(alternating(1.0)[0]))


def test_q4_0_codes_stay_in_their_nibble_when_the_scale_rounds_down():
    """The widest x / -8 = 1.4 subnormal steps, rounded to 1: x / s is about -11 and +11.
    The widest must land on code 0 (-8) and its opposite on 15 (+7), so every value keeps
    its sign (a code below 0 would wrap to 13..15, above 15 spill into the other nibble)."""
    x = alternating(8 * 1.4 * SUBNORMAL)
    held = quantize(x, "q4_0")
    assert abs(float(to_numpy(held.scales)[0, 0])) == SUBNORMAL
    back = to_numpy(dequantize(held))[0]
    np.testing.assert_array_equal(np.sign(back), np.sign(x[0]))
    s = abs(float(to_numpy(held.scales)[0, 0]))
    np.testing.assert_array_equal(np.abs(back), np.where(x[0] > 0, 8 * s, 7 * s))


def test_quantize_refuses_a_float_format_by_name():
    with pytest.raises(ValueError, match="'f16' is not a quantized format"):
        quantize(xp.zeros((1, 32), xp.float32), "f16")


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "q4_0"])
def test_attention_reads_float32_from_every_format(kv_dtype):
    """dequantize gives float32 whatever the store holds (not float16, nor float64)."""
    from minitransformer.kvquant import zeros
    held = zeros((2, 32), kv_dtype)
    held[0] = xp.asarray(alternating(0.5)[0])
    assert to_numpy(dequantize(held)).dtype == np.float32
