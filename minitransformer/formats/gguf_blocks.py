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

Q8_0 and Q4_0 are the KV cache's q8_0 and q4_0 (kvquant.py): this module splits each
block into its scale and its codes and decodes them with ``kvquant.dequantize_blocks``; Q4_1
reads its codes with ``kvquant.split_nibbles``. The trap in the 4-bit formats is the nibble
order, which is llama.cpp's, not quant/packing.py's (kvquant.py names the two side by side):
the wrong one gives weights of the right distribution in the wrong columns, a silently wrong
model, which is why every decoder here is tested bit for bit against the gguf package's own
``gguf.quants.dequantize``.

F32, F16 and BF16 are not blocks: one value per element, widened to float32 exactly.
Leaves out: the k-quants (Q2_K..Q6_K, super-blocks of 256 with 6-bit sub-scales), the
i-quants, Q5_0/Q5_1 and Q8_1; asking for one is an error that names it.
"""
import numpy as np

from minitransformer.formats.safetensors_io import to_float32
from minitransformer.kvquant import dequantize_blocks, split_nibbles

BLOCK = 32  # weights per block, for every format here


def _fp16(raw):
    """(N, 2) uint8, little-endian -> (N,) float16: the per-block scale or minimum."""
    return np.ascontiguousarray(raw).view("<f2")[:, 0]


def q8_0(blocks):
    """(N, 34) -> (N, 32): [fp16 scale][32 int8 codes], scale * code."""
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)         # (N, 32)
    return dequantize_blocks("q8_0", codes, _fp16(blocks[:, :2]))


def q4_0(blocks):
    """(N, 18) -> (N, 32): [fp16 scale][16 bytes of 4-bit codes], scale * (code - 8)."""
    return dequantize_blocks("q4_0", blocks[:, 2:], _fp16(blocks[:, :2]))


def q4_1(blocks):
    """(N, 20) -> (N, 32): scale * code + minimum, the affine 4-bit format."""
    scale, minimum = (_fp16(blocks[:, i:i + 2]).astype(np.float32)[:, None] for i in (0, 2))
    codes = split_nibbles(blocks[:, 4:]).astype(np.float32)          # (N, 32)
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
