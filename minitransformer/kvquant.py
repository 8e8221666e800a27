"""A quantized KV cache: keys and values held as small integer codes plus one scale per block.

The cache's bytes per token are 2 x L x Hkv x d x bytes per element, and the last factor is the
one lever left once the model's shape is fixed. llama.cpp offers it as ``-ctk`` / ``-ctv``;
this module holds its formats under its names:

    f32    float32, what the model computes in (the default; 4 bytes per element)
    f16    float16 (2 bytes per element)
    q8_0   blocks of 32 along the head dimension: 32 int8 codes and one float16 scale s,
           value = s x code, s = max|x| / 127              34 bytes per 32 = 1.0625 B/element
    q4_0   blocks of 32: 32 4-bit codes, two to a byte, and one float16 scale s,
           value = s x (code - 8), s = (the x of largest |x|) / -8
                                                           18 bytes per 32 = 0.5625 B/element

A block is 32 numbers of one head's key (or value) vector of one token, so each token of each
head gets its own scales, and a head dim d gets d / 32 of them (a head dim that 32 does not
divide, as in the small test models, uses blocks of gcd(32, d)). These are llama.cpp's own
blocks, and ``dequantize_blocks`` is their decoding for the GGUF reader too (formats/
gguf_blocks.py splits a file's 34- and 18-byte blocks into codes and scales and calls it).

Two nibble orders, side by side: inside a q4_0 block, byte j holds element j in its low half
and element j + 16 in its high half, as llama.cpp packs it (``split_nibbles``); the 4-bit
weights of quant/packing.py put elements 2i and 2i + 1 in byte i. Either works as long as
packing and unpacking agree; reading one as the other puts the right numbers in the wrong
places, silently.

The cache stores codes and scales, never float32 values: a ``QuantizedArray`` is the pair of
arrays, indexed on its leading axes like the float array it stands for, so the caches write
into it and slice it exactly as they do a float32 array (writing float32 values quantizes
them). Attention reads floats: ``dequantize`` turns a slice of it back into float32 (the
tiled attention one block of keys at a time; the plain one all held keys of a layer at once,
through ``on_floats``).

Exactness: every path reads what the cache holds, a whole prompt its own keys too, so runs
that compute each key by the same products hold the same codes. Chunked prefill and a prefix
hit compute keys by other products, whose last bits differ; rounding to the grid turns that
into a whole step at an element near a boundary, so those paths are held to twice the format's
logit bound, not to the float32 near-tie window (docs/kv-cache.md, "Exactness").

>>> x = xp.asarray([[0.5, -1.0, 0.25, 0.0]], dtype=xp.float32)   # one vector, d = 4
>>> held = zeros((1, 4), "q8_0")
>>> held[0] = x[0]                          # quantized on the way in: s = 1 / 127
>>> from minitransformer.backend import to_numpy
>>> held.codes.dtype.name, to_numpy(held.codes).tolist()
('int8', [[64, -127, 32, 0]])
>>> [round(float(a), 4) for a in to_numpy(dequantize(held))[0]]   # s rounded to float16
[0.5039, -0.9999, 0.252, 0.0]
"""
from dataclasses import dataclass
from math import gcd
from numbers import Integral
from typing import NamedTuple

from minitransformer.backend import Array, xp

KV_DTYPES = ("f32", "f16", "q8_0", "q4_0")   # llama.cpp's names (-ctk / -ctv)
QK = 32                                     # numbers per block: llama.cpp's QK8_0 = QK4_0 = 32
FLOATS = {"f32": xp.float32, "f16": xp.float16}


def check_kv_dtype(kv_dtype) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    return kv_dtype


def block_of(d: int) -> int:
    """Numbers per scale along a head dim of d: 32, or gcd(32, d) when 32 does not divide d.

    >>> block_of(64), block_of(16), block_of(48)
    (32, 16, 16)
    """
    return gcd(QK, d)


