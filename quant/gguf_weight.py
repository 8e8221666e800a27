"""A matrix held as llama.cpp holds it: GGUF blocks, the bytes of a GGUF file's tensor.

Serves the k-quant schemes of experiments 15, 16 and 21 (schemes.py). A QWeight (qweight.py)
holds codes and scales apart; a k-quant block interleaves them, sub-scales quantized inside
it, so the honest thing to hold is the block bytes themselves, exactly what llama.cpp keeps
in memory and writes to a file, read back by the importer's own decoders
(minitransformer/formats/gguf_types.py). Memory is then the bytes held, and the bits per
weight come from the block layout: 144 bytes per 256 weights is Q4_K's 4.5.

A k-quant needs rows of whole super-blocks (256 weights). Where a matrix's rows are not,
llama-quantize stores that matrix in a blocks-of-32 type instead, and so does this:

    Q2_K, Q3_K -> IQ4_NL    Q4_K -> Q5_0    Q5_K -> Q5_1    Q6_K -> Q8_0

so a "Q4_K" SmolLM2 (rows of 576 everywhere but the down projections' 1,536) is Q5_0 in its
other six matrices per layer, as every Q4_K GGUF of it is. Rows that are not even whole
blocks of 32 are stored F16, as llama-quantize does.

>>> import numpy as np
>>> q = gguf_quantize(np.ones((2, 576), np.float32), "Q4_K")
>>> q.type_name, q.nbytes, q.bits_per_weight             # 576 = 18 blocks of 32 -> Q5_0
('Q5_0', 792, 5.5)

Quantized a chunk of rows at a time (quantize_blocks: the same bytes, the searches' arrays in
cache), and once, kept: the k-quants' searches take NumPy a second or so a matrix (a minute or
more for SmolLM2, in each of experiments 15, 16 and 21), so, as a llama.cpp user quantizes once and keeps
the GGUF file, the blocks of every matrix of KEPT_WEIGHTS weights or more are kept on disk
under weights/quantized/ (git-ignored; $MT_WEIGHTS_DIR moves it), named by a digest of the
matrix's bytes and shape, the type and the quantizers' own source: another matrix, another type
or a changed quantizer finds nothing of its own and quantizes. A file that cannot be read or
holds blocks of another size is quantized again, never an error; a file is written whole (a
temporary file, then os.replace), so two processes at once corrupt nothing.
MT_QUANT_CACHE=off quantizes every time and keeps nothing.

Leaves out: importance matrices (llama-quantize --imatrix), the _S/_M/_L mixes' per-tensor
choices (a mix is a file of several of these types; the importer reads any).
"""
import functools
import hashlib
import inspect
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from minitransformer.backend import BACKEND, Array, numpy_kernel, to_device
from minitransformer.checkpoints.synth import weights_dir
from minitransformer.formats.gguf_types import FORMATS, dequantize
from quant import ggml_blocks, kquants
from quant.int8 import int8_activations
from quant.scales import check_weight, relative_error

QUANTIZERS = {"Q2_K": kquants.q2_k, "Q3_K": kquants.q3_k, "Q4_K": kquants.q4_k,
              "Q5_K": kquants.q5_k, "Q6_K": kquants.q6_k, "Q8_0": ggml_blocks.q8_0,
              "Q5_0": ggml_blocks.q5_0, "Q5_1": ggml_blocks.q5_1, "IQ4_NL": ggml_blocks.iq4_nl,
              "F16": lambda w: np.ascontiguousarray(w, "<f2").view(np.uint8)}
# llama-quantize's fallback for a row that is not whole super-blocks (llama-quant.cpp)
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
ROWS_PER_STEP = 64  # rows decoded at a time by matmul: 64 x 1,536 floats, in cache
KEPT_WEIGHTS = 1 << 16  # matrices this large are kept once quantized (the tests' tiny ones not)
CHUNK_WEIGHTS = 1 << 17  # weights quantized at a time (whole rows): the searches' arrays in cache


def stored_type(type_name: str, cols: int) -> str:
    """The GGUF type a matrix with rows of `cols` is stored in under `type_name`: itself, its
    fallback, or F16 (llama-quant.cpp's order)."""
    for kind in (type_name, FALLBACK.get(type_name)):
        if kind is not None and cols % FORMATS[kind].weights == 0:
            return kind
    return "F16"


def stored_bytes(type_name: str, shape) -> int:
    """Bytes a matrix (out, in) takes under `type_name` (its fallback where rows need one)."""
    out, cols = shape
    kind = stored_type(type_name, cols)
    if kind == "F16":
        return 2 * out * cols
    return out * cols // FORMATS[kind].weights * FORMATS[kind].nbytes


