"""GGUF's blocks beyond Q8_0/Q4_0/Q4_1 (Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K), decoded bit for bit.

Two references: the gguf package's own ``gguf.quants.dequantize`` on random bytes (every byte
pattern whose fp16 scales are finite, so every code, every 6-bit scale, every bit plane), and
blocks packed here by hand, one weight at a time from the layout llama.cpp's block structs
describe, whose weights are computed here from their chosen codes and scales.
"""
import numpy as np
import pytest

from minitransformer.formats.gguf_types import FORMATS, dequantize

gguf = pytest.importorskip("gguf")

# where each type keeps its fp16 numbers (scale d, minimum or dmin), from llama.cpp's structs
FP16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
           "IQ4_NL": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}
SIZES = {"Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18), "Q2_K": (256, 84),
         "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
NEW = tuple(SIZES)


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def reference(raw, type_name, shape):
    from gguf.quants import dequantize as theirs
    return theirs(raw, gguf.GGMLQuantizationType[type_name]).reshape(shape).astype(np.float32)


def finite_fp16(raw, type_name, block_bytes):
    """Random blocks with every fp16 number made finite (an exponent of all ones loses a bit)."""
    blocks = raw.reshape(-1, block_bytes)
    for at in FP16_AT[type_name]:
        high = blocks[:, at + 1]
        high[(high & 0x7C) == 0x7C] &= 0xFB
    return raw


def test_the_layouts_are_the_gguf_packages():
    for name, (weights, nbytes) in SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (weights, nbytes)
        assert FORMATS[name][:2] == (weights, nbytes)


@pytest.mark.parametrize("type_name", list(FP16_AT))
def test_random_bytes_decode_as_the_gguf_package_does(type_name):
    weights, nbytes = FORMATS[type_name][:2]
    rng = np.random.default_rng(7)
    rows, per_row = 64, 3                    # 192 blocks of random bytes, in rows of 3 blocks
    raw = finite_fp16(rng.integers(0, 256, (rows, per_row * nbytes), dtype=np.uint8),
                      type_name, nbytes)
    ours = dequantize(raw, type_name, (rows, per_row * weights))
    assert ours.dtype == np.float32 and ours.shape == (rows, per_row * weights)
    assert np.array_equal(bits(ours), bits(reference(raw, type_name, ours.shape)))


@pytest.mark.parametrize("type_name", NEW)
def test_every_code_in_every_place(type_name):
    """One block per byte value at every byte (fp16 numbers 1.0): each bit of each byte is seen
    set and clear in every position, so a plane read from the wrong bit cannot agree."""
    weights, nbytes = FORMATS[type_name][:2]
    raw = np.zeros((256, nbytes), np.uint8)
    raw[:] = (np.arange(256)[:, None] + 37 * np.arange(nbytes)[None, :]) % 256
    for at in FP16_AT[type_name]:
        raw[:, at:at + 2] = np.array([1.0], "<f2").view(np.uint8)
    ours = dequantize(raw, type_name, (256, weights))
    assert np.array_equal(bits(ours), bits(reference(raw, type_name, ours.shape)))


# --- blocks packed by hand -----------------------------------------------------------------------
def f16(x):
    return list(np.array([x], "<f2").view(np.uint8))


def f32(x):
    return np.float32(x)


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def hand_q5(minimum):
    """A Q5_0 (minimum None) or Q5_1 block of codes 0..31 (code i = (5i + 3) % 32)."""
    codes = [(5 * i + 3) % 32 for i in range(32)]
    d = 0.375
    high = sum((c >> 4) << i for i, c in enumerate(codes)).to_bytes(4, "little")
    low = [(codes[j] & 15) | (codes[j + 16] & 15) << 4 for j in range(16)]
    head = f16(d) + ([] if minimum is None else f16(minimum))
    if minimum is None:
        expected = [f32(c - 16) * f32(d) for c in codes]
    else:
        expected = [f32(d) * f32(c) + f32(minimum) for c in codes]
    return head + list(high) + low, expected


def hand_iq4_nl():
    codes = [(3 * i + 1) % 16 for i in range(32)]
    low = [codes[j] | codes[j + 16] << 4 for j in range(16)]
    return f16(-0.5) + low, [f32(-0.5) * f32(KVALUES_IQ4NL[c]) for c in codes]


SCALES8 = [1, 7, 63, 0, 33, 16, 47, 5]     # 6-bit sub-block scales and minimums, 8 sub-blocks
MINS8 = [0, 63, 2, 31, 32, 17, 48, 1]


def pack_scales_mins(s, m):
    """Q4_K/Q5_K's 12 bytes, written as get_scale_min_k4 reads them."""
    out = [0] * 12
    for j in range(4):
        out[j] = s[j] | (s[j + 4] >> 4) << 6
        out[j + 4] = m[j] | (m[j + 4] >> 4) << 6
        out[j + 8] = (s[j + 4] & 15) | (m[j + 4] & 15) << 4
    return out


def hand_q4_k(five):
    """A Q4_K (five False) or Q5_K block: codes i*7+3, the scales and mins above."""
    top = 32 if five else 16
    codes = [(7 * i + 3) % top for i in range(256)]
    d, dmin = 0.5, 0.25
    nibbles = [codes[64 * c + pos] & 15 | (codes[64 * c + 32 + pos] & 15) << 4
               for c in range(4) for pos in range(32)]
    high = [sum((codes[32 * r + pos] >> 4) << r for r in range(8)) for pos in range(32)]
    raw = f16(d) + f16(dmin) + pack_scales_mins(SCALES8, MINS8) + (high if five else []) + \
        nibbles
    expected = [f32(d) * f32(SCALES8[i // 32]) * f32(c) - f32(dmin) * f32(MINS8[i // 32])
                for i, c in enumerate(codes)]
    return raw, expected


def low_crumbs(codes):
    """64 bytes: bits 0-1 of weight 128h + 32p + pos in bits 2p, 2p + 1 of byte 32h + pos."""
    return [sum((codes[128 * h + 32 * p + pos] & 3) << 2 * p for p in range(4))
            for h in range(2) for pos in range(32)]


SCALES16 = [1, 15, 0, 9, 4, 7, 12, 3, 14, 2, 8, 11, 5, 13, 6, 10]


def hand_q2_k():
    codes = [(i * 5 + i // 7) % 4 for i in range(256)]
    mins = [(5 * j + 2) % 16 for j in range(16)]
    d, dmin = 0.125, -0.75                   # a negative dmin: allowed by the format
    raw = [s | m << 4 for s, m in zip(SCALES16, mins, strict=True)] + low_crumbs(codes) + \
        f16(d) + f16(dmin)
    expected = [f32(d) * f32(SCALES16[i // 16]) * f32(c) - f32(dmin) * f32(mins[i // 16])
                for i, c in enumerate(codes)]
    return raw, expected


def hand_q3_k():
    codes = [(i * 3 + i // 5) % 8 for i in range(256)]
    scales = [-32, 31, 0, -1, 17, -16, 5, -9, 30, -31, 1, 2, -20, 12, 8, -3]
    stored = [s + 32 for s in scales]
    d = 0.0625
    hmask = [sum((codes[32 * r + pos] >> 2) << r for r in range(8)) for pos in range(32)]
    packed = [(stored[j] & 15) | (stored[j + 8] & 15) << 4 for j in range(8)]
    packed += [sum(((stored[4 * p + b] >> 4) & 3) << 2 * p for p in range(4)) for b in range(4)]
    raw = hmask + low_crumbs(codes) + packed + f16(d)
    expected = [f32(d) * f32(scales[i // 16]) * f32(c - 4) for i, c in enumerate(codes)]
    return raw, expected


def hand_q6_k():
    codes = [(i * 11 + i // 3) % 64 for i in range(256)]
    scales = [127, -128, 0, 1, -1, 64, -77, 3, 100, -5, 42, -42, 7, 90, -100, 15]
    d = 0.01
    ql, qh = [], []
    for h in range(2):
        c = codes[128 * h:128 * (h + 1)]
        ql += [(c[pos] & 15) | (c[pos + 64] & 15) << 4 for pos in range(32)]
        ql += [(c[pos + 32] & 15) | (c[pos + 96] & 15) << 4 for pos in range(32)]
        qh += [sum((c[32 * k + pos] >> 4) << 2 * k for k in range(4)) for pos in range(32)]
    raw = ql + qh + list(np.array(scales, np.int8).view(np.uint8)) + f16(d)
    d16 = f32(np.float16(d))
    expected = [d16 * f32(scales[i // 16]) * f32(c - 32) for i, c in enumerate(codes)]
    return raw, expected


HAND = {"Q5_0": lambda: hand_q5(None), "Q5_1": lambda: hand_q5(-2.5), "IQ4_NL": hand_iq4_nl,
        "Q2_K": hand_q2_k, "Q3_K": hand_q3_k, "Q4_K": lambda: hand_q4_k(False),
        "Q5_K": lambda: hand_q4_k(True), "Q6_K": hand_q6_k}


@pytest.mark.parametrize("type_name", NEW)
def test_a_block_packed_by_hand_gives_its_known_weights(type_name):
    raw, expected = HAND[type_name]()
    raw = np.array(raw, dtype=np.uint8)[None, :]
    weights, nbytes = FORMATS[type_name][:2]
    assert raw.shape == (1, nbytes)
    ours = dequantize(raw, type_name, (1, weights))
    assert np.array_equal(bits(ours[0]), bits(expected))
    assert np.array_equal(bits(ours), bits(reference(raw, type_name, (1, weights))))


# --- what cannot be decoded ---------------------------------------------------------------------
@pytest.mark.parametrize("type_name", NEW)
def test_a_non_finite_scale_names_its_block(type_name):
    weights, nbytes = FORMATS[type_name][:2]
    raw = np.zeros((2, 3 * nbytes), np.uint8)
    for value, at in ((np.inf, FP16_AT[type_name][0]), (np.nan, FP16_AT[type_name][-1])):
        bad = raw.copy()
        bad[1, 2 * nbytes + at:2 * nbytes + at + 2] = f16(value)
        with pytest.raises(ValueError, match=rf"^{type_name} block 2 of row 1 decodes to "
                                             r"(nan|inf|-inf): a scale or minimum stored in it "
                                             "is not a finite fp16 number$"):
            dequantize(bad, type_name, (2, 3 * weights))


def test_rows_of_whole_super_blocks_only():
    with pytest.raises(ValueError, match=r"a Q4_K row holds whole super-blocks of 256 weights, "
                                         r"but the shape \[2, 576\] has rows of 576"):
        dequantize(np.zeros(2 * 576 // 256 * 144, np.uint8), "Q4_K", (2, 576))
    with pytest.raises(ValueError, match="Q6_K .1, 256. takes 210 bytes, but 209 are stored"):
        dequantize(np.zeros(209, np.uint8), "Q6_K", (1, 256))
    with pytest.raises(ValueError, match="GGUF type IQ4_XS is not supported"):
        dequantize(np.zeros(136, np.uint8), "IQ4_XS", (1, 256))