def vector_bytes(d: int, kv_dtype) -> int:
    """Bytes that one head's key (or value) of one token takes in the cache. kv_dtype: a
    format of KV_DTYPES, or a whole number of bytes per element for a format priced but not
    held here (sim/'s what-ifs: 2 is fp16, 1 an fp8 cache).

    >>> [vector_bytes(64, t) for t in KV_DTYPES]       # SmolLM2's head dim: 2 blocks of 32
    [256, 128, 68, 36]
    >>> vector_bytes(64, 1)
    64
    """
    if isinstance(kv_dtype, Integral) and not isinstance(kv_dtype, bool):
        if kv_dtype <= 0:
            raise ValueError(f"bytes_per_elem={kv_dtype!r}: expected a positive size")
        return d * int(kv_dtype)
    check_kv_dtype(kv_dtype)
    if kv_dtype in FLOATS:
        return d * xp.dtype(FLOATS[kv_dtype]).itemsize
    if kv_dtype == "q4_0" and d % 2:
        raise ValueError(f"q4_0 packs two codes to a byte: the head dim must be even, got {d}")
    codes = d if kv_dtype == "q8_0" else d // 2
    return codes + 2 * (d // block_of(d))             # + one float16 scale per block


class KVDims(NamedTuple):
    """The three numbers the KV cache's size depends on (HF names, as a ModelConfig has them)."""
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def cache_bytes_per_token(config, kv_dtype) -> int:
    """2 (k and v) x L x Hkv x (bytes of one head's vector): the chapter's formula, with the
    cache's dtype, and its one home (sim/ and the paged pool call it). For q8_0 on a head dim
    of 64 that is 2 x L x Hkv x 64 x 34/32. config: anything with the fields of KVDims.

    >>> smollm2 = KVDims(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    >>> [cache_bytes_per_token(smollm2, t) for t in KV_DTYPES]
    [46080, 23040, 12240, 6480]
    >>> cache_bytes_per_token(KVDims(24, 2, 64), 2)     # Qwen2.5-0.5B in fp16: 2 x 24 x 2 x 64 x 2
    12288
    """
    return (2 * config.num_hidden_layers * config.num_key_value_heads
            * vector_bytes(config.head_dim, kv_dtype))


@dataclass
class QuantizedArray:
    """A float array of shape (..., d) held as codes (..., d or d/2) and scales (..., d/g).

    Indexing (read or write) applies to the leading axes, which codes and scales share; the
    head dim is never indexed (a block's codes need their scale).
    """
    kv_dtype: str
    codes: Array             # (..., d) int8 for q8_0; (..., d / 2) uint8 for q4_0
    scales: Array            # (..., d / g) float16

    @property
    def shape(self) -> tuple:
        d = self.codes.shape[-1] * (1 if self.kv_dtype == "q8_0" else 2)
        return (*self.codes.shape[:-1], d)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(self.scales.nbytes)

    def __len__(self) -> int:
        return len(self.codes)

    def apply(self, fn) -> "QuantizedArray":
        """The same function on codes and scales (a gather, a copy to the host, ...)."""
        return QuantizedArray(self.kv_dtype, fn(self.codes), fn(self.scales))

    def __getitem__(self, index) -> "QuantizedArray":
        return self.apply(lambda a: a[_leading(index, a.ndim)])

    def __setitem__(self, index, value) -> None:
        """Write float values (quantized here) or another QuantizedArray (copied as is)."""
        index = _leading(index, self.codes.ndim)
        if not isinstance(value, QuantizedArray):
            value = quantize(value, self.kv_dtype)
        if value.kv_dtype != self.kv_dtype:
            raise ValueError(f"cannot write {value.kv_dtype} blocks into a {self.kv_dtype} cache")
        self.codes[index] = value.codes
        self.scales[index] = value.scales


def _leading(index, ndim):
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) >= ndim or any(part is Ellipsis or part is None for part in parts):
        raise IndexError("a QuantizedArray is indexed on its leading axes only, not the head dim")
    return index


def kv_dtype_of(held) -> str:
    """The format name of a cache's K or V store."""
    if isinstance(held, QuantizedArray):
        return held.kv_dtype
    return next(name for name, dtype in FLOATS.items() if held.dtype == dtype)


