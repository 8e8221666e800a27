"""llama.cpp's quantizers for its blocks of 32: Q8_0, Q5_0, Q5_1 and IQ4_NL, as GGUF bytes.

Serves quant/gguf_weight.py (what llama-quantize writes where a row of a k-quant matrix is not
whole super-blocks of 256: Q8_0 for Q6_K, Q5_0 for Q4_K, Q5_1 for Q5_K, IQ4_NL for Q3_K and
Q2_K) and the tests. The
layouts are drawn in minitransformer/formats/gguf_blocks.py, which reads what is written here;
the rounding is llama.cpp's ``quantize_row_q*_ref`` step for step in float32, so the bytes are
those of the gguf package's ``gguf.quants.quantize`` (the tests check every byte):

    Q8_0   d = max|x| / 127                       code = round(x / d), halves away from 0
    Q5_0   d = (the x of largest |x|) / -16       code = min(31, trunc(x / d + 16.5))
    Q5_1   d = (max - min) / 31, m = min          code = trunc((x - min) / d + 0.5)
    IQ4_NL d: the best of 16 fits (x^2-weighted least squares), code = the nearest level

(IQ4_NL is llama-quantize's ``quantize_iq4_nl`` without an importance matrix; the gguf package
has no quantizer for it, so its codes are measured against llama.cpp's C, as the k-quants'.)

(x / d is x times 1/d, computed once, as llama.cpp does.) The helpers shared with the
k-quants are here too: ``nearest_int`` (llama.cpp's rounding, halves to even), the fp16
bytes of a scale, and ``pack_planes``, the inverse of gguf_blocks.planes.

>>> x = np.linspace(-1, 1, 32, dtype=np.float32)[None, :]
>>> q5_0(x).shape, q5_0(x)[0, :2].view("<f2")   # 22 bytes; d = -1 / -16 (-1 comes first)
((1, 22), array([0.0625], dtype=float16))
"""
import numpy as np

from minitransformer.formats.gguf_blocks import KVALUES

BLOCK = 32


def nearest_int(x):
    """float32 -> int32, rounded to nearest with halves to even: llama.cpp's nearest_int (its
    trick, adding 1.5 * 2**23, rounds as the float addition does)."""
    return np.rint(x).astype(np.int32)


def sums(a):
    """(M, n) float32 -> (M,): each row added left to right, as a C loop adds it (a column
    at a time, each addition made for all M rows at once).

    >>> sums(np.array([[1e8, 1, -1e8], [1, 2, 3]], np.float32)).tolist()  # (1e8 + 1) - 1e8
    [0.0, 6.0]
    """
    total = a[:, 0].copy()
    for j in range(1, a.shape[1]):
        total += a[:, j]
    return total


def fp16_bytes(x):
    """(N,) float32 -> (N, 2) uint8: the fp16 (rounded to nearest even), little-endian."""
    return np.asarray(x, np.float32).astype("<f2").reshape(-1, 1).view(np.uint8)


