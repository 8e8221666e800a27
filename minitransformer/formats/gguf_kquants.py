"""GGUF's k-quants, decoded: super-blocks of 256 weights whose scales are quantized too.

Serves the GGUF importer (gguf_types.py) and quant/kquants.py, which writes these blocks; reads
after gguf_blocks.py. A blocks-of-32 format pays 16 bits per 32 weights for its scale (0.5 bit
per weight). A k-quant cuts a row into super-blocks of 256 weights, each into 8 sub-blocks of
32 (or 16 of 16), and gives every sub-block its own scale (and minimum), stored in 6 or 8 bits
as a multiple of one fp16 scale of the super-block: the scales are themselves quantized, the
double quantization that QLoRA applies to NF4's block scales. So Q4_K holds a scale and a
minimum per 32 weights, as Q4_1 does, for 4.5 bits per weight instead of 5.

Each layout (byte offsets on top; d, dmin: fp16 little-endian; j: the sub-block):

    Q4_K  0  2     4                 16                            144   4.5 bits/weight
          [d][dmin][12 B: 8 scales, 8 mins][128 B: nibbles]
          w = d * scale_j * code - dmin * min_j,      8 sub-blocks of 32, codes 0..15
    Q5_K  0  2     4                 16           48               176   5.5 bits/weight
          [d][dmin][12 B: 8 scales, 8 mins][32 B: bit 4][128 B: nibbles]
          w = d * scale_j * code - dmin * min_j,      codes 0..31 = nibble | bit 4 << 4
    Q6_K  0                  128                192             208 210  6.5625 bits/weight
          [128 B: low 4 bits][64 B: bits 4-5][16 x int8 scales][d]
          w = d * scale_j * (code - 32),              16 sub-blocks of 16, codes 0..63
    Q3_K  0            32              96                   108 110      3.4375 bits/weight
          [32 B: bit 2][64 B: bits 0-1][12 B: 16 scales, 6 bits][d]
          w = d * (scale_j - 32) * (code - 4),        16 sub-blocks of 16, codes 0..7
    Q2_K  0                       16              80  82     84          2.625 bits/weight
          [16 B: scale | min << 4][64 B: bits 0-1][d][dmin]
          w = d * scale_j * code - dmin * min_j,      16 sub-blocks of 16, codes 0..3

Where each code's bits sit (the planes of gguf_blocks.planes: plane p of a byte is its bits
[p * b, (p + 1) * b) for b-bit pieces). The super-block is read in runs of 32 consecutive
weights; weight 32r + l (l = 0..31) takes byte l of its run's bytes:

    nibbles (Q4_K, Q5_K)    32 bytes per 64 weights: run 2c in the low halves of bytes
                            32c..32c+31, run 2c + 1 in their high halves
    bit 4 (Q5_K)            32 bytes, one bit plane per run: bit r of byte l
    bits 0-1 (Q2_K, Q3_K)   32 bytes per 128 weights: run 4h + p in plane p of bytes 32h + l
    bit 2 (Q3_K)            32 bytes, one bit plane per run: bit r of byte l
    low 4 bits (Q6_K)       64 bytes per 128 weights: runs 4h, 4h + 1 in the low halves of
                            bytes 64h + l, 64h + 32 + l; runs 4h + 2, 4h + 3 in their high ones
    bits 4-5 (Q6_K)         32 bytes per 128 weights: run 4h + p in plane p of bytes 32h + l

The 6-bit numbers packed in 12 bytes (Q4_K, Q5_K: scale s_j and min m_j of 8 sub-blocks):

    bytes 0-3    s0..s3 in bits 0-5; bits 4-5 of s4..s7 in bits 6-7
    bytes 4-7    m0..m3 in bits 0-5; bits 4-5 of m4..m7 in bits 6-7
    bytes 8-11   bits 0-3 of s4..s7 in the low halves, of m4..m7 in the high halves

and for Q3_K (16 scales, stored as scale + 32 so they are signed):

    bytes 0-7    bits 0-3 of s0..s7 in the low halves, of s8..s15 in the high halves
    bytes 8-11   bits 4-5 of s_(4p + b) in plane p (2 bits) of byte 8 + b

The arithmetic is llama.cpp's ``dequantize_row_*``, in float32 and in its order (the
sub-block's scale d * scale_j first, exact in float32; times the code; minus dmin * min_j),
so the floats are the same to the bit as the gguf package's ``gguf.quants.dequantize`` (the
tests check every format on random bytes). docs/gguf-kquants.md decodes one Q4_K block by
hand.

Leaves out: Q8_K (llama.cpp's intermediate for dot products, never in a file) and the
i-quants but IQ4_NL (lattice codebooks: gguf_types.py refuses them by name).
"""
import numpy as np