def zeros(shape, kv_dtype: str):
    """An empty K or V store of float shape (..., d): a float array, or codes and scales."""
    check_kv_dtype(kv_dtype)
    if kv_dtype in FLOATS:
        return xp.zeros(shape, FLOATS[kv_dtype])
    *lead, d = shape
    vector_bytes(d, kv_dtype)                          # checks d
    codes = (*lead, d) if kv_dtype == "q8_0" else (*lead, d // 2)
    return QuantizedArray(kv_dtype, xp.zeros(codes, xp.int8 if kv_dtype == "q8_0" else xp.uint8),
                          xp.zeros((*lead, d // block_of(d)), xp.float16))


def quantize(x, kv_dtype: str) -> QuantizedArray:
    """Float x (..., d) -> codes and one float16 scale per block of g = block_of(d) numbers."""
    *lead, d = x.shape
    vector_bytes(d, kv_dtype)
    g = block_of(d)
    blocks = xp.asarray(x, dtype=xp.float32).reshape(*lead, d // g, g)     # (..., nb, g)
    if kv_dtype == "q8_0":
        scales = (xp.abs(blocks).max(axis=-1) / 127).astype(xp.float16)     # (..., nb)
    elif kv_dtype == "q4_0":  # the number of largest magnitude, sign kept, lands on code 0
        widest = xp.abs(blocks).argmax(axis=-1)[..., None]
        scales = (xp.take_along_axis(blocks, widest, axis=-1)[..., 0] / -8).astype(xp.float16)
    else:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not a quantized format (q8_0, q4_0)")
    s = scales.astype(xp.float32)[..., None]                                 # (..., nb, 1)
    steps = xp.rint(blocks / xp.where(s == 0, 1, s))  # an all-zero block: codes 0 (x / 1 = 0)
    if kv_dtype == "q8_0":
        codes = steps.clip(-127, 127).astype(xp.int8)                        # (..., nb, g)
    else:
        nibbles = (steps + 8).clip(0, 15).astype(xp.uint8)                   # (..., nb, g)
        codes = nibbles[..., : g // 2] | (nibbles[..., g // 2:] << 4)        # (..., nb, g/2)
    return QuantizedArray(kv_dtype, codes.reshape(*lead, -1), scales)


def dequantize(held):
    """What attention reads: float32 (..., d). A float32 array is returned as it is."""
    if not isinstance(held, QuantizedArray):
        return held if held.dtype == xp.float32 else held.astype(xp.float32)
    *lead, d = held.shape
    nb = held.scales.shape[-1]
    codes = held.codes.reshape(*lead, nb, -1)                                # (..., nb, g|g/2)
    return dequantize_blocks(held.kv_dtype, codes, held.scales).reshape(*lead, d)


def dequantize_blocks(kv_dtype: str, codes, scales):
    """llama.cpp's q8_0 / q4_0 decoding: codes (..., nb, g) int8, or (..., nb, g/2) bytes of
    two 4-bit codes, and float16 scales (..., nb) -> float32 (..., nb, g). q8_0: s x code;
    q4_0: s x (code - 8). Array methods only, so the cache's device arrays and the GGUF
    reader's host ones go through the same lines.
    """
    if kv_dtype == "q8_0":
        steps = codes.astype(xp.float32)
    else:
        steps = split_nibbles(codes).astype(xp.float32) - 8
    return steps * scales[..., None].astype(xp.float32)


def split_nibbles(packed):
    """(..., g/2) bytes -> (..., g) 4-bit codes 0..15 in llama.cpp's order: byte j holds code j
    in its low half and code j + g/2 in its high half (the order ``quantize`` packs).

    >>> from minitransformer.backend import to_numpy
    >>> to_numpy(split_nibbles(xp.asarray([0x21, 0x43], dtype=xp.uint8))).tolist()
    [1, 3, 2, 4]
    """
    codes = packed[..., None, :].repeat(2, axis=-2)                          # (..., 2, g/2)
    codes[..., 0, :] &= 15                             # the low halves: codes 0 .. g/2 - 1
    codes[..., 1, :] >>= 4                             # the high halves: codes g/2 .. g - 1
    return codes.reshape(*packed.shape[:-1], -1)


def on_floats(attend):
    """attend(q, k, v, visible) fed float32 keys and values, whatever the cache holds: its
    blocks (or float16) dequantized at once, as plain attention reads them."""
    def attend_floats(q, k, v, visible=None):
        return attend(q, dequantize(k), dequantize(v), visible)
    return attend_floats