def widened(x):
    """(N,) float32 -> the float32 of its fp16: the scale a decoder will read."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def pack_planes(codes, bits: int):
    """(..., 8 // bits, n) codes of `bits` bits -> (..., n) bytes, plane p in bits
    [p * bits, (p + 1) * bits): gguf_blocks.planes undone.

    >>> pack_planes(np.array([[0], [1], [2], [3]], dtype=np.uint8), 2).tolist()
    [228]
    """
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]
    return np.bitwise_or.reduce(codes.astype(np.uint8) << shifts, axis=-2)


def blocks_of(w):
    """(out, in) float32, in a multiple of 32 -> (out * in / 32, 32) blocks."""
    return np.ascontiguousarray(w, dtype=np.float32).reshape(-1, BLOCK)


def pack_five(codes):
    """(N, 32) codes 0..31 -> (N, 4) fifth bits (bit j: code j) and (N, 16) nibbles."""
    high = np.packbits(codes >> 4, axis=-1, bitorder="little")                 # (N, 4)
    low = pack_planes((codes & 15).reshape(-1, 2, 16), 4)                      # (N, 16)
    return high, low


def inverse(d):
    """1/d where d is not 0, else 0 (llama.cpp's ``id = d ? 1.0f/d : 0.0f``)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def q8_0(w):
    """(out, in) -> (out, in / 32 * 34) bytes: [fp16 d][32 x int8]."""
    x = blocks_of(w)
    d = np.abs(x).max(axis=1) / np.float32(127)                                    # (N,)
    scaled = x * inverse(d)[:, None]
    whole = np.floor(np.abs(scaled))                  # C's roundf: halves away from zero
    codes = (np.sign(scaled) * (whole + (np.abs(scaled) - whole >= 0.5))).astype(np.int8)
    return np.concatenate([fp16_bytes(d), codes.view(np.uint8)], axis=1).reshape(len(w), -1)


def signed_max(x):
    """(N, n) -> (N,): the value of largest magnitude, the first if tied."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)[:, 0]


def q5_0(w):
    """(out, in) -> (out, in / 32 * 22) bytes: [fp16 d][4 B: bit 4][16 B: nibbles]."""
    x = blocks_of(w)
    d = signed_max(x) / np.float32(-16)                                            # (N,)
    codes = np.minimum(31, (x * inverse(d)[:, None] + np.float32(16.5)).astype(np.int8))
    return np.concatenate([fp16_bytes(d), *pack_five(codes.astype(np.uint8))],
                          axis=1).reshape(len(w), -1)


def q5_1(w):
    """(out, in) -> (out, in / 32 * 24) bytes: [fp16 d][fp16 min][4 B: bit 4][16 B: nibbles]."""
    x = blocks_of(w)
    low, high = x.min(axis=1), x.max(axis=1)
    d = (high - low) / np.float32(31)
    codes = ((x - low[:, None]) * inverse(d)[:, None] + np.float32(0.5)).astype(np.uint8)
    return np.concatenate([fp16_bytes(d), fp16_bytes(low), *pack_five(codes)],
                          axis=1).reshape(len(w), -1)


# Every midpoint between two neighbouring levels is half an integer, j / 2, so x is at or
# above it exactly when floor(2 x) >= j (2 x is exact in float32): the nearest level's index
# is read from a table by floor(2 x), clipped to the span of the j's.
DOUBLED_MIDPOINTS = (KVALUES[1:] + KVALUES[:-1]).astype(np.int64)                 # (15,) j
LOWEST, HIGHEST = int(DOUBLED_MIDPOINTS[0]) - 1, int(DOUBLED_MIDPOINTS[-1])
LEVEL_AT = np.searchsorted(DOUBLED_MIDPOINTS, np.arange(LOWEST, HIGHEST + 1),
                           side="right").astype(np.uint8)    # floor(2 x) - LOWEST -> index


def nearest_level(x):
    """float32 (...) -> index 0..15 of the nearest of KVALUES (a tie goes up), as llama.cpp's
    best_index_int8 picks it (NaN: the last, as a search of the midpoints places it).

    >>> nearest_level(np.array([-1e9, -115.5, -115.6, 0.0, 112, np.nan], np.float32)).tolist()
    [0, 1, 0, 8, 15, 15]
    """
    with np.errstate(over="ignore"):                     # 2 x past float32: inf, clipped
        doubled = np.fmax(np.fmin(np.floor(np.float32(2) * x), HIGHEST), LOWEST)  # NaN: HIGHEST
    return LEVEL_AT[doubled.astype(np.intp) - LOWEST]


def iq4_nl(w):
    """(out, in) -> (out, in / 32 * 18) bytes: [fp16 d][16 B: nibbles], w = d * KVALUES[code]."""
    x = blocks_of(w)
    weights = x * x
    big = signed_max(x)
    levels = KVALUES

    def fit(inverse_scale):
        q = levels[nearest_level(inverse_scale[:, None] * x)]
        wq = weights * q                              # (weights q) x, (weights q) q: C's order
        return sums(wq * x), sums(wq * q)

    with np.errstate(divide="ignore", invalid="ignore"):
        sumqx, sumq2 = fit(np.float32(1) / (-big / levels[0]))
        d = np.where(sumq2 > 0, sumqx / sumq2, np.float32(0))
        best = d * sumqx
        for step in range(-7, 8):
            sumqx, sumq2 = fit((np.float32(step) + levels[0]) / big)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
        d = np.where(np.abs(big) < 1e-15, np.float32(0), d)
        codes = nearest_level(inverse(d)[:, None] * x)
    low = pack_planes(codes.reshape(-1, 2, 16), 4)
    return np.concatenate([fp16_bytes(d), low], axis=1).reshape(len(w), -1)
