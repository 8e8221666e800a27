"""The GGUF container, read and checked: a header, a metadata table, tensor records, the data.

A GGUF file is data someone else wrote, so it is read the way safetensors_io.py reads its
format: every count and length is checked against the bytes the file holds before anything is
allocated from it, every tensor's bytes are accounted for, and a failure is a CheckpointError
naming the file and the key or tensor at fault, with the byte where a truncated file ends.
The layout (little-endian; GGUF versions 2 and 3):

    "GGUF"  u32 version  u64 tensor count  u64 metadata count
    metadata, each:  string key  u32 value type  value
        (u8 i8 u16 i16 u32 i32 f32 bool string, or an array: u32 type, u64 count, values)
    tensor records, each:  string name  u32 dims  u64 x dims (innermost first)
                           u32 GGML type  u64 offset into the data section
    padding to general.alignment (32 by default), then the data section

A string is a u64 byte length and UTF-8 bytes. Checked beyond the grammar: no key or tensor
name twice, a tensor's offset a multiple of the alignment, its byte size exactly what its type
and shape take, its bytes inside the file and shared with no other tensor, and every byte of
the data section some tensor's or the alignment's padding (``check_tiling``).

>>> import struct
>>> GGUFFile.parse(b"GGUF" + struct.pack("<IQQ", 3, 0, 0), "empty.gguf").metadata
{}
>>> GGUFFile.parse(b"GGUF" + struct.pack("<IQ", 3, 0), "cut.gguf")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
minitransformer.errors.CheckpointError: cut.gguf: truncated: the metadata count needs bytes ...
"""
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minitransformer.errors import CheckpointError
from minitransformer.formats.gguf_types import FORMATS, PLAIN_FORMATS, SUPPORTED, row_error

MAGIC = b"GGUF"
VERSIONS = (2, 3)
ALIGNMENT = 32                  # general.alignment when the file does not say
MAX_DIMS = 4                    # ggml's limit on a tensor's dimensions

# metadata value type -> struct format of one value (8 string, 9 array are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY = 8, 9
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
              6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64",
              12: "float64"}
# GGML tensor type id -> name (ggml.h), for the error of a type gguf_types.py does not decode:
# every id ggml has given out (the gguf package's GGMLQuantizationType, and those ggml since
# retired or added), so a refused tensor's type is named, never a bare number
GGML_TYPES = dict(enumerate(
    "F32 F16 Q4_0 Q4_1 Q4_2 Q4_3 Q5_0 Q5_1 Q8_0 Q8_1 Q2_K Q3_K Q4_K Q5_K Q6_K Q8_K IQ2_XXS "
    "IQ2_XS IQ3_XXS IQ1_S IQ4_NL IQ3_S IQ2_S IQ4_XS I8 I16 I32 I64 F64 IQ1_M BF16 Q4_0_4_4 "
    "Q4_0_4_8 Q4_0_8_8 TQ1_0 TQ2_0 IQ4_NL_4_4 IQ4_NL_4_8 IQ4_NL_8_8 MXFP4 NVFP4 Q1_0 "
    "Q2_0".split()))


def tensor_bytes(type_name: str, shape) -> int:
    """Bytes a tensor of a supported GGML type and shape (numpy order) takes; a ValueError when
    a row is not whole blocks.

    >>> tensor_bytes("Q8_0", (2, 64)), tensor_bytes("F16", (3, 5))   # 4 blocks of 34; 15 x 2
    (136, 30)
    """
    count = math.prod(shape)            # Python ints: no overflow
    if type_name in PLAIN_FORMATS:
        return count * np.dtype(PLAIN_FORMATS[type_name]).itemsize
    if (why := row_error(type_name, shape)) is not None:
        raise ValueError(why)
    return count // FORMATS[type_name].weights * FORMATS[type_name].nbytes


@dataclass(frozen=True)
class TensorRecord:
    name: str
    type_name: str              # GGML type name: F32, Q8_0, ...
    shape: tuple                # numpy order (outermost first): GGUF lists dims innermost first
    begin: int                  # byte range in the file
    end: int


