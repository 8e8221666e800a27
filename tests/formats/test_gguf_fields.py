"""The GGUF reader field by field: every field read as the type the format gives it (unsigned
counts, ids and offsets), every bound the least a record can take, every message naming the
field and the bytes at fault, exactly.

The files are small ones spelled byte by byte (tests/gguf_files.py), so every position in them
is known: a test can cut a file at each byte and say which field the cut falls in, or write a
count of 2^64 - 1, which a reader taking it as signed would read as -1 and skip."""
import struct

import pytest

from gguf_files import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT8, UINT32, encode_value, gguf_bytes
from minitransformer.errors import CheckpointError
from minitransformer.formats.gguf_file import GGUFFile, tensor_bytes

UINT64 = 10
F32, F16, Q8_0 = 0, 1, 8                                  # GGML type ids
SRC = "small.gguf"
U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1

# One entry of each value type, an array of numbers and one of strings (one string empty), and
# a string again past the bytes the header's count check covers (8 keys x 13).
ENTRIES = [["general.architecture", STRING, "qwen2", None], ["a.u8", UINT8, 7, None],
           ["a.i32", INT32, -3, None], ["a.f32", FLOAT32, 0.5, None], ["a.bool", BOOL, True, None],
           ["a.u64", UINT64, 2**40, None], ["a.nums", ARRAY, [1, 2, 3], UINT32],
           ["a.words", ARRAY, ["x", "yz", ""], STRING], ["a.str", STRING, "past the claims", None]]
TENSORS = [["t.f32", [3, 2], F32, bytes(range(24))],     # shape (2, 3): 6 floats
           ["t.q8", [32, 1], Q8_0, bytes(range(34))]]    # shape (1, 32): one block of 34 bytes


def parse(raw: bytes) -> GGUFFile:
    return GGUFFile.parse(raw, SRC)


def refused(raw: bytes) -> str:
    with pytest.raises(CheckpointError) as caught:
        parse(raw)
    return str(caught.value)


def header(n_tensors, n_keys, version=3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_keys)


def key(name: str, kind: int, value, item=None) -> bytes:
    return encode_value(STRING, name) + struct.pack("<I", kind) + encode_value(kind, value, item)


def record(name: str, dims, type_id: int, offset: int) -> bytes:
    return (encode_value(STRING, name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) +
            struct.pack("<IQ", type_id, offset))


# --- a cut anywhere names the field it falls in ---------------------------------------------
def fields(entries, tensors):
    """The file's fields in reading order, from the format's layout (not from the reader):
    [start, length, what the reader calls it, (count, least bytes) for an array's values]."""
    out, at = [], 0

    def field(n, what, claim=None):
        nonlocal at
        out.append((at, n, what, claim))
        at += n

    for n, what in ((4, "the magic number 'GGUF'"), (4, "the version"),
                    (8, "the tensor count"), (8, "the metadata count")):
        field(n, what)
    for i, (name, kind, value, item) in enumerate(entries):
        field(8, f"the length of metadata key {i}")
        field(len(name.encode()), f"metadata key {i}")
        field(4, f"the value type of metadata {name!r}")
        what = f"metadata {name!r}"
        if kind == STRING:
            field(8, f"the length of {what}")
            field(len(value.encode()), what)
        elif kind == ARRAY:
            field(4, f"the element type of {what}")
            field(8, f"the length of {what}")
            if item == STRING:       # each element read on its own, at least its 8-byte length
                out.append((at, 0, what, (len(value), 8 * len(value))))
                for j, s in enumerate(value):
                    field(8, f"the length of {what}[{j}]")
                    field(len(s.encode()), f"{what}[{j}]")
            else:
                size = len(encode_value(item, 0))
                out.append((at, 0, what, (len(value), size * len(value))))
                field(size * len(value), what)
        else:
            field(len(encode_value(kind, value)), what)
    for i, (name, dims, type_id, raw) in enumerate(tensors):
        field(8, f"the length of the name of tensor {i}")
        field(len(name.encode()), f"the name of tensor {i}")
        field(4, f"the dimension count of tensor {name!r}")
        for _ in dims:
            field(8, f"the dimensions of tensor {name!r}")
        field(4, f"the type of tensor {name!r}")
        field(8, f"the data offset of tensor {name!r}")
    return out