@dataclass(frozen=True)
class GGUFWeight:
    scheme: str                         # the label of the scheme, e.g. "Q4_K"
    shape: tuple                        # (out, in) of the float matrix this stands for
    type_name: str                      # the GGUF type of the bytes: the scheme's or fallback
    blocks: Array = field(repr=False)   # uint8 (out, bytes per row), on the host
    error: float = 0.0                  # ||W - W_hat|| / ||W||, measured when quantized
    outlier_threshold: float | None = None  # None: weight-only; else INT8 activations too
    floats: Array = field(default=None, repr=False)   # float32 (out, in): decoded(), or None

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def buffers(self) -> dict:
        """What is held, by kind (qmodel.resident_bytes): the blocks, scales inside (and the
        floats decoded from them, where decoded() made them)."""
        floats = [] if self.floats is None else [self.floats]
        return {"projections": [self.blocks] + floats, "levels": []}

    def dequantize(self):
        """-> float32 (out, in) on the backend: the blocks decoded as the importer does."""
        return to_device(dequantize(self.blocks, self.type_name, self.shape))

    def decoded(self) -> "GGUFWeight":
        """The same weight holding its blocks decoded once too (4 bytes a weight more, counted
        by buffers()): a product then reads ROWS_PER_STEP rows of these floats where it would
        decode as many rows of blocks, the same rows into the same product, so the same bits.
        For many products of one matrix (experiment 21 evaluates each scheme over thousands),
        where decoding at every call costs more than the products; not what llama.cpp holds."""
        return replace(self, floats=dequantize(self.blocks, self.type_name, self.shape))

    def matmul(self, x):
        """x (..., in) @ W_hat.T -> (..., out), W_hat = dequantize(), never held whole (unless
        decoded() made it)."""
        if self.outlier_threshold is not None:
            x = int8_activations(x, self.outlier_threshold)
        if BACKEND == "cupy":                    # the decoders are NumPy's: decode, upload
            return x @ self.dequantize().T
        return on_host(self, x)


def numpy_matmul(q: GGUFWeight, x):
    """GGUFWeight.matmul on NumPy arrays: ROWS_PER_STEP rows of blocks decoded at a time (or
    read from the floats decoded() holds)."""
    out, cols = q.shape
    xs = x.reshape(-1, cols)
    y = np.empty((len(xs), out), np.float32)
    for r0 in range(0, out, ROWS_PER_STEP):
        rows = q.blocks[r0:r0 + ROWS_PER_STEP]
        w = dequantize(rows, q.type_name, (len(rows), cols)) if q.floats is None \
            else q.floats[r0:r0 + len(rows)]                              # (rows, in)
        y[:, r0:r0 + len(rows)] = xs @ w.T
    return y.reshape(*x.shape[:-1], out)


on_host = numpy_kernel(numpy_matmul)  # strict: NumPy's calls on the data it wraps


def gguf_quantize(w, type_name: str, label: str | None = None) -> GGUFWeight:
    """A float matrix (out, in) -> its GGUFWeight under llama.cpp's `type_name` (or fallback)."""
    w = check_weight(w)
    stored = stored_type(type_name, w.shape[1])
    blocks = kept_blocks(w, stored)
    error = relative_error(w, dequantize(blocks, stored, w.shape))
    return GGUFWeight(label or type_name, tuple(w.shape), stored, blocks, error)


def quantize_blocks(w: np.ndarray, stored: str) -> np.ndarray:
    """QUANTIZERS[stored](w), CHUNK_WEIGHTS weights (whole rows) at a time: a block's bytes
    depend on its own weights only, so the same bytes, while every array a search makes over
    a chunk (a few hundred KB) stays in the core's cache, where one over the whole matrix
    (megabytes) streams from memory at every step."""
    quantize, rows = QUANTIZERS[stored], max(1, CHUNK_WEIGHTS // w.shape[1])
    if len(w) <= rows:
        return quantize(w)
    return np.concatenate([quantize(w[r:r + rows]) for r in range(0, len(w), rows)])


def kept_blocks(w: np.ndarray, stored: str) -> np.ndarray:
    """quantize_blocks(w, stored): read from weights/quantized/ when this very matrix was
    quantized to this type by this very code before, else quantized now and kept (module
    docstring)."""
    if stored == "F16" or w.size < KEPT_WEIGHTS or os.environ.get("MT_QUANT_CACHE") == "off":
        return quantize_blocks(w, stored)
    file = kept_file(w, stored)
    size = (w.shape[0], stored_bytes(stored, w.shape) // w.shape[0])
    try:
        blocks = np.load(file, allow_pickle=False)
        if blocks.dtype == np.uint8 and blocks.shape == size:
            return blocks
    except (OSError, ValueError, EOFError):
        pass                                # none kept, or unreadable: quantized again
    blocks = quantize_blocks(w, stored)
    keep(file, blocks)
    return blocks


def kept_file(w: np.ndarray, stored: str) -> Path:
    """weights/quantized/<type>-<digest of the quantizers' code, type, shape and bytes>.npy"""
    digest = hashlib.sha1(quantizers_digest().encode())
    digest.update(f"{stored} {w.shape}".encode())
    digest.update(np.ascontiguousarray(w, np.float32).tobytes())
    return weights_dir() / "quantized" / f"{stored}-{digest.hexdigest()[:20]}.npy"


@functools.cache
def quantizers_digest() -> str:
    """A digest of the quantizers' source: a change to them makes every kept file a stranger."""
    sources = [Path(inspect.getfile(m)).read_bytes() for m in (kquants, ggml_blocks)]
    return hashlib.sha1(b"".join(sources)).hexdigest()


def keep(file: Path, blocks: np.ndarray) -> None:
    """Write blocks to file whole (a temporary file beside it, then os.replace); a folder that
    cannot be written costs only the quantizing next time."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=file.parent, suffix=".partial", delete=False) as f:
            np.save(f, blocks, allow_pickle=False)
        os.replace(f.name, file)
    except OSError:
        pass
