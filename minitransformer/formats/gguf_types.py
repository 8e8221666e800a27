"""GGML's tensor types as the GGUF importer reads them: each type's block and its decoder.

Serves gguf_file.py (the bytes a tensor of a type and shape takes) and gguf.py (the float32
weights). A GGML type is either plain (one value per element, widened to float32 exactly) or
a block format: a row is cut into blocks of 32 weights (gguf_blocks.py) or super-blocks of
256 (gguf_kquants.py), each stored in a fixed number of bytes. So a tensor's size follows
from its type and shape, and a row that is not whole blocks cannot be stored at all: that is
why llama.cpp stores a k-quant model's matrices with rows of 576 (SmolLM2's width) in a
blocks-of-32 type instead (Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K).

    type     weights  bytes  bits/weight       type     weights  bytes  bits/weight
    Q8_0        32     34      8.5             Q2_K       256     84      2.625
    Q4_0        32     18      4.5             Q3_K       256    110      3.4375
    Q4_1        32     20      5               Q4_K       256    144      4.5
    Q5_0        32     22      5.5             Q5_K       256    176      5.5
    Q5_1        32     24      6               Q6_K       256    210      6.5625
    IQ4_NL      32     18      4.5

>>> raw = np.array([[0x00, 0x3C] + [0x10 + i for i in range(16)]], dtype=np.uint8)
>>> dequantize(raw, "Q4_0", (1, 32))[0, [0, 1, 16, 17]]   # scale 1.0: code - 8
array([-8., -7., -7., -7.], dtype=float32)
>>> FORMATS["Q4_K"].bits_per_weight
4.5

Leaves out: the i-quants but IQ4_NL (IQ1_S..IQ4_XS: lattice codebooks of 256 to 2048
entries), the ternary TQ1_0/TQ2_0, the float4 MXFP4 and NVFP4, ggml's newest Q1_0 and Q2_0,
the integer and F64 types, the interleaved layouts ggml has retired (Q4_0_4_4 ...) and Q8_1/Q8_K
(llama.cpp's intermediates for dot products); each is refused by name (gguf_file.GGML_TYPES
names every id ggml has given out).
"""
from typing import Callable, NamedTuple

import numpy as np

from minitransformer.formats import gguf_blocks, gguf_kquants
from minitransformer.formats.safetensors_io import to_float32


class Format(NamedTuple):
    weights: int        # per block, along a row
    nbytes: int         # per block
    decode: Callable    # (N, nbytes) uint8 -> (N, weights) float32

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.weights


# GGUF type name -> its block
FORMATS = {"Q8_0": Format(32, 34, gguf_blocks.q8_0), "Q4_0": Format(32, 18, gguf_blocks.q4_0),
           "Q4_1": Format(32, 20, gguf_blocks.q4_1), "Q5_0": Format(32, 22, gguf_blocks.q5_0),
           "Q5_1": Format(32, 24, gguf_blocks.q5_1), "IQ4_NL": Format(32, 18, gguf_blocks.iq4_nl),
           "Q2_K": Format(256, 84, gguf_kquants.q2_k), "Q3_K": Format(256, 110, gguf_kquants.q3_k),
           "Q4_K": Format(256, 144, gguf_kquants.q4_k), "Q5_K": Format(256, 176, gguf_kquants.q5_k),
           "Q6_K": Format(256, 210, gguf_kquants.q6_k)}
# GGUF type name -> little-endian element type, widened to float32 as it is read
PLAIN_FORMATS = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}
SUPPORTED = (*PLAIN_FORMATS, *FORMATS)


def row_error(type_name: str, shape) -> str | None:
    """Why a tensor of this supported type cannot have this shape (numpy order), or None."""
    if type_name in PLAIN_FORMATS or shape[-1] % FORMATS[type_name].weights == 0:
        return None
    kind = "super-blocks" if FORMATS[type_name].weights == gguf_kquants.SUPER else "blocks"
    return (f"a {type_name} row holds whole {kind} of {FORMATS[type_name].weights} weights, "
            f"but the shape {list(shape)} has rows of {shape[-1]}")


def dequantize(raw, type_name: str, shape) -> np.ndarray:
    """The stored bytes of one tensor -> float32 array of `shape` (numpy order: (out, in)).

    raw is any array holding the tensor's bytes as stored (the gguf reader gives uint8 rows
    for block formats and typed arrays for plain ones). A block never spans two rows. A block
    whose stored fp16 scale or minimum is inf or NaN decodes to non-finite weights: a
    ValueError naming the block.
    """
    shape = tuple(int(n) for n in shape)
    count = int(np.prod(shape, dtype=np.int64))
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if type_name in PLAIN_FORMATS:
        stored = np.dtype(PLAIN_FORMATS[type_name])
        _check_size(data, count * stored.itemsize, type_name, shape)
        return to_float32(type_name, data.view(stored)).reshape(shape)  # as safetensors
    if type_name not in FORMATS:
        raise ValueError(f"GGUF type {type_name} is not supported "
                         f"(supported: {', '.join(SUPPORTED)})")
    if (why := row_error(type_name, shape)) is not None:
        raise ValueError(why)
    block = FORMATS[type_name]
    _check_size(data, count // block.weights * block.nbytes, type_name, shape)
    with np.errstate(invalid="ignore", over="ignore"):      # non-finite scales: said below
        w = block.decode(data.reshape(-1, block.nbytes))               # (blocks, weights)
        finite = np.isfinite(w.sum()) or np.isfinite(w).all()          # cheap test first
    if not finite:
        first = int(np.flatnonzero(~np.isfinite(w).all(axis=1))[0])
        per_row = shape[-1] // block.weights
        raise ValueError(f"{type_name} block {first % per_row} of row {first // per_row} "
                         f"decodes to {w[first][~np.isfinite(w[first])][0]}: a scale or "
                         "minimum stored in it is not a finite fp16 number")
    return w.reshape(shape)


def _check_size(data, expected, type_name, shape):
    if data.size != expected:
        raise ValueError(f"{type_name} {list(shape)} takes {expected} bytes, "
                         f"but {data.size} are stored")
