"""A corpus of broken GGUF files: each is a CheckpointError naming the file and the key or tensor
at fault (a truncated file says where it ends), never an exception from NumPy or `tokenizers`,
never a model loaded from bytes that do not mean what they claim (a type whose size
disagrees with the bytes stored leaves bytes no tensor owns, or runs into the next tensor).

The files are spelled byte by byte by tests/gguf_files.py from the parts of a valid file, so
each case breaks one thing and the valid file is shown to load first."""
import copy
import struct

import numpy as np
import pytest

import minitransformer as mt

pytest.importorskip("gguf")
from gguf_files import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT8, UINT32, gguf_bytes


def write(tmp_path, entries, tensors, **layout):
    path = tmp_path / "broken.gguf"
    path.write_bytes(gguf_bytes(entries, tensors, **layout))
    return path


def entry(entries, key):
    return next(e for e in entries if e[0] == key)


def tensor(tensors, name):
    return next(t for t in tensors if t[0] == name)


def test_the_valid_file_spelled_by_hand_loads(tmp_path, parts):
    model = mt.load(write(tmp_path, *parts))
    assert model.tokenizer is not None and model.eos_token_ids == (0,)
    assert model.tokenizer.decode(model.tokenizer.encode("The cat sat.")) == "The cat sat."


# --- the container ------------------------------------------------------------------------------
def set_value(key, value, kind=None, item=None):
    def edit(entries, tensors):
        e = entry(entries, key)
        e[2], e[1], e[3] = value, e[1] if kind is None else kind, item if item else e[3]
    return edit


def drop(*keys):
    def edit(entries, tensors):
        entries[:] = [e for e in entries if e[0] not in keys and
                      not any(k.endswith("*") and e[0].startswith(k[:-1]) for k in keys)]
    return edit


def add(key, kind, value, item=None):
    def edit(entries, tensors):
        entries.append([key, kind, value, item])
    return edit


def twice_key(entries, tensors):
    entries.append(copy.deepcopy(entry(entries, "qwen2.block_count")))


def twice_tensor(entries, tensors):
    tensors.append(copy.deepcopy(tensor(tensors, "output_norm.weight")))


def dims(name, new):
    def edit(entries, tensors):
        tensor(tensors, name)[1] = new
    return edit


def type_id(name, new):
    def edit(entries, tensors):
        tensor(tensors, name)[2] = new
    return edit


def last_typed_f16(entries, tensors):
    tensors[-1][2] = 1                      # its F32 bytes stay: half of them owned by none


