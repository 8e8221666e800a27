"""The quantizers: absmax per tensor / row / group at 8 and 4 bits, NF4, and 4-bit packing.

Exact things with ==: the NF4 levels against the published table, packing round trips, bytes
and bits per weight. Approximate things by their bound: every weight within half a step of its
reconstruction (absmax) or on its nearest level (NF4)."""
import numpy as np
import pytest

from minitransformer.backend import to_device, to_numpy
from quant.absmax import absmax_per_group, absmax_per_row, absmax_per_tensor
from quant.nf4 import NF4_LEVELS, nf4
from quant.packing import pack_nibbles, unpack_nibbles
from quant.scales import expand, float16_scales, relative_error

# QLoRA appendix E / bitsandbytes' hard-coded NF4 table, as published (float32 values).
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]

ABSMAX = {
    "int8-tensor": lambda w: absmax_per_tensor(w, 8),
    "int8-row": lambda w: absmax_per_row(w, 8),
    "int8-g32": lambda w: absmax_per_group(w, 8, 32),
    "int4-tensor": lambda w: absmax_per_tensor(w, 4),
    "int4-row": lambda w: absmax_per_row(w, 4),
    "int4-g128": lambda w: absmax_per_group(w, 4, 128),
    "int4-g48-ragged": lambda w: absmax_per_group(w, 4, 48),  # 200 = 4 x 48 + 8
}


def weights(shape=(24, 200), seed=0):
    """Normal weights with a few outliers, as trained matrices have."""
    rng = np.random.default_rng(seed)
    w = 0.02 * rng.standard_normal(shape).astype(np.float32)
    w[rng.integers(0, shape[0], 5), rng.integers(0, shape[1], 5)] *= 25
    return w


def codes_and_scale(q, w):
    """-> (signed integer codes (out, in), each weight's scale (out, in)) of an absmax QWeight.

    The codes are read as two's complement here, not through q.levels: that pins the storage."""
    raw = to_numpy(q.unpacked_codes()).astype(np.int32).reshape(w.shape)
    codes = np.where(raw >= 2 ** (q.bits - 1), raw - 2 ** q.bits, raw)
    return codes, np.broadcast_to(expand(to_numpy(q.scales), q.group, w.shape[1]), w.shape)


@pytest.mark.parametrize("scheme", sorted(ABSMAX))
def test_absmax_round_trip_within_half_a_step(scheme):
    w = weights()
    q = ABSMAX[scheme](w)
    w_hat = to_numpy(q.dequantize())
    codes, scale = codes_and_scale(q, w)
    qmax = 2 ** (q.bits - 1) - 1
    assert np.abs(codes).max() <= qmax                     # symmetric: -qmax-1 never used
    assert np.all(np.abs(w - w_hat) <= 0.5 * scale * (1 + 1e-6))
    np.testing.assert_array_equal(w_hat, codes * scale)   # dequantize = code x scale, exactly
    assert q.error == pytest.approx(relative_error(w, w_hat), rel=1e-12)


@pytest.mark.parametrize("scheme", sorted(ABSMAX))
def test_largest_weight_of_each_territory_gets_the_top_code(scheme):
    """The float16 scale is rounded up when needed, so the absmax is never clipped."""
    w = weights(seed=1)
    q = ABSMAX[scheme](w)
    codes, scale = codes_and_scale(q, w)
    qmax = 2 ** (q.bits - 1) - 1
    i = np.unravel_index(np.abs(w).argmax(), w.shape)
    assert abs(codes[i]) == qmax
    assert np.all(scale * qmax >= np.abs(w))


def test_float16_scales_never_round_below_absmax():
    absmax = np.random.default_rng(2).uniform(1e-4, 10, 100_000).astype(np.float32)
    for top in (127, 7, 1):
        scales = float16_scales(absmax, top)
        assert scales.dtype == np.float16
        assert np.all(scales.astype(np.float32) * top >= absmax)
        # and never more than one float16 step above the exact scale
        assert np.all(np.nextafter(scales, np.float16(0)).astype(np.float32) * top < absmax)