from minitransformer.formats.gguf_blocks import fp16, planes

SUPER = 256  # weights per super-block, for every format here


def runs(packed, bits: int, group: int):
    """(N, n) bytes -> (N, 256) codes, for pieces of `bits` bits stored `group` bytes at a time:
    byte l of a group of bytes holds weight l of each of its 8 / bits runs of 32 (plane p of
    group g: run g * 8 / bits + p)."""
    n = len(packed)
    return planes(packed.reshape(n, -1, group), bits).reshape(n, SUPER)


def affine(codes, scale, minimum=None):
    """codes (N, 256), each sub-block's scale (N, S) [and minimum (N, S)], float32
    -> (N, 256): scale * code [- minimum], sub-block j being weights [j * 256/S, (j+1) * 256/S)."""
    n, subs = scale.shape
    w = codes.reshape(n, subs, -1).astype(np.float32) * scale[:, :, None]
    if minimum is not None:
        w = w - minimum[:, :, None]
    return w.reshape(n, SUPER)


def scales_and_mins(packed):
    """(N, 12) bytes -> two (N, 8) arrays of 6-bit numbers 0..63: Q4_K/Q5_K's scales, mins."""
    low, mid, top = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = np.concatenate([low & 63, (top & 15) | (low >> 6) << 4], axis=1)
    minimum = np.concatenate([mid & 63, (top >> 4) | (mid >> 6) << 4], axis=1)
    return scale, minimum


def q3_scales(packed):
    """(N, 12) bytes -> (N, 16) Q3_K scales, -32..31 (stored + 32 in 6 bits)."""
    n = len(packed)
    low = np.concatenate([packed[:, :8] & 15, packed[:, :8] >> 4], axis=1)       # (N, 16)
    high = planes(packed[:, 8:], 2).reshape(n, 16)                                # (N, 16)
    return (low | high << 4).astype(np.int8) - 32


def q2_k(blocks):
    """(N, 84) -> (N, 256): 2-bit codes, a 4-bit scale and minimum per 16 weights."""
    packed = blocks[:, :16]
    scale = fp16(blocks[:, 80:82])[:, None] * (packed & 15)                     # (N, 16)
    minimum = fp16(blocks[:, 82:84])[:, None] * (packed >> 4)                   # (N, 16)
    return affine(runs(blocks[:, 16:80], 2, 32), scale, minimum)


def q3_k(blocks):
    """(N, 110) -> (N, 256): 3-bit codes - 4, a signed 6-bit scale per 16 weights."""
    codes = runs(blocks[:, 32:96], 2, 32) | runs(blocks[:, :32], 1, 32) << 2        # 0..7
    scale = fp16(blocks[:, 108:110])[:, None] * q3_scales(blocks[:, 96:108])        # (N, 16)
    return affine(codes.astype(np.int8) - 4, scale)


def q4_k(blocks):
    """(N, 144) -> (N, 256): 4-bit codes, a 6-bit scale and minimum per 32 weights."""
    scale, minimum = scales_and_mins(blocks[:, 4:16])
    return affine(runs(blocks[:, 16:], 4, 32), fp16(blocks[:, :2])[:, None] * scale,
                  fp16(blocks[:, 2:4])[:, None] * minimum)


def q5_k(blocks):
    """(N, 176) -> (N, 256): 5-bit codes (a nibble and a bit plane), as Q4_K otherwise."""
    scale, minimum = scales_and_mins(blocks[:, 4:16])
    codes = runs(blocks[:, 48:], 4, 32) | runs(blocks[:, 16:48], 1, 32) << 4       # 0..31
    return affine(codes, fp16(blocks[:, :2])[:, None] * scale,
                  fp16(blocks[:, 2:4])[:, None] * minimum)


def q6_k(blocks):
    """(N, 210) -> (N, 256): 6-bit codes - 32, an int8 scale per 16 weights."""
    n = len(blocks)
    low = planes(blocks[:, :128].reshape(n, 2, 2, 32), 4)     # (N, half, byte half, plane, l)
    low = low.swapaxes(2, 3).reshape(n, SUPER)                # run 4h + 2 * plane + byte half
    codes = low | runs(blocks[:, 128:192], 2, 32) << 4                              # 0..63
    scale = fp16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8)    # (N, 16)
    return affine(codes.astype(np.int8) - 32, scale)
