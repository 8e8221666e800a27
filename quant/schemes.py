"""The quantization schemes of the chapter's tables, as data: name, label, bits, group, levels.

Serves experiments 15, 16, 21 and 22, and every `--schemes` argument. A scheme says how many
bits a code has, which weights share one scale (its territory: the whole matrix, one row, or
`group` consecutive weights of a row) and what the codes stand for (evenly spaced integers for
absmax, normal quantiles for NF4). From that alone follow the quantizer to call and the bytes a
matrix takes, so nothing is ever parsed back out of a name. llama.cpp's k-quants (Q2_K..Q6_K)
are schemes too: a GGUF type instead of bits and a group, held as GGUF blocks
(gguf_weight.py), their bytes read off the block layout (a row that is not whole
super-blocks of 256 takes llama-quantize's fallback type).

>>> s = SCHEMES["int4-g128"]
>>> s.label, s.bits, s.group
('INT4 group-128', 4, 128)
>>> s.nbytes((896, 896))      # codes: 896*896 / 2 bytes; scales: 896 rows x 7 groups x 2
413952
>>> round(s.bits_per_weight((896, 896)), 3)
4.125
>>> SCHEMES["int8-row"].scales((896, 4864))   # one scale per output row
896
>>> SCHEMES["q4_k"].bits_per_weight((896, 4864)), SCHEMES["q4_k"].bits_per_weight((896, 896))
(4.5, 5.5)

Leaves out: schemes the chapter does not tabulate (INT8 per-group, absmax at 3 or 2 bits).
"""
from dataclasses import dataclass

from minitransformer.shape import ceil_div
from quant.absmax import absmax_per_group, absmax_per_row, absmax_per_tensor
from quant.gguf_weight import gguf_quantize, stored_bytes
from quant.nf4 import nf4

TENSOR, ROW = "tensor", "row"  # the two territories that are not a group size


@dataclass(frozen=True)
class Scheme:
    name: str               # what --schemes takes, e.g. "int4-g128"
    label: str              # the chapter's row label, e.g. "INT4 group-128"
    bits: int               # per code: 8 or 4
    group: int | str        # weights sharing one scale: a count along a row, ROW or TENSOR
    levels: str = "integer"  # what a code stands for: "integer" (absmax) or "nf4"
    gguf: str | None = None  # a llama.cpp type (Q4_K, ...): held as its GGUF blocks

    def quantize(self, w):
        """A float matrix (out, in) -> its QWeight (or GGUFWeight) under this scheme."""
        if self.gguf is not None:
            return gguf_quantize(w, self.gguf, self.label)
        if self.group == TENSOR:
            return absmax_per_tensor(w, self.bits)
        if self.group == ROW:
            return absmax_per_row(w, self.bits)
        assert isinstance(self.group, int), self.group  # neither TENSOR nor ROW: a group size
        if self.levels == "nf4":
            return nf4(w, self.group)
        return absmax_per_group(w, self.bits, self.group)

    def scales(self, shape) -> int:
        """How many float16 scales a matrix of this shape (out, in) holds."""
        out, cols = shape
        if self.group == TENSOR:
            return 1
        if self.group == ROW:
            return out
        assert isinstance(self.group, int), self.group  # neither TENSOR nor ROW: a group size
        return out * ceil_div(cols, self.group)

    def nbytes(self, shape) -> int:
        """Bytes held for a matrix (out, in): codes (4-bit ones two per byte) + float16 scales;
        for a GGUF type, its blocks."""
        if self.gguf is not None:
            return stored_bytes(self.gguf, shape)
        out, cols = shape
        return ceil_div(out * cols * self.bits, 8) + 2 * self.scales(shape)

    def bits_per_weight(self, shape) -> float:
        return 8 * self.nbytes(shape) / (shape[0] * shape[1])


# In the order of the chapter's tables.
SCHEMES = {s.name: s for s in (
    Scheme("int8-tensor", "INT8 per-tensor", 8, TENSOR),
    Scheme("int8-row", "INT8 per-row", 8, ROW),
    Scheme("int4-tensor", "INT4 per-tensor", 4, TENSOR),
    Scheme("int4-row", "INT4 per-row", 4, ROW),
    Scheme("int4-g128", "INT4 group-128", 4, 128),
    Scheme("nf4", "NF4 (block 64)", 4, 64, levels="nf4"),
    *(Scheme(f"q{bits}_k", f"Q{bits}_K", bits, 256, levels="gguf", gguf=f"Q{bits}_K")
      for bits in (2, 3, 4, 5, 6)),
)}


def check_scheme(name: str) -> Scheme:
    """A scheme's name -> the Scheme, or a ValueError listing the names there are."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
    return SCHEMES[name]
