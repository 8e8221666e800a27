"""GGUF's blocks of 32, decoded: group quantization as llama.cpp stores it on disk.

Serves the GGUF importer (gguf_types.py lists every type it reads) and reads as a companion to
the chapter's quantization section and to quant/absmax.py. A block format is group
quantization with a group of 32 weights along a row and the scale stored inside the block,
next to its codes (byte offsets on top; fp16 little-endian):

    Q8_0   0      2                                  34
           [scale][32 x int8 code]                       w = scale * code
    Q4_0   0      2                  18
           [scale][16 bytes: nibbles]                    w = scale * (code - 8)
    Q4_1   0      2        4                  20
           [scale][minimum][16 bytes: nibbles]           w = scale * code + minimum
    Q5_0   0      2                6                  22
           [scale][4 bytes: bit 4][16 bytes: nibbles]    w = scale * (code - 16)
    Q5_1   0      2        4                6                  24
           [scale][minimum][4 bytes: bit 4][16 bytes: nibbles]   w = scale * code + minimum
    IQ4_NL 0      2                  18
           [scale][16 bytes: nibbles]                    w = scale * KVALUES[code]

The nibbles: byte j holds code j in its low half and code j + 16 in its high half. The
5-bit formats keep a code's fifth bit apart, in a plane of 32 bits (a little-endian uint32:
bit j is code j's), so that the nibbles read exactly as Q4's and a 5-bit code is
``nibble | bit << 4``.

Q8_0 and Q4_0 are symmetric absmax with a group of 32 (quant/absmax.py uses 128). Q4_1 and
Q5_1 are *affine*: a per-block minimum shifts the levels onto [min, max] of the block, so a
block whose weights are all positive does not waste half its grid, for 2 more bytes: Q4_1 is
4 + 32/32 = 5 bits per weight, Q4_0 4.5, Q5_0 5.5, Q5_1 6, Q8_0 8.5. IQ4_NL is Q4_0 with
non-uniform levels: 16 signed integers dense near zero (llama.cpp's ``kvalues_iq4nl``), the
same idea as NF4's normal quantiles (quant/nf4.py), stored as integers so the scale absorbs
their unit.

Q8_0 and Q4_0 are the KV cache's q8_0 and q4_0 (kvquant.py): this module splits each
block into its scale and its codes and decodes them with ``kvquant.dequantize_blocks``; the
others read their nibbles with ``kvquant.split_nibbles``. The trap in the 4-bit formats is the
nibble order, which is llama.cpp's, not quant/packing.py's (kvquant.py names the two side by
side): the wrong one gives weights of the right distribution in the wrong columns, a silently
wrong model, which is why every decoder here is tested bit for bit against the gguf package's
own ``gguf.quants.dequantize``. The arithmetic is llama.cpp's too, in float32 and in its
order (scale * code, then + minimum), so the floats are the same to the bit.

>>> block = np.array([[0x00, 0x3C, 0x01, 0, 0, 0x80] + [0x10] * 16], dtype=np.uint8)
>>> q5_0(block)[0, [0, 1, 16, 31]]    # scale 1.0; code 0 has bit 4 set, code 31 too
array([  0., -16., -15.,   1.], dtype=float32)

Leaves out: Q8_1 (an intermediate format of llama.cpp's dot products, never in a file).
"""
import numpy as np

from minitransformer.kvquant import dequantize_blocks, split_nibbles

BLOCK = 32  # weights per block, for every format here

# IQ4_NL's 16 levels, in units of the block's scale (llama.cpp's kvalues_iq4nl)
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   dtype=np.float32)


def fp16(raw):
    """(N, 2) uint8, little-endian -> (N,) float32: a per-block scale or minimum, widened."""
    return np.ascontiguousarray(raw).view("<f2")[:, 0].astype(np.float32)


def planes(packed, bits: int):
    """(..., n) bytes -> (..., 8 // bits, n) codes of `bits` bits: plane p holds bits
    [p * bits, (p + 1) * bits) of every byte, the lowest first, as llama.cpp packs them.

    >>> planes(np.array([0b11100100], dtype=np.uint8), 2)[:, 0].tolist()
    [0, 1, 2, 3]
    """
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]                  # (8 / bits, 1)
    return (packed[..., None, :] >> shifts) & np.uint8((1 << bits) - 1)


def q8_0(blocks):
    """(N, 34) -> (N, 32): [fp16 scale][32 int8 codes], scale * code."""
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)         # (N, 32)
    return dequantize_blocks("q8_0", codes, fp16(blocks[:, :2]))


def q4_0(blocks):
    """(N, 18) -> (N, 32): [fp16 scale][16 bytes of 4-bit codes], scale * (code - 8)."""
    return dequantize_blocks("q4_0", blocks[:, 2:], fp16(blocks[:, :2]))


def q4_1(blocks):
    """(N, 20) -> (N, 32): scale * code + minimum, the affine 4-bit format."""
    scale, minimum = (fp16(blocks[:, i:i + 2])[:, None] for i in (0, 2))
    return scale * split_nibbles(blocks[:, 4:]).astype(np.float32) + minimum


def five_bits(high, low):
    """4 bytes of fifth bits (N, 4) and 16 bytes of nibbles (N, 16) -> (N, 32) codes 0..31."""
    fifth = np.unpackbits(high, axis=-1, bitorder="little")           # (N, 32): bit j, code j
    return split_nibbles(low) | fifth << 4


def q5_0(blocks):
    """(N, 22) -> (N, 32): scale * (code - 16), codes of 5 bits."""
    codes = five_bits(blocks[:, 2:6], blocks[:, 6:]).astype(np.float32) - 16
    return codes * fp16(blocks[:, :2])[:, None]


def q5_1(blocks):
    """(N, 24) -> (N, 32): scale * code + minimum, codes of 5 bits."""
    scale, minimum = (fp16(blocks[:, i:i + 2])[:, None] for i in (0, 2))
    return scale * five_bits(blocks[:, 4:8], blocks[:, 8:]).astype(np.float32) + minimum


def iq4_nl(blocks):
    """(N, 18) -> (N, 32): scale * KVALUES[code], 4-bit codes on a non-uniform grid."""
    return fp16(blocks[:, :2])[:, None] * KVALUES[split_nibbles(blocks[:, 2:])]