def test_nf4_levels_equal_the_published_table():
    assert NF4_LEVELS.dtype == np.float32
    np.testing.assert_array_equal(NF4_LEVELS, np.array(PUBLISHED_NF4, dtype=np.float32))


def test_nf4_levels_shape_of_the_definition():
    assert NF4_LEVELS[7] == 0.0 and NF4_LEVELS[0] == -1.0 and NF4_LEVELS[-1] == 1.0
    assert np.all(np.diff(NF4_LEVELS) > 0)
    assert (NF4_LEVELS > 0).sum() == 8 and (NF4_LEVELS < 0).sum() == 7  # asymmetric: exact zero


def test_nf4_picks_the_nearest_level_of_each_block():
    w = weights(shape=(16, 200))  # 200 = 3 x 64 + 8: a short last block per row
    q = nf4(w, 64)
    scale = expand(to_numpy(q.scales), 64, w.shape[1])
    codes = to_numpy(q.unpacked_codes()).reshape(w.shape)
    x = w / scale
    chosen = np.abs(x - NF4_LEVELS[codes])
    best = np.abs(x[..., None] - NF4_LEVELS).min(axis=-1)
    np.testing.assert_allclose(chosen, best, atol=1e-7)
    np.testing.assert_array_equal(to_numpy(q.dequantize()), NF4_LEVELS[codes] * scale)
    assert np.abs(x).max() <= 1.0


