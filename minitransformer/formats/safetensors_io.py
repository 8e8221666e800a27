"""Reading and writing the safetensors format, including bfloat16, with NumPy alone.

A safetensors file is: 8 bytes (little-endian u64) giving the length N of a JSON header; the N
header bytes, mapping each tensor name to its dtype, shape and [begin, end) byte range; then the
raw little-endian tensor bytes. Reading it ourselves (rather than through a framework) lets every
malformed or truncated file get an error that names the file and the tensor.

NumPy has no bfloat16, and Qwen2.5 ships its weights in it. bfloat16 is the top half of a
float32 (same sign and 8-bit exponent, mantissa cut from 23 to 7 bits), so widening it is exact:
put the 16 stored bits in the high half of a uint32 and view the result as float32. Narrowing
(for writing test checkpoints) rounds to nearest, ties to even, as torch does.
"""
import json
import math
import struct
from pathlib import Path

import numpy as np

from minitransformer.checks import is_integer, no_duplicates
from minitransformer.errors import CheckpointError

# safetensors dtype name -> numpy dtype of the stored bytes (BF16 is read as raw uint16)
STORED: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1")}
NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32, exactly."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bit patterns, round to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)


MAX_HEADER = 100_000_000  # bytes; the reference implementation refuses larger headers too


def read_header(file: Path) -> tuple[dict, int]:
    """-> (header without __metadata__, offset of the data section), after one validation pass.

    Checked, with the file and tensor named: the header is a JSON object of entries
    {dtype, shape, data_offsets}; dtype is a known name; shape a list of integers >= 0;
    data_offsets two integers with begin <= end spanning exactly dtype size x prod(shape);
    and the tensors tile the data section: sorted by offset they start at 0, each begins where
    the last ended (no gap, no overlap) and the last ends at the end of the file (no trailing
    bytes). That is the format's own rule: a byte no tensor owns could smuggle other content.
    """
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{file}: header length {n} exceeds the file size {size}: "
                                  "truncated or not a safetensors file")
        if n > MAX_HEADER:
            raise CheckpointError(f"{file}: header length {n} is over the format's limit of "
                                  f"{MAX_HEADER} bytes")
        blob = f.read(n)
    if not blob.strip():
        raise CheckpointError(f"{file}: empty safetensors header (its length is {n} bytes of "
                              "nothing): not a safetensors file, or a broken one")

    unique = no_duplicates(lambda twice: CheckpointError(   # else a tensor would vanish
        f"{file}: the header lists {twice[0]!r:.100} twice"))
    try:
        header = json.loads(blob.decode("utf-8"), object_pairs_hook=unique)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: malformed safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: malformed safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{file}: __metadata__ must be a JSON object")
    if not header and size > 8 + n:
        raise CheckpointError(f"{file}: the header lists no tensor, but {size - 8 - n} bytes "
                              "of data follow it")
    spans = sorted((check_entry(file, name, entry), name) for name, entry in header.items())
    position = 0  # the tensors, in offset order, must tile the data section exactly
    for (begin, end), name in spans:
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else \
                f"leaves bytes [{position}, {begin}) owned by no tensor"
            raise CheckpointError(f"{file}: tensor {name!r} at [{begin}, {end}) {what}")
        position = end
    data_bytes = size - 8 - n
    if position > data_bytes:       # the first tensor cut short, not the last listed
        (begin, end), name = next(span for span in spans if span[0][1] > data_bytes)
        raise CheckpointError(f"{file}: truncated: tensor {name!r} at [{begin}, {end}) needs "
                              f"bytes up to {end} of the data section but the file holds only "
                              f"{data_bytes}")
    if position < data_bytes:
        raise CheckpointError(f"{file}: {data_bytes - position} trailing bytes after the last "
                              "tensor")
    return header, 8 + n


def check_entry(file: Path, name: str, entry) -> tuple[int, int]:
    """One header entry -> its (begin, end), or a CheckpointError naming file, tensor, field."""
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where}: a header entry must be an object with exactly dtype, "
                              f"shape and data_offsets, got {entry!r:.200}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in STORED:
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r:.50}")
    if not isinstance(shape, list) or not all(is_integer(n) and n >= 0 for n in shape):
        raise CheckpointError(f"{where}: shape must be a list of integers >= 0, "
                              f"got {shape!r:.200}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_integer, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets must be two integers "
                              f"0 <= begin <= end, got {offsets!r:.200}")
    begin, end = offsets
    expected = math.prod(shape) * STORED[dtype].itemsize  # Python ints: no overflow
    if end - begin != expected:
        raise CheckpointError(f"{where}: {dtype}{shape} should take {expected} bytes but its "
                              f"offsets [{begin}, {end}) span {end - begin}")
    return begin, end


def read_tensors(file) -> dict[str, tuple[str, np.ndarray]]:
    """file -> {name: (safetensors dtype, array as stored)}. Arrays are read-only memory maps,
    so a large checkpoint is only paged in as each tensor is converted."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: safetensors file not found")
    header, offset = read_header(file)
    if not header:
        return {}
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=offset)
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        out[name] = (e["dtype"], data[begin:end].view(STORED[e["dtype"]]).reshape(e["shape"]))
    return out


def to_float32(dtype: str, stored: np.ndarray, copy: bool = True) -> np.ndarray:
    """A stored tensor (F32, F16 or BF16) -> a new float32 array; with copy=False an F32 one
    is given back as stored (read_tensors: a read-only view of the file, for a caller that
    copies it itself, once, where it keeps it)."""
    if dtype == "BF16":
        return bf16_to_f32(stored)
    if dtype == "F32" and not copy:
        return stored
    return np.array(stored, dtype=np.float32)


def write_tensors(file, tensors: dict[str, np.ndarray], dtype: str = "float32") -> None:
    """Write float arrays as one safetensors file, stored as float32, float16 or bfloat16."""
    if dtype not in NAMES:
        raise ValueError(f"dtype must be one of {sorted(NAMES)}, got {dtype!r}")
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        x = np.asarray(tensors[name], dtype=np.float32)
        stored = f32_to_bf16(x) if dtype == "bfloat16" else x.astype(STORED[NAMES[dtype]])
        raw = np.ascontiguousarray(stored).tobytes()
        header[name] = {"dtype": NAMES[dtype], "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8-byte alignment
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for raw in chunks:
            f.write(raw)
