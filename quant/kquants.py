"""llama.cpp's k-quant quantizers: Q2_K..Q6_K super-blocks, as llama-quantize writes them.

Serves quant/gguf_weight.py (the k-quant schemes of experiments 15, 16 and 21) and the tests,
which write GGUF files of mixed types with these bytes. The layouts are drawn in
minitransformer/formats/gguf_kquants.py, which reads what is written here. Without an
importance matrix llama-quantize calls ``quantize_row_q*_K_ref``; each function here is that
function, vectorized over all sub-blocks of a matrix at once, in float32, its sums added left
to right as its loops add them:

1. every sub-block (32 weights for Q4_K/Q5_K, 16 for the others) gets its own best scale (and
   minimum) by a small search: a few candidate grids around max-min / nmax (``fit_affine``:
   21 for Q4_K, 16 for Q5_K and Q2_K, each refit by weighted least squares and kept if its
   weighted error is lower) or around absmax / nmax (``fit_symmetric``: 19 for Q6_K, error
   weighted by x^2; ``fit_q3``: Q3_K's grid, then each code moved while that helps);
2. the sub-block scales are quantized against the super-block's largest one: 6 bits for
   Q4_K/Q5_K/Q3_K, 8 for Q6_K, 4 for Q2_K, with one fp16 super-scale (and super-minimum);
3. every weight is rounded again against its sub-block's scale as the decoder will see it
   (fp16 super-scale times the quantized sub-scale), so the codes fit the stored scales.

The gguf package implements none of these quantizers (only Q4_0, Q4_1, Q5_0, Q5_1, Q8_0:
quant/ggml_blocks.py matches those byte for byte), so the codes here are checked against
llama.cpp's C functions by measurement (docs/gguf-kquants.md says how close: a compiler may
fuse a multiply and an add in C, which rounds once where this rounds twice).

>>> w = np.linspace(-1, 1, 256, dtype=np.float32)[None, :]
>>> stored = q4_k(w)
>>> stored.shape                                        # one super-block: 144 bytes
(1, 144)
>>> from minitransformer.formats.gguf_kquants import q4_k as read
>>> round(float(np.abs(read(stored) - w).max()), 3)  # minimum <= 0: [0, 1] in 15 steps
0.032
"""
import numpy as np

from quant.ggml_blocks import fp16_bytes, nearest_int, pack_planes, signed_max, sums, widened

SUPER = 256
f32 = np.float32


def fit_affine(x, weights, nmax, rmin, rdelta, nstep, mad=False):
    """llama.cpp's make_qkx2_quants for M sub-blocks x (M, n) at once: a scale and a minimum
    with codes 0..nmax, min <= 0, found by trying nstep + 1 grids (nmax + rmin + rdelta * i
    steps over [min, max]) and refitting each by weighted least squares.
    -> scale (M,), -min (M,) (>= 0), codes (M, n) int32."""
    low = np.minimum(x.min(axis=1), 0)                                    # (M,)
    high = x.max(axis=1)
    sum_w, sum_x = sums(weights), sums(weights * x)

    def codes_at(iscale, low):
        return np.clip(nearest_int(iscale[:, None] * (x - low[:, None])), 0, nmax)

    def error(scale, low, codes):
        diff = scale[:, None] * codes.astype(f32) + low[:, None] - x
        return sums(weights * (np.abs(diff) if mad else diff * diff))

    with np.errstate(divide="ignore", invalid="ignore"):      # flat sub-blocks: set below
        iscale = f32(nmax) / (high - low)
        scale = f32(1) / iscale
        codes = codes_at(iscale, low)
        best = error(scale, low, codes)
        for step in range(nstep + 1):
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (high - low)
            trial = codes_at(iscale, low)
            t = trial.astype(f32)
            wt = weights * t                              # (weights t) t, (weights t) x: C's order
            sum_l, sum_l2, sum_xl = sums(wt), sums(wt * t), sums(wt * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0                            # a minimum above 0: fit scale only
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, f32(0), this_min)
            err = error(this_scale, this_min, trial)
            better = (det > 0) & (err < best)
            codes = np.where(better[:, None], trial, codes)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            low = np.where(better, this_min, low)
    flat = high == low
    return np.where(flat, f32(0), scale), -low, np.where(flat[:, None], 0, codes)