def message_at_cut(whole: bytes, cut: int) -> str:
    """What the reader must say of whole[:cut], from the layout and the format's rules."""
    n_keys, n_tensors = len(ENTRIES), len(TENSORS)
    for start, n, what, claim in fields(ENTRIES, TENSORS):
        if start == 24:      # the header read: its counts checked against what follows
            for count, least, things in ((n_keys, 13, "metadata entries"),
                                         (n_tensors, 32, "tensors")):
                if count * least > cut - 24:
                    return (f"{SRC}: truncated or corrupt: the header claims {count} {things}, "
                            f"at least {count * least} more bytes, but the file ends at byte "
                            f"{cut}")
        if claim is not None:
            count, least = claim
            if least > cut - start:
                return (f"{SRC}: truncated: {what} claims {count} elements, at least {least} "
                        f"bytes from byte {start}, but the file ends at byte {cut}")
        elif start + n > cut:
            return (f"{SRC}: truncated: {what} needs bytes [{start}, {start + n}) but the file "
                    f"ends at byte {cut}")
    data_start = len(whole) - 66                      # 24 + padding to 32 + 34
    for (name, dims, type_id, raw), offset in zip(TENSORS, (0, 32), strict=True):
        end = data_start + offset + len(raw)
        if end > cut:
            kind = {F32: "F32", Q8_0: "Q8_0"}[type_id]
            return (f"{SRC}: truncated: tensor {name!r} ({kind} {list(reversed(dims))}, "
                    f"{len(raw)} bytes) needs bytes up to {end} but the file ends at byte {cut}")
    raise AssertionError(f"the cut at {cut} leaves the whole file")