def test_nf4_beats_int4_group_on_normal_weights():
    w = 0.02 * np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    assert nf4(w, 64).error < absmax_per_group(w, 4, 64).error


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 1001])
def test_packing_is_lossless(n):
    codes = np.random.default_rng(n).integers(0, 16, n).astype(np.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == np.uint8 and packed.shape == ((n + 1) // 2,)
    codes_table = to_device(np.arange(16, dtype=np.uint8))
    back = to_numpy(unpack_nibbles(to_device(packed), n, codes_table))
    np.testing.assert_array_equal(back, codes)


def test_packing_layout_low_nibble_first():
    np.testing.assert_array_equal(pack_nibbles([1, 2, 15, 0, 7]), [0x21, 0x0F, 0x07])
    levels = np.arange(16, dtype=np.float32) * 10
    packed = to_device(np.array([0x21], np.uint8))
    np.testing.assert_array_equal(to_numpy(unpack_nibbles(packed, 2, to_device(levels))),
                                  [10.0, 20.0])


def test_packing_rejects_bad_codes_and_sizes():
    with pytest.raises(ValueError, match="0..15"):
        pack_nibbles([3, 16])
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_nibbles(np.zeros(3, np.uint8), 8, np.arange(16))


@pytest.mark.parametrize("make, bits_per_weight, nbytes", [
    (lambda w: absmax_per_group(w, 4, 128), 4.125, 64 * 256 // 2 + 2 * 64 * 2),
    (lambda w: nf4(w, 64), 4.25, 64 * 256 // 2 + 2 * 64 * 4),
    (lambda w: absmax_per_row(w, 8), 8 + 16 / 256, 64 * 256 + 2 * 64),
    (lambda w: absmax_per_row(w, 4), 4 + 16 / 256, 64 * 256 // 2 + 2 * 64),
    (lambda w: absmax_per_tensor(w, 8), 8 + 16 / (64 * 256), 64 * 256 + 2),
    (lambda w: absmax_per_tensor(w, 4), 4 + 16 / (64 * 256), 64 * 256 // 2 + 2),
])
def test_bits_per_weight_are_exact(make, bits_per_weight, nbytes):
    q = make(weights(shape=(64, 256)))
    assert q.nbytes == nbytes
    assert q.bits_per_weight == bits_per_weight
    assert q.scales.dtype == np.float16 and q.codes.dtype == np.uint8


def test_odd_weight_count_packs_into_half_a_byte_each_rounded_up():
    q = absmax_per_row(weights(shape=(3, 5)), 4)
    assert q.codes.nbytes == 8 and q.nbytes == 8 + 3 * 2


def test_int8_per_row_beats_per_tensor_on_a_matrix_with_one_huge_outlier():
    w = 0.02 * np.random.default_rng(4).standard_normal((64, 256)).astype(np.float32)
    w[10, 20] = 50.0
    tensor, row = absmax_per_tensor(w, 8), absmax_per_row(w, 8)
    assert row.error < tensor.error / 5  # (the outlier itself dominates ||W||: a modest ratio)
    # the outlier's own row pays; every other row is reconstructed far better
    err_rows = np.abs(w - to_numpy(row.dequantize())).max(axis=1)
    err_tensor = np.abs(w - to_numpy(tensor.dequantize())).max(axis=1)
    assert np.all(np.delete(err_rows, 10) < np.delete(err_tensor, 10) / 100)


@pytest.mark.parametrize("quantize", list(ABSMAX.values()) + [lambda w: nf4(w, 64)])
def test_all_zero_rows_groups_and_matrices(quantize):
    w = weights(shape=(6, 200))
    w[2] = 0.0          # an all-zero row
    w[4, :64] = 0.0     # an all-zero group/block at the start of a row
    q = quantize(w)
    w_hat = to_numpy(q.dequantize())
    assert np.all(np.isfinite(w_hat)) and np.all(np.isfinite(to_numpy(q.scales)))
    np.testing.assert_array_equal(w_hat[2], 0.0)
    zero = quantize(np.zeros((4, 64), np.float32))
    np.testing.assert_array_equal(to_numpy(zero.dequantize()), 0.0)
    assert zero.error == 0.0


def test_group_not_dividing_the_row_gets_its_own_scale():
    w = weights(shape=(3, 200))
    q = absmax_per_group(w, 4, 128)
    scales = to_numpy(q.scales).astype(np.float32)
    assert scales.shape == (3, 2)
    assert np.all(scales[:, 1] * 7 >= np.abs(w[:, 128:]).max(axis=1))
    assert np.all(np.nextafter(to_numpy(q.scales)[:, 1], np.float16(0)).astype(np.float32) * 7
                  < np.abs(w[:, 128:]).max(axis=1))


@pytest.mark.parametrize("quantize", list(ABSMAX.values()) + [lambda w: nf4(w, 64)])
def test_negative_zero_is_zero(quantize):
    w = weights(shape=(2, 64))
    w[0, :4] = [0.0, -0.0, 0.0, -0.0]
    q = quantize(w)
    codes = to_numpy(q.unpacked_codes()).reshape(w.shape)
    assert codes[0, 0] == codes[0, 1] == codes[0, 2] == codes[0, 3]
    np.testing.assert_array_equal(to_numpy(q.dequantize())[0, :4], 0.0)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("quantize", [lambda w: absmax_per_row(w, 8), lambda w: nf4(w)])
def test_inf_or_nan_is_a_clear_error(bad, quantize):
    w = weights(shape=(4, 64))
    w[2, 7] = bad
    with pytest.raises(ValueError, match=r"weight \[2, 7\] is .*inf or nan"):
        quantize(w)


def test_bad_arguments_are_clear_errors():
    w = weights(shape=(4, 64))
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        absmax_per_row(w, 3)
    with pytest.raises(ValueError, match="group size"):
        absmax_per_group(w, 4, 0)
    with pytest.raises(ValueError, match="2-D"):
        absmax_per_row(w[0], 8)
    with pytest.raises(ValueError, match="float"):
        absmax_per_row(w.astype(np.int32), 8)
    with pytest.raises(ValueError, match="float16"):
        absmax_per_tensor(np.full((2, 2), 1e7, np.float32), 8)