def fit_symmetric(x, nmax):
    """llama.cpp's make_qx_quants(rmse_type 1) for M sub-blocks (M, n): codes -nmax..nmax-1
    around the value of largest magnitude, 19 grids tried, error weighted by x^2.
    -> scale (M,), codes + nmax (M, n)."""
    big = signed_max(x)
    w = x * x
    wx = w * x                                                  # (w x) t: C's order

    def trial(iscale):
        codes = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        t = codes.astype(f32)
        return codes, sums(wx * t), sums(w * t * t)

    with np.errstate(divide="ignore", invalid="ignore"):
        codes, sumlx, suml2 = trial(-f32(nmax) / big)
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            c, slx, sl2 = trial(-(f32(nmax) + f32(0.1) * f32(step)) / big)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            codes = np.where(better[:, None], c, codes)
            scale = np.where(better, slx / sl2, scale)
            best = np.where(better, scale * slx, best)
    zero = np.abs(big) < 1e-15
    return np.where(zero, f32(0), scale), np.where(zero[:, None], 0, codes + nmax)


def fit_q3(x, nmax=4):
    """llama.cpp's make_q3_quants(do_rmse) for M sub-blocks (M, n): codes -nmax..nmax-1 from
    the absmax grid, then each code in turn moved to its least-squares best while that lowers
    the x^2-weighted error (5 passes). -> scale (M,), codes + nmax (M, n)."""
    big = signed_max(x)
    w = x * x
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.clip(nearest_int((-f32(nmax) / big)[:, None] * x), -nmax, nmax - 1)
        t = codes.astype(f32)
        sumlx, suml2 = sums(w * x * t), sums(w * t * t)
        for _ in range(5):          # a pass that changes nothing leaves the next one nothing
            for i in range(x.shape[1]):
                wi, xi, li = w[:, i], x[:, i], codes[:, i].astype(f32)
                slx = sumlx - wi * xi * li                      # the sums without weight i
                sl2 = suml2 - wi * li * li
                new = np.clip(nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
                n = new.astype(f32)
                slx_new, sl2_new = slx + wi * xi * n, sl2 + wi * n * n
                take = (slx > 0) & (new != codes[:, i]) & (sl2_new > 0) & \
                    (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
                codes[:, i] = np.where(take, new, codes[:, i])
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    zero = np.abs(big) < 1e-15
    return np.where(zero, f32(0), scale), np.where(zero[:, None], 0, codes + nmax)


def requantize(x, scale, minimum, codes, lowest, highest):
    """Step 3: weights x (B, S, n) rounded again against the stored sub-block scales (B, S)
    and minimums (or None: symmetric), to lowest..highest, stored from 0; a sub-block whose
    scale is 0 keeps the codes its search found (codes (B, S, n))."""
    assert scale.dtype == f32, scale.dtype                   # float64 would round elsewhere
    with np.errstate(divide="ignore", invalid="ignore"):
        shifted = x if minimum is None else x + minimum[:, :, None]
        again = np.clip(nearest_int(shifted / scale[:, :, None]), lowest, highest)
    return np.where(scale[:, :, None] != 0, again - lowest, codes)       # stored: 0..


def super_blocks(w, sub):
    """(out, in), in a multiple of 256 -> (B, 256 / sub, sub) float32."""
    return np.ascontiguousarray(w, dtype=f32).reshape(-1, SUPER // sub, sub)


def six_bit(values, top):
    """Sub-block scales or minimums (B, S) -> (their 6-bit codes (B, S), fp16 super-scale):
    the largest maps to 63 (llama.cpp's uint8 cast and cap included)."""
    top = np.maximum(top, 0)
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, f32(63) / top, f32(0))
    return np.minimum(63, nearest_int(inv[:, None] * values) & 255), top / f32(63)


def pack_scales_mins(scale, minimum):
    """Two (B, 8) arrays of 6-bit numbers -> (B, 12) bytes (gguf_kquants.scales_and_mins)."""
    low = scale[:, :4] | (scale[:, 4:] >> 4) << 6
    mid = minimum[:, :4] | (minimum[:, 4:] >> 4) << 6
    top = (scale[:, 4:] & 15) | (minimum[:, 4:] & 15) << 4
    return np.concatenate([low, mid, top], axis=1).astype(np.uint8)


def in_runs(codes, bits: int):
    """(B, 256) codes -> (B, 256 * bits / 8) bytes, byte l of each group of 32 holding weight l
    of 8 / bits consecutive runs of 32 (gguf_kquants.runs undone)."""
    b = len(codes)
    return pack_planes(codes.reshape(b, -1, 8 // bits, 32), bits).reshape(b, -1)


def q4_k(w, nmax=15, rmin=-1.0, nstep=20):
    """(out, in) -> (out, in / 256 * 144) bytes: quantize_row_q4_K_ref."""
    x = super_blocks(w, 32)                                              # (B, 8, 32)
    b = len(x)
    flat = x.reshape(-1, 32)
    weights = np.sqrt(sums(flat * flat) / f32(32))[:, None] + np.abs(flat)
    scale, minimum, codes = fit_affine(flat, weights, nmax, rmin, 0.1, nstep)
    scale, minimum = scale.reshape(b, 8), minimum.reshape(b, 8)
    ls, d = six_bit(scale, scale.max(axis=1))
    lm, dmin = six_bit(minimum, minimum.max(axis=1))
    codes = requantize(x, widened(d)[:, None] * ls.astype(f32),
                       widened(dmin)[:, None] * lm.astype(f32),
                       codes.reshape(b, 8, 32), 0, nmax).reshape(b, SUPER)
    head = [fp16_bytes(d), fp16_bytes(dmin), pack_scales_mins(ls, lm)]
    if nmax == 31:                                                       # Q5_K: bit 4 apart
        head.append(in_runs(codes >> 4, 1))
    return np.concatenate(head + [in_runs(codes & 15, 4)], axis=1).reshape(len(w), -1)


def q5_k(w):
    """(out, in) -> (out, in / 256 * 176) bytes: quantize_row_q5_K_ref."""
    return q4_k(w, nmax=31, rmin=-0.5, nstep=15)


def q6_k(w):
    """(out, in) -> (out, in / 256 * 210) bytes: quantize_row_q6_K_ref."""
    x = super_blocks(w, 16)                                              # (B, 16, 16)
    b = len(x)
    scale, codes = fit_symmetric(x.reshape(-1, 16), 32)
    scale = scale.reshape(b, 16)
    top = signed_max(scale)                                 # signed: its sign flips the grid
    zero = np.abs(top) < 1e-15
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = -f32(128) / top
        d = np.where(zero, f32(0), f32(1) / iscale)
        sc = np.where(zero[:, None], 0, np.minimum(127, nearest_int(iscale[:, None] * scale)))
    codes = requantize(x, widened(d)[:, None] * sc.astype(f32), None,
                       codes.reshape(b, 16, 16), -32, 31)
    codes = np.where(zero[:, None], 0, codes.reshape(b, SUPER))          # a zero block: all 0
    low = (codes & 15).reshape(b, 2, 2, 2, 32).swapaxes(2, 3)     # (B, half, byte half, nib, l)
    ql = pack_planes(low, 4).reshape(b, 128)
    return np.concatenate([ql, in_runs(codes >> 4, 2), sc.astype(np.int8).view(np.uint8),
                           fp16_bytes(d)], axis=1).reshape(len(w), -1)


def q3_k(w):
    """(out, in) -> (out, in / 256 * 110) bytes: quantize_row_q3_K_ref."""
    x = super_blocks(w, 16)
    b = len(x)
    scale, codes = fit_q3(x.reshape(-1, 16))
    scale = scale.reshape(b, 16)
    top = signed_max(scale)
    some = top != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = -f32(32) / top
        d = np.where(some, f32(1) / iscale, f32(0))
        stored = np.where(some[:, None],
                          np.clip(nearest_int(iscale[:, None] * scale), -32, 31) + 32, 0)
    codes = requantize(x, widened(d)[:, None] * (stored - 32).astype(f32), None,
                       codes.reshape(b, 16, 16), -4, 3).reshape(b, SUPER)
    packed = (stored[:, :8] & 15) | (stored[:, 8:] & 15) << 4                   # (B, 8)
    high = pack_planes(((stored >> 4) & 3).reshape(b, 4, 4), 2)                 # (B, 4)
    return np.concatenate([in_runs(codes >> 2, 1), in_runs(codes & 3, 2),
                           packed.astype(np.uint8), high, fp16_bytes(d)],
                          axis=1).reshape(len(w), -1)


def q2_k(w):
    """(out, in) -> (out, in / 256 * 84) bytes: quantize_row_q2_K_ref."""
    x = super_blocks(w, 16)
    b = len(x)
    flat = x.reshape(-1, 16)
    scale, minimum, codes = fit_affine(flat, np.abs(flat), 3, -0.5, 0.1, 15, mad=True)
    scale, minimum = scale.reshape(b, 16), minimum.reshape(b, 16)
    top_scale = np.maximum(scale.max(axis=1), 0)
    top_min = np.maximum(minimum.max(axis=1), 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(top_scale[:, None] > 0,
                      nearest_int((f32(15) / top_scale)[:, None] * scale), 0)
        lm = np.where(top_min[:, None] > 0,
                      nearest_int((f32(15) / top_min)[:, None] * minimum), 0)
    packed = ((ls & 255) | lm << 4) & 255                                        # (B, 16)
    d, dmin = top_scale / f32(15), top_min / f32(15)
    codes = requantize(x, widened(d)[:, None] * (packed & 15).astype(f32),
                       widened(dmin)[:, None] * (packed >> 4).astype(f32),
                       codes.reshape(b, 16, 16), 0, 3).reshape(b, SUPER)
    return np.concatenate([packed.astype(np.uint8), in_runs(codes, 2), fp16_bytes(d),
                           fp16_bytes(dmin)], axis=1).reshape(len(w), -1)
