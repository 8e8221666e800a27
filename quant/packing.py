"""Two 4-bit codes in one byte: the packing that makes a 4-bit weight take half a byte.

Serves experiments 15 and 21 (memory is measured on the packed arrays) and every 4-bit
quantizer. Code 2i goes in the low nibble of byte i and code 2i+1 in the high nibble; an odd
count leaves the last high nibble zero. (llama.cpp's q4_0 blocks use another order, and
bitsandbytes its own: minitransformer/kvquant.py names llama.cpp's and this one side by side.)

Unpacking turns each byte straight into its two *values* through a 256-entry table built from
the 16 levels, so the forward pass pays one gather per weight matrix, not bit twiddling per
nibble (`take` rather than `table[packed]`: NumPy's fancy indexing checks and converts more per
element, and is the slower).
Unpacking to the codes themselves is the same call with levels = 0..15.
Leaves out: 2-, 3- and 6-bit packings, and packing along blocks (llama.cpp's block layout).
"""
import numpy as np

from minitransformer.backend import xp


def integer_levels(bits: int) -> np.ndarray:
    """What each code of the integer grid stands for: itself read as a signed `bits`-bit
    integer (two's complement), float32 (2**bits,).

    Stored this way, an 8-bit code read as a signed byte *is* its level, and a packed 4-bit
    code shifted into a byte's top half is 16 x its level: quant/matmul.py converts codes to
    floats with a cast, no table and no offset to undo.
    >>> integer_levels(4).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]
    """
    codes = np.arange(2 ** bits)
    return np.where(codes < 2 ** (bits - 1), codes, codes - 2 ** bits).astype(np.float32)


def pack_nibbles(codes) -> np.ndarray:
    """Codes (n,) with values 0..15 -> uint8 (ceil(n/2),), two codes per byte.

    >>> [hex(b) for b in pack_nibbles([0xA, 0x3, 0x7])]   # A low, 3 high; 7 with a 0 partner
    ['0x3a', '0x7']
    """
    codes = np.asarray(codes).reshape(-1)
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError(f"4-bit codes must be in 0..15, got {codes.min()}..{codes.max()}")
    codes = codes.astype(np.uint8)
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))  # pad: the odd code's partner is a zero nibble
    return codes[0::2] | (codes[1::2] << 4)    # low nibble first, high nibble second


def unpack_nibbles(packed, n: int, levels):
    """Packed bytes (ceil(n/2),) -> levels[code] for each of the n codes, (n,).

    levels (16,) is whatever the codes stand for: 0..15 gives the codes back, the int4 grid
    -8..7 or the 16 NF4 levels give the weights in units of their scale.

    >>> from minitransformer.backend import to_numpy
    >>> to_numpy(unpack_nibbles(xp.asarray(pack_nibbles([10, 3, 7])), 3, xp.arange(16))).tolist()
    [10, 3, 7]
    """
    if packed.size != (n + 1) // 2:
        raise ValueError(f"{packed.size} bytes cannot hold exactly {n} 4-bit codes")
    byte = xp.arange(256)
    table = xp.stack([levels[byte & 15], levels[byte >> 4]], axis=1)  # (256, 2): low, high
    return xp.take(table, packed, axis=0).reshape(-1)[:n]               # (n,)