def half_typed_f32(entries, tensors):
    """An F32 tensor whose bytes are cut to those of F16 (and padded): typed F32 it claims
    twice its bytes, the next tensor's."""
    t = tensor(tensors, "blk.0.attn_q.weight")
    t[3] = t[3][:len(t[3]) // 2]


def append_bytes(entries, tensors):
    tensors[-1][3] = tensors[-1][3] + bytes(64)


CONTAINER = {  # name -> (edit of the parts, layout for gguf_bytes, the error's words)
    "bad magic": (None, dict(magic=b"GGML"), "not a GGUF file"),
    "version 1": (None, dict(version=1), "GGUF version 1 is not supported"),
    "big-endian": (None, dict(version=3 << 24), "big-endian"),
    "2^60 tensors": (None, dict(counts=(2**60, 26)), "claims 1152921504606846976 tensors"),
    "2^62 metadata entries": (None, dict(counts=(8, 2**62)), "claims 4611686018427387904 metadata"),
    "a key twice": (twice_key, {}, "metadata key 'qwen2.block_count' appears twice"),
    "a tensor name twice": (twice_tensor, {}, "tensor 'output_norm.weight' appears twice"),
    "a key not UTF-8": (add(b"general.\xff", UINT32, 1), {}, "is not UTF-8 (invalid start byte"),
    "an unknown value type": (add("general.x", 13, 1), {}, "value type 13, which is not"),
    "an array of arrays": (add("general.x", ARRAY, [], ARRAY), {}, "an array of array"),
    "an array of 2^61 strings": (add("general.x", ARRAY, [], STRING), dict(), None),
    "alignment 0": (add("general.alignment", UINT32, 0), {}, "general.alignment must be"),
    "alignment 24": (add("general.alignment", UINT32, 24), {}, "general.alignment must be"),
    "alignment a string": (add("general.alignment", STRING, "32"), {},
                           "general.alignment must be"),
    "an offset off the alignment": (None, dict(offsets={1: 4}),
                                    "data offset 4 is not a multiple of the alignment 32"),
    "two tensors on the same bytes": (None, dict(offsets={1: 0}), "share bytes"),
    "a tensor past the end": (None, dict(offsets={3: 1 << 40}), "truncated: tensor"),
    "0 dimensions": (dims("output_norm.weight", []), {}, "has 0 dimensions"),
    "5 dimensions": (dims("output_norm.weight", [1, 1, 1, 1, 64]), {}, "has 5 dimensions"),
    "a shape larger than its bytes": (dims("output_norm.weight", [64, 1 << 40]), {},
                                      "truncated: tensor 'output_norm.weight'"),
    "an unknown tensor type": (type_id("output_norm.weight", 99), {},
                               "'output_norm.weight': its type id 99 is no GGML type"),
    "an IQ4_XS tensor": (type_id("output_norm.weight", 23), {},
                         "GGML type IQ4_XS is not supported"),
    "Q8_0 rows of 48": (dims("blk.0.ffn_up.weight", [48, 128]), {},
                        "'blk.0.ffn_up.weight': a Q8_0 row holds whole blocks of 32"),
    # a type whose size disagrees with the bytes stored: named, never read as garbage
    "an F32 tensor typed F16": (type_id("blk.0.attn_q.weight", 1), {},
                                "tensor 'blk.0.attn_q.weight' (F16 [64, 64]) takes 8192 bytes, "
                                "but the next tensor"),
    "an F32 tensor typed F16, the last": (last_typed_f16, {}, "the last, takes"),
    "an F16-sized tensor typed F32": (half_typed_f32, {}, "share bytes"),
    "bytes after the last tensor": (append_bytes, {}, "are owned by no tensor"),
    "bytes before the first tensor": (None, dict(offsets={0: 4096}), "before the first tensor"),
    "a Q2_0 tensor": (type_id("output_norm.weight", 42), {}, "GGML type Q2_0 is not supported"),
    "a Q1_0 tensor": (type_id("output_norm.weight", 41), {}, "GGML type Q1_0 is not supported"),
    "a retired Q4_0_4_4 tensor": (type_id("output_norm.weight", 31), {},
                                  "GGML type Q4_0_4_4 is not supported"),
}


@pytest.mark.parametrize("case", CONTAINER)
def test_broken_containers_are_named(tmp_path, parts, case):
    edit, layout, words = CONTAINER[case]
    entries, tensors = copy.deepcopy(parts)
    if edit is not None:
        edit(entries, tensors)
    path = write(tmp_path, entries, tensors, **layout)
    if case == "an array of 2^61 strings":     # a count no file could hold: bounded first
        raw = path.read_bytes()
        at = raw.index(b"general.x") + len(b"general.x") + 4 + 4  # key, type, element type
        path.write_bytes(raw[:at] + struct.pack("<Q", 2**61) + raw[at + 8:])
        words = "claims 2305843009213693952 elements"
    with pytest.raises(mt.CheckpointError) as caught:
        mt.load(path)
    assert str(caught.value).startswith(str(path)) and words in str(caught.value)


def test_a_truncated_file_says_so_and_where_at_every_cut(tmp_path, parts):
    """Cut anywhere before the last tensor's last byte: 'truncated', and the file's end."""
    whole = gguf_bytes(*parts)      # the last tensor's bytes end the file
    rng = np.random.default_rng(0)
    cuts = sorted({*range(0, 200, 7), *rng.integers(200, len(whole), 60).tolist(),
                   len(whole) - 1})
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(whole[:cut])
        with pytest.raises(mt.CheckpointError) as caught:
            mt.load(path)
        message = str(caught.value)
        assert message.startswith(str(path)), message
        assert "truncated" in message and f"ends at byte {cut}" in message or \
            cut == 0 and "empty file" in message, (cut, message)


def test_flipped_header_bytes_are_errors_or_loads_never_crashes(tmp_path, parts):
    """Random damage to the header and metadata: a CheckpointError or a model, nothing else."""
    whole = gguf_bytes(*parts)
    header_end = whole.index(b"output_norm.weight")    # metadata and the first tensor records
    rng = np.random.default_rng(1)
    path = tmp_path / "flipped.gguf"
    seen = {"error": 0, "loaded": 0}
    for _ in range(150):
        raw = bytearray(whole)
        for at in rng.integers(0, header_end, 3):
            raw[at] = int(rng.integers(0, 256))
        path.write_bytes(bytes(raw))
        try:
            mt.load(path)
            seen["loaded"] += 1
        except mt.CheckpointError as e:
            assert str(e).startswith(str(path))
            seen["error"] += 1
    assert seen["error"] > 50, seen


# --- the metadata: config and tokenizer ---------------------------------------------------------
METADATA = {
    # named by the GGUF key, not the config.json field it fills
    "kv heads not dividing the heads": (set_value("qwen2.attention.head_count_kv", 3),
                                        "qwen2.attention.head_count=4 is not a multiple of "
                                        "qwen2.attention.head_count_kv=3"),
    "block count 2^20": (set_value("qwen2.block_count", 2**20),
                         "qwen2.block_count=1048576 is more than 1024"),
    "an odd key length": (lambda e, t: (add("qwen2.attention.key_length", UINT32, 15)(e, t),
                                        set_value("qwen2.rope.dimension_count", 15)(e, t)),
                          "the head dimension 15 (qwen2.attention.key_length"),
    "a tensor missing": (lambda e, t: t.remove(tensor(t, "blk.0.ffn_down.weight")),
                         "missing tensor(s) blk.0.ffn_down.weight"),
    "head count 0": (set_value("qwen2.attention.head_count", 0),
                     "qwen2.attention.head_count must be an integer >= 1, got 0"),
    "head count -4": (set_value("qwen2.attention.head_count", -4, INT32),
                      "qwen2.attention.head_count must be an integer >= 1, got -4"),
    "block count a string": (set_value("qwen2.block_count", "1", STRING),
                             "qwen2.block_count must be an integer >= 1, got '1'"),
    "block count a bool": (set_value("qwen2.block_count", True, BOOL),
                           "qwen2.block_count must be an integer >= 1, got True"),
    "rms eps NaN": (set_value("qwen2.attention.layer_norm_rms_epsilon", float("nan")),
                    "layer_norm_rms_epsilon must be a number > 0"),
    "width not a multiple of the heads": (set_value("qwen2.attention.head_count", 3),
                                          "embedding_length=64 is not a multiple of"),
    "tokens of integers": (set_value("tokenizer.ggml.tokens", [1, 2, 3], ARRAY, UINT32),
                           "tokenizer.ggml.tokens must be an array of strings"),
    "merges of integers": (set_value("tokenizer.ggml.merges", [1, 2], ARRAY, UINT32),
                           "tokenizer.ggml.merges must be an array of strings"),
    "merges a string": (set_value("tokenizer.ggml.merges", "a b", STRING),
                        "tokenizer.ggml.merges must be an array of strings"),
    "a merge of unknown pieces": (lambda e, t: entry(e, "tokenizer.ggml.merges")[2].append(
        "\u4e00 \u4e8c"), "makes or uses '\u4e00', which is not in tokenizer.ggml.tokens"),
    "a merge whose join is unknown": (lambda e, t: entry(e, "tokenizer.ggml.merges")[2].append(
        "a z"), "makes or uses 'az'"),
    "a merge of one piece": (lambda e, t: entry(e, "tokenizer.ggml.merges")[2].append("ab"),
                             "is not two pieces separated by one space"),
    "merges missing": (drop("tokenizer.ggml.merges"), "tokenizer.ggml.merges is missing"),
    "tokens missing": (drop("tokenizer.ggml.tokens"),
                       "partial tokenizer metadata: tokenizer.chat_template"),
    "only a chat template": (drop("tokenizer.ggml.*"), "partial tokenizer metadata"),
    "a token twice": (lambda e, t: entry(e, "tokenizer.ggml.tokens")[2].__setitem__(5, "a"),
                      "holds 'a' twice"),
    "token types of strings": (set_value("tokenizer.ggml.token_type", ["1"], ARRAY, STRING),
                               "token_type must be an array of integers"),
    "token types too few": (set_value("tokenizer.ggml.token_type", [1], ARRAY, INT32),
                            "token_type has 1 entries"),
    "eos outside the vocabulary": (set_value("tokenizer.ggml.eos_token_id", 300),
                                   "tokenizer.ggml.eos_token_id=300 is not a token id"),
    "bos outside the vocabulary": (set_value("tokenizer.ggml.bos_token_id", 2**32 - 1),
                                   "tokenizer.ggml.bos_token_id=4294967295 is not a token id"),
    "eos a float": (set_value("tokenizer.ggml.eos_token_id", 1.0, FLOAT32),
                    "tokenizer.ggml.eos_token_id=1.0 is not a token id"),
    "add_bos a number": (set_value("tokenizer.ggml.add_bos_token", 1, UINT8),
                         "tokenizer.ggml.add_bos_token must be a bool"),
    "chat template an array": (set_value("tokenizer.chat_template", ["{{ x }}"], ARRAY, STRING),
                               "tokenizer.chat_template must be a string, got list"),
    "pre a number": (set_value("tokenizer.ggml.pre", 2, UINT32),
                     "tokenizer.ggml.pre must be a string"),
    "model not gpt2": (set_value("tokenizer.ggml.model", "llama"),
                       "tokenizer.ggml.model='llama' is not supported"),
    "more tokens than the model embeds": (set_value("qwen2.vocab_size", 200),
                                          "has 300 tokens but the model embeds only 200"),
}


@pytest.mark.parametrize("case", METADATA)
def test_broken_metadata_names_the_key(tmp_path, parts, case):
    edit, words = METADATA[case]
    entries, tensors = copy.deepcopy(parts)
    edit(entries, tensors)
    path = write(tmp_path, entries, tensors)
    with pytest.raises(mt.CheckpointError) as caught:
        mt.load(path)
    assert str(caught.value).startswith(str(path)) and words in str(caught.value), \
        str(caught.value)


def test_no_tokenizer_metadata_at_all_loads_weights_only(tmp_path, parts):
    entries, tensors = copy.deepcopy(parts)
    drop("tokenizer.*")(entries, tensors)
    model = mt.load(write(tmp_path, entries, tensors))
    assert model.tokenizer is None and model.eos_token_ids == ()
    assert len(mt.generate(model, [1, 2, 3], 4)) == 4


# --- k-quant tensors ----------------------------------------------------------------------------
def fp16_at(name, block_bytes, block, at, value):
    """Write an fp16 value into one block of a tensor's bytes (at: its offset in the block)."""
    def edit(entries, tensors):
        t = tensor(tensors, name)
        start = block * block_bytes + at
        t[3] = t[3][:start] + struct.pack("<e", value) + t[3][start + 2:]
    return edit


def last(name):
    """Move a tensor to the end of the data section (to cut the file inside it)."""
    def edit(entries, tensors):
        tensors.append(tensors.pop(tensors.index(tensor(tensors, name))))
    return edit


K_QUANTS = {  # name -> (edit of the parts, bytes cut off the end, the error's words)
    "a Q4_K super-block cut short": (
        last("blk.0.ffn_up.weight"), 100,
        "truncated: tensor 'blk.0.ffn_up.weight' (Q4_K [256, 256], 36864 bytes) needs bytes up "
        "to"),
    "Q4_K rows of 576": (dims("blk.0.ffn_up.weight", [576, 64]), 0,
                         "tensor 'blk.0.ffn_up.weight': a Q4_K row holds whole super-blocks of "
                         "256 weights, but the shape [64, 576] has rows of 576"),
    "Q6_K rows of 32": (dims("blk.0.ffn_gate.weight", [32, 2048]), 0,
                        "tensor 'blk.0.ffn_gate.weight': a Q6_K row holds whole super-blocks "
                        "of 256 weights, but the shape [2048, 32] has rows of 32"),
    "an inf super-scale in Q4_K": (
        fp16_at("blk.0.ffn_up.weight", 144, 3, 0, float("inf")), 0,
        "tensor 'blk.0.ffn_up.weight': Q4_K block 0 of row 3 decodes to"),
    "a NaN super-minimum in Q5_K": (
        fp16_at("blk.0.ffn_down.weight", 176, 5, 2, float("nan")), 0,
        "tensor 'blk.0.ffn_down.weight': Q5_K block 0 of row 5 decodes to nan"),
    "a NaN super-scale in Q6_K": (
        fp16_at("blk.0.ffn_gate.weight", 210, 200, 208, float("nan")), 0,
        "tensor 'blk.0.ffn_gate.weight': Q6_K block 0 of row 200 decodes to nan"),
    "an inf super-scale in Q3_K": (
        fp16_at("blk.0.attn_q.weight", 110, 0, 108, -float("inf")), 0,
        "tensor 'blk.0.attn_q.weight': Q3_K block 0 of row 0 decodes to"),
    "an inf super-minimum in Q2_K": (
        fp16_at("blk.0.attn_k.weight", 84, 127, 82, float("inf")), 0,
        "tensor 'blk.0.attn_k.weight': Q2_K block 0 of row 127 decodes to"),
}


def test_the_valid_k_quant_file_loads(tmp_path, kquant_parts):
    model = mt.load(write(tmp_path, *kquant_parts))
    assert model.config.hidden_size == 256 and model.tokenizer is None


@pytest.mark.parametrize("case", K_QUANTS)
def test_broken_k_quant_tensors_are_named(tmp_path, kquant_parts, case):
    edit, cut, words = K_QUANTS[case]
    entries, tensors = copy.deepcopy(kquant_parts)
    edit(entries, tensors)
    path = write(tmp_path, entries, tensors)
    if cut:
        path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(mt.CheckpointError) as caught:
        mt.load(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and words in message and "\n" not in message, message