def check_tiling(tensors, start: int, alignment: int, end: int, source: str) -> None:
    """The tensors, in offset order, tile the data section as a GGUF writer lays them out:
    each begins where the one before it ended, padded to the alignment, and the file ends
    with the last one's padding. A tensor's bytes follow from its type and shape, so a
    type that understates them (F16 written over F32 data) leaves bytes no tensor owns,
    and a type that overstates them runs into the next tensor: either is refused naming the
    tensors, as safetensors_io.py refuses a gap or an overlap, rather than read as garbage.

    >>> t = [TensorRecord("a", "F16", (4,), 32, 40), TensorRecord("b", "F32", (4,), 64, 80)]
    >>> check_tiling(t, 32, 8, 80, "m.gguf")      # alignment 8: b should begin at 40
    Traceback (most recent call last):
    ...
    minitransformer.errors.CheckpointError: m.gguf: tensor 'a' (F16 [4]) takes 8 bytes, but the next tensor 'b' begins 32 bytes after it: bytes [40, 64) are owned by no tensor (its type or shape understates what is stored)
    """
    previous, position = None, start
    for t in tensors:
        if previous is not None and t.begin < previous.end:
            raise CheckpointError(f"{source}: tensors {previous.name!r} [{previous.begin}, "
                                  f"{previous.end}) and {t.name!r} [{t.begin}, {t.end}) "
                                  "share bytes")
        if t.begin > -(-position // alignment) * alignment:
            if previous is None:
                raise CheckpointError(f"{source}: bytes [{position}, {t.begin}) before the "
                                      f"first tensor {t.name!r} are owned by no tensor")
            raise CheckpointError(
                f"{source}: tensor {previous.name!r} ({previous.type_name} "
                f"{list(previous.shape)}) takes {previous.end - previous.begin} bytes, but the "
                f"next tensor {t.name!r} begins {t.begin - previous.begin} bytes after it: "
                f"bytes [{previous.end}, {t.begin}) are owned by no tensor (its type or shape "
                "understates what is stored)")
        if t.end > position:
            previous, position = t, t.end
    if end > -(-position // alignment) * alignment:
        if previous is None:
            raise CheckpointError(f"{source}: the file lists no tensor, but {end - start} "
                                  "bytes of data follow its header")
        raise CheckpointError(
            f"{source}: tensor {previous.name!r} ({previous.type_name} {list(previous.shape)}), "
            f"the last, takes {previous.end - previous.begin} bytes, but the file goes on to "
            f"byte {end}: bytes [{previous.end}, {end}) are owned by no tensor (its type or "
            "shape understates what is stored, or something was appended)")


class Reader:
    """A cursor over the file's bytes that names what it was reading when they run out."""

    def __init__(self, data, source: str):
        self.data, self.source, self.pos = data, source, 0

    def take(self, n: int, what: str):
        if n > len(self.data) - self.pos:
            raise CheckpointError(f"{self.source}: truncated: {what} needs bytes "
                                  f"[{self.pos}, {self.pos + n}) but the file ends at byte "
                                  f"{len(self.data)}")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def scalar(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q", f"the length of {what}"), what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.source}: {what} is not UTF-8 ({e.reason} at byte "
                                  f"{self.pos - len(raw) + e.start})") from None

    def value(self, kind: int, what: str):
        """One metadata value of a type code -> Python (str, int, float, bool, list)."""
        if kind in SCALARS:
            return self.scalar(SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise CheckpointError(f"{self.source}: {what} has value type {kind}, which is "
                                  "not a GGUF type")
        item = self.scalar("I", f"the element type of {what}")
        count = self.scalar("Q", f"the length of {what}")
        smallest = struct.calcsize(SCALARS[item]) if item in SCALARS else 8
        if item not in SCALARS and item != STRING:
            raise CheckpointError(f"{self.source}: {what} is an array of "
                                  f"{TYPE_NAMES.get(item, f'type {item}')}: only arrays of "
                                  "numbers, booleans or strings are supported")
        if count * smallest > len(self.data) - self.pos:   # before anything is allocated
            raise CheckpointError(f"{self.source}: truncated: {what} claims {count} elements, "
                                  f"at least {count * smallest} bytes from byte {self.pos}, but "
                                  f"the file ends at byte {len(self.data)}")
        if item == STRING:
            return [self.string(f"{what}[{i}]") for i in range(count)]
        raw = self.take(count * smallest, what)
        return np.frombuffer(raw, "<" + SCALARS[item]).tolist()


@dataclass(frozen=True)
class GGUFFile:
    path: str
    version: int
    metadata: dict              # key -> str, int, float, bool or list
    types: dict                 # key -> GGUF value type name ("uint32", "array", ...)
    tensors: tuple              # TensorRecord, in the file's order
    data: np.ndarray            # the file's bytes (memory-mapped, uint8)

    @classmethod
    def open(cls, path) -> "GGUFFile":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: GGUF file not found")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: empty file, not a GGUF file")
        return cls.parse(np.memmap(path, dtype=np.uint8, mode="r"), str(path))

    @classmethod
    def parse(cls, data, source: str) -> "GGUFFile":
        """The file's bytes (any buffer) -> its checked header, metadata and tensor records."""
        data = memoryview(data).cast("B")
        r = Reader(data, source)
        if bytes(r.take(4, "the magic number 'GGUF'")) != MAGIC:
            raise CheckpointError(f"{source}: not a GGUF file (it does not start with 'GGUF')")
        version = r.scalar("I", "the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise CheckpointError(f"{source}: GGUF version {version} is not supported "
                                  f"(supported: {', '.join(map(str, VERSIONS))})" +
                                  (": a big-endian file" if swapped in VERSIONS else ""))
        n_tensors = r.scalar("Q", "the tensor count")
        n_keys = r.scalar("Q", "the metadata count")
        rest = len(data) - r.pos    # each key takes >= 13 bytes, each tensor record >= 32
        for count, smallest, what in ((n_keys, 13, "metadata entries"),
                                      (n_tensors, 32, "tensors")):
            if count * smallest > rest:
                raise CheckpointError(f"{source}: truncated or corrupt: the header claims "
                                      f"{count} {what}, at least {count * smallest} more "
                                      f"bytes, but the file ends at byte {len(data)}")
        metadata, types = {}, {}
        for i in range(n_keys):
            key = r.string(f"metadata key {i}")
            if key in metadata:
                raise CheckpointError(f"{source}: metadata key {key!r} appears twice")
            kind = r.scalar("I", f"the value type of metadata {key!r}")
            metadata[key] = r.value(kind, f"metadata {key!r}")
            types[key] = TYPE_NAMES.get(kind)
        alignment = metadata.get("general.alignment", ALIGNMENT)
        if types.get("general.alignment", "uint32") != "uint32" or alignment < 1 or \
                alignment & (alignment - 1):
            raise CheckpointError(f"{source}: general.alignment must be a uint32 power of two, "
                                  f"got {alignment!r} ({types.get('general.alignment')})")
        records = [cls.record(r, i) for i in range(n_tensors)]
        start = -(-r.pos // alignment) * alignment      # the data section, aligned
        tensors, seen = [], set()
        for name, dims, type_id, offset in records:
            where = f"{source}: tensor {name!r}"
            if name in seen:
                raise CheckpointError(f"{where} appears twice")
            seen.add(name)
            if type_id not in GGML_TYPES:
                raise CheckpointError(f"{where}: its type id {type_id} is no GGML type "
                                      f"(ggml's ids run 0..{max(GGML_TYPES)})")
            type_name = GGML_TYPES[type_id]
            if type_name not in SUPPORTED:
                raise CheckpointError(f"{where}: GGML type {type_name} is not supported "
                                      f"(supported: {', '.join(SUPPORTED)})")
            shape = tuple(reversed(dims))
            try:
                size = tensor_bytes(type_name, shape)
            except ValueError as e:
                raise CheckpointError(f"{where}: {e}") from None
            if offset % alignment:
                raise CheckpointError(f"{where}: its data offset {offset} is not a multiple of "
                                      f"the alignment {alignment}")
            begin = start + offset
            if begin + size > len(data):
                raise CheckpointError(f"{source}: truncated: tensor {name!r} ({type_name} "
                                      f"{list(shape)}, {size} bytes) needs bytes up to "
                                      f"{begin + size} but the file ends at byte {len(data)}")
            tensors.append(TensorRecord(name, type_name, shape, begin, begin + size))
        check_tiling(sorted(tensors, key=lambda t: (t.begin, t.end)), start, alignment,
                     len(data), source)
        return cls(source, version, metadata, types, tuple(tensors), data)

    @staticmethod
    def record(r: Reader, i: int) -> tuple:
        """Tensor record i -> (name, dims innermost first, GGML type id, offset)."""
        name = r.string(f"the name of tensor {i}")
        n_dims = r.scalar("I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CheckpointError(f"{r.source}: tensor {name!r} has {n_dims} dimensions "
                                  f"(GGUF allows 1 to {MAX_DIMS})")
        dims = [r.scalar("Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
        type_id = r.scalar("I", f"the type of tensor {name!r}")
        offset = r.scalar("Q", f"the data offset of tensor {name!r}")
        return name, dims, type_id, offset

    def raw(self, tensor: TensorRecord) -> np.ndarray:
        """A tensor's stored bytes, as uint8 (a view of the mapped file: nothing is copied)."""
        return np.frombuffer(self.data[tensor.begin:tensor.end], dtype=np.uint8)