def test_a_cut_at_every_byte_names_the_field_and_the_bytes_it_lacks():
    whole = gguf_bytes(ENTRIES, TENSORS)
    layout = fields(ENTRIES, TENSORS)
    records_end = layout[-1][0] + layout[-1][1]
    assert whole[records_end - 8:records_end] == struct.pack("<Q", 32)   # the layout is right
    assert len(whole) == -(-records_end // 32) * 32 + 66
    parse(whole)                                       # the whole file reads
    for cut in range(len(whole)):
        assert refused(whole[:cut]) == message_at_cut(whole, cut), cut


# --- unsigned fields: the largest value reads as itself, never as -1 -------------------------
def test_the_version_is_unsigned_and_named_with_the_supported_ones():
    assert refused(header(0, 0, U32_MAX)) == \
        f"{SRC}: GGUF version {U32_MAX} is not supported (supported: 2, 3)"
    assert refused(header(0, 0, 1)) == f"{SRC}: GGUF version 1 is not supported (supported: 2, 3)"
    assert refused(header(0, 0, 3 << 24)) == (f"{SRC}: GGUF version {3 << 24} is not supported "
                                              "(supported: 2, 3): a big-endian file")


@pytest.mark.parametrize("counts, things, least", [((U64_MAX, 0), "tensors", 32),
                                                   ((0, U64_MAX), "metadata entries", 13)])
def test_header_counts_are_unsigned(counts, things, least):
    raw = header(*counts) + bytes(40)
    assert refused(raw) == (f"{SRC}: truncated or corrupt: the header claims {U64_MAX} {things}, "
                            f"at least {U64_MAX * least} more bytes, but the file ends at byte 64")


def test_value_and_element_types_are_unsigned_and_named():
    raw = header(0, 1) + encode_value(STRING, "a.x") + struct.pack("<II", U32_MAX, 0)
    assert refused(raw) == \
        f"{SRC}: metadata 'a.x' has value type {U32_MAX}, which is not a GGUF type"
    for item, called in ((U32_MAX, f"type {U32_MAX}"), (ARRAY, "array")):
        raw = header(0, 1) + key("a.x", ARRAY, [], item)
        assert refused(raw) == (f"{SRC}: metadata 'a.x' is an array of {called}: only arrays of "
                                "numbers, booleans or strings are supported")


def test_an_array_length_is_unsigned_and_bounded_by_the_bytes_left():
    start = 24 + len(encode_value(STRING, "a.x")) + 4 + 4 + 8     # after the array's length
    for length, item, least in ((U64_MAX, UINT8, U64_MAX), (1000, UINT32, 4000)):
        raw = header(0, 1) + encode_value(STRING, "a.x") + struct.pack("<IIQ", ARRAY, item,
                                                                       length) + bytes(100)
        assert refused(raw) == (f"{SRC}: truncated: metadata 'a.x' claims {length} elements, at "
                                f"least {least} bytes from byte {start}, but the file ends at "
                                f"byte {start + 100}")


def tensor_file(dims, type_id, offset, n_dims=None, data=b"") -> bytes:
    """Header, one tensor record 'w' (n_dims may lie), padding to 32, then data."""
    raw = header(1, 0) + encode_value(STRING, "w")
    raw += struct.pack("<I", len(dims) if n_dims is None else n_dims)
    raw += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", type_id, offset)
    return raw + bytes(-len(raw) % 32) + data


def test_tensor_fields_are_unsigned():
    padded = len(tensor_file([4], F32, 0))                          # the data section's start
    assert refused(tensor_file([4], F32, 0, n_dims=U32_MAX)) == \
        f"{SRC}: tensor 'w' has {U32_MAX} dimensions (GGUF allows 1 to 4)"
    assert refused(tensor_file([4], U32_MAX, 0)) == (
        f"{SRC}: tensor 'w': its type id {U32_MAX} is no GGML type (ggml's ids run 0..42)")
    raw = tensor_file([U64_MAX], F32, 0, data=bytes(16))
    assert refused(raw) == (f"{SRC}: truncated: tensor 'w' (F32 [{U64_MAX}], {4 * U64_MAX} "
                            f"bytes) needs bytes up to {padded + 4 * U64_MAX} but the file ends "
                            f"at byte {len(raw)}")
    # an offset of 2^64 - 32 is past any file; read as signed, -32, it would point at the header
    raw = tensor_file([4], F32, 2**64 - 32, data=bytes(16))
    assert refused(raw) == (f"{SRC}: truncated: tensor 'w' (F32 [4], 16 bytes) needs bytes up "
                            f"to {padded + 2**64 - 32 + 16} but the file ends at byte {len(raw)}")


# --- the bounds: the least a record takes passes, one byte less does not ---------------------
def test_the_least_a_key_takes_is_13_bytes():
    """An empty key of one u8: 8 + 0 + 4 + 1 bytes, the header's count check lets it through."""
    raw = header(0, 1) + key("", UINT8, 7)
    assert len(raw) == 24 + 13 and parse(raw).metadata == {"": 7}
    assert refused(raw[:-1]).startswith(f"{SRC}: truncated or corrupt: the header claims 1 "
                                        "metadata entries")


def test_the_least_a_tensor_record_takes_is_32_bytes():
    """An empty name, one dimension: 8 + 0 + 4 + 8 + 4 + 8 bytes pass the header's count check
    (the file then ends before its data section)."""
    raw = header(1, 0) + record("", [0], F32, 0)
    assert len(raw) == 24 + 32
    assert refused(raw) == (f"{SRC}: truncated: tensor '' (F32 [0], 0 bytes) needs bytes up to "
                            "64 but the file ends at byte 56")
    assert refused(raw[:-1]).startswith(f"{SRC}: truncated or corrupt: the header claims 1 "
                                        "tensors")


def test_an_array_of_empty_strings_that_ends_the_file_reads():
    """Each string takes at least its 8-byte length: 5 empty ones fill exactly 40 bytes."""
    raw = header(0, 1) + key("a.x", ARRAY, [""] * 5, STRING)
    assert parse(raw).metadata == {"a.x": [""] * 5}


def test_an_alignment_of_1_is_a_power_of_two_and_honoured():
    entries = [["general.alignment", UINT32, 1, None]] + ENTRIES
    raw = gguf_bytes(entries, TENSORS, alignment=1)
    f = parse(raw)
    start = len(raw) - 24 - 34                 # no padding: the data right after the header
    assert [(t.begin, t.end) for t in f.tensors] == [(start, start + 24), (start + 24, len(raw))]
    assert [bytes(f.raw(t)) for t in f.tensors] == [t[3] for t in TENSORS]
    for bad, kind, shown in ((0, UINT32, "0 (uint32)"), (24, UINT32, "24 (uint32)"),
                             ("32", STRING, "'32' (string)")):
        raw = gguf_bytes([["general.alignment", kind, bad, None]], [])
        assert refused(raw) == \
            f"{SRC}: general.alignment must be a uint32 power of two, got {shown}"


def test_four_dimensions_are_allowed_five_are_not():
    f = parse(tensor_file([2, 1, 1, 3], F32, 0, data=bytes(24)))
    assert f.tensors[0].shape == (3, 1, 1, 2)
    assert refused(tensor_file([2, 1, 1, 3, 1], F32, 0, data=bytes(24))) == \
        f"{SRC}: tensor 'w' has 5 dimensions (GGUF allows 1 to 4)"


# --- what a parsed file keeps ------------------------------------------------------------------
def test_the_version_and_the_value_types_are_kept():
    f = parse(gguf_bytes(ENTRIES, TENSORS, version=2))
    assert f.version == 2
    assert f.types == {"general.architecture": "string", "a.u8": "uint8", "a.i32": "int32",
                       "a.f32": "float32", "a.bool": "bool", "a.u64": "uint64",
                       "a.nums": "array", "a.words": "array", "a.str": "string"}
    assert f.metadata == {e[0]: e[2] for e in ENTRIES}


def test_raw_is_a_read_only_uint8_view_of_the_file(tmp_path):
    """Six bytes of F16: raw() gives them as uint8 (not reinterpreted as wider numbers), and the
    mapping is read-only: a tensor cannot be written back into the file through it."""
    path = tmp_path / "f16.gguf"
    path.write_bytes(tensor_file([3], F16, 0, data=bytes([1, 2, 3, 4, 5, 6])))
    f = GGUFFile.open(path)
    got = f.raw(f.tensors[0])
    assert got.dtype == "uint8" and got.tolist() == [1, 2, 3, 4, 5, 6]
    assert not got.flags.writeable


def test_a_row_is_the_innermost_axis():
    """Block formats hold whole blocks along the last axis (numpy order), whatever the rank."""
    assert tensor_bytes("Q8_0", (64,)) == 2 * 34
    assert tensor_bytes("Q8_0", (2, 64, 32)) == 2 * 64 * 34
    with pytest.raises(ValueError) as caught:
        tensor_bytes("Q8_0", (2, 64, 48))
    assert str(caught.value) == ("a Q8_0 row holds whole blocks of 32 weights, but the shape "
                                 "[2, 64, 48] has rows of 48")


# --- the other messages, whole -----------------------------------------------------------------
def test_a_key_not_utf8_names_the_byte():
    raw = header(0, 1) + encode_value(STRING, b"a.\xff") + struct.pack("<IB", UINT8, 1)
    assert refused(raw) == f"{SRC}: metadata key 0 is not UTF-8 (invalid start byte at byte 34)"
    assert raw[34] == 0xFF


def test_tensors_sharing_bytes_are_both_named_with_their_ranges():
    raw = gguf_bytes(ENTRIES, TENSORS, offsets={1: 0})
    start = len(raw) - 66
    assert refused(raw) == (f"{SRC}: tensors 't.f32' [{start}, {start + 24}) and 't.q8' "
                            f"[{start}, {start + 34}) share bytes")
