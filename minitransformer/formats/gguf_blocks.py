"""GGUF's block formats, decoded: group quantization as llama.cpp stores it on disk.

Serves the GGUF importer (gguf.py) and reads as a companion to the chapter's quantization
section and to quant/absmax.py. A GGUF block format is group quantization with a group of
32 weights along a row and the scale stored inside the block, next to its codes:

    Q8_0  [fp16 scale][32 x int8 code]                 w = scale * code
    Q4_0  [fp16 scale][16 bytes: 32 x 4-bit code]      w = scale * (code - 8)
    Q4_1  [fp16 scale][fp16 minimum][16 bytes]         w = scale * code + minimum

Q8_0 and Q4_0 are symmetric absmax with a group of 32 (quant/absmax.py uses 128). Q4_1 is
*affine*: a per-block minimum shifts the 16 levels onto [min, max] of the block, so a block
whose weights are all positive does not waste half its grid, for 2 more bytes: 4 + 32/32 = 5
bits per weight, against 4.5 for Q4_0 and 8.5 for Q8_0.

The trap in the 4-bit formats: the nibble order is not ours. Byte j of a block holds code j
in its low nibble and code j + 16 in its high nibble (quant/packing.py puts codes 2i and 2i+1
in one byte). Reading the nibbles in the wrong order gives weights of the right distribution
in the wrong columns, a silently wrong model, which is why every decoder here is tested bit
for bit against the gguf package's own ``gguf.quants.dequantize``.

F32, F16 and BF16 are not blocks: one value per element, widened to float32 exactly.
Leaves out: the k-quants (Q2_K..Q6_K, super-blocks of 256 with 6-bit sub-scales), the
i-quants, Q5_0/Q5_1 and Q8_1; asking for one is an error that names it.
"""
import numpy as np

from minitransformer.formats.safetensors_io import to_float32

BLOCK = 32  # weights per block, for every format here


def _fp16(raw):
    """(N, 2) uint8, little-endian -> (N, 1) float32: the per-block scale or minimum."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles(packed):
    """(N, 16) uint8 -> (N, 32) codes 0..15: the low nibbles are codes 0..15 of the block,
    the high nibbles codes 16..31 (llama.cpp's layout, not two neighbours per byte)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def q8_0(blocks):
    """(N, 34) -> (N, 32): scale * code, code a signed byte."""
    scale = _fp16(blocks[:, :2])                                      # (N, 1)
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)         # (N, 32)
    return scale * codes.astype(np.float32)


def q4_0(blocks):
    """(N, 18) -> (N, 32): scale * (code - 8); codes 0..15 stand for -8..7."""
    scale = _fp16(blocks[:, :2])                                      # (N, 1)
    codes = _nibbles(blocks[:, 2:]).astype(np.int8) - 8               # (N, 32)
    return scale * codes.astype(np.float32)


def q4_1(blocks):
    """(N, 20) -> (N, 32): scale * code + minimum, the affine 4-bit format."""
    scale, minimum = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])     # (N, 1) each
    codes = _nibbles(blocks[:, 4:]).astype(np.float32)                # (N, 32)
    return scale * codes + minimum


# GGUF type name -> (bytes per block of BLOCK weights, decoder)
BLOCK_FORMATS = {"Q8_0": (2 + BLOCK, q8_0), "Q4_0": (2 + BLOCK // 2, q4_0),
                 "Q4_1": (4 + BLOCK // 2, q4_1)}
# GGUF type name -> little-endian element type, widened to float32 as it is read
PLAIN_FORMATS = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
SUPPORTED = (*PLAIN_FORMATS, *BLOCK_FORMATS)


def dequantize(raw, type_name: str, shape) -> np.ndarray:
    """The stored bytes of one tensor -> float32 array of `shape` (numpy order: (out, in)).

    raw is any array holding the tensor's bytes as stored (the gguf reader gives uint8 rows
    for block formats and typed arrays for plain ones). A block never spans two rows: a row
    length that is not a multiple of 32 cannot be stored in a block format.

    >>> blocks = np.array([[0x00, 0x3C] + [0x10 + i for i in range(16)]], dtype=np.uint8)
    >>> dequantize(blocks, "Q4_0", (1, 32))[0, [0, 1, 16, 17]]   # scale 1.0: code - 8
    array([-8., -7., -7., -7.], dtype=float32)
    """
    shape = tuple(int(n) for n in shape)
    count = int(np.prod(shape, dtype=np.int64))
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name in PLAIN_FORMATS:
        stored = np.dtype(PLAIN_FORMATS[type_name])
        _check_size(data, count * stored.itemsize, type_name, shape)
        return to_float32(type_name, data.view(stored)).reshape(shape)  # as safetensors
    if type_name not in BLOCK_FORMATS:
        raise ValueError(f"GGUF type {type_name} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    block_bytes, decode = BLOCK_FORMATS[type_name]
    if shape[-1] % BLOCK:
        raise ValueError(f"a {type_name} row holds whole blocks of {BLOCK} weights, "
                         f"but the shape {shape} has rows of {shape[-1]}")
    _check_size(data, count // BLOCK * block_bytes, type_name, shape)
    return decode(data.reshape(-1, block_bytes)).reshape(shape)


def _check_size(data, expected, type_name, shape):
    if data.size != expected:
        raise ValueError(f"{type_name} {list(shape)} takes {expected} bytes, "
                         f"but {data.size} are stored")
