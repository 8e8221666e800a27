"""A corpus of malformed checkpoints, made by code: every one must be refused by a
CheckpointError (a ValueError) whose message names the file and the culprit (field or tensor),
in little work and little memory; none may load.

Each case copies a good tiny checkpoint, breaks one thing, and states which file and which
words the error must name. Classes: safetensors headers (types, ranges, offsets that overlap,
leave gaps or trailing bytes, truncation), shard indexes (types, paths leaving the directory,
a tensor in two shards), config.json (types, NaN / inf, absurd sizes), side files
(generation_config.json, tokenizer_config.json: not objects, not UTF-8, ids of the wrong type),
non-finite weights, and paths that are not checkpoint directories.
"""
import json
import math
import shutil
import struct
import sys
import tracemalloc

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import CheckpointError
from minitransformer.formats.safetensors_io import read_tensors, write_tensors

# Per case, the work and memory a refusal may take, counted rather than timed: the Python
# lines it runs (and the calls and returns between them, as sys.settrace reports them) and
# tracemalloc's peak. Measured: at most 10,916 events (a tensor in two shards; loading the good
# checkpoint takes 8,758) and a few MB. Ten times that many still stops a refusal that walks a
# claimed count or size.
EVENTS, PEAK_BYTES = 110_000, 64 * 2 ** 20


class TooMuchWork(Exception):
    pass


def counting(budget):
    """A trace function that counts events and raises TooMuchWork past the budget."""
    events = [0]

    def trace(frame, event, arg):
        events[0] += 1
        if events[0] > budget:
            raise TooMuchWork(f"more than {budget:,} lines and calls to refuse")
        return trace
    return trace


CASES = {}  # id -> (break the checkpoint at path, file the error names, words it names)


def case(name, file, *words):
    def register(fn):
        CASES[name] = (fn, file, words)
        return fn
    return register


# ---- raw safetensors surgery ---------------------------------------------------------------

def read_raw(file):
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def write_raw(file, header, data):
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(head)) + head + data)


def edit_header(path, change):
    """change(header) edits the header of model.safetensors in place; data bytes unchanged."""
    file = path / "model.safetensors"
    header, data = read_raw(file)
    change(header)
    write_raw(file, header, data)


Q0, O0 = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
NORM = "model.norm.weight"


def set_entry(name, **fields):
    return lambda path: edit_header(path, lambda h: h[name].update(fields))


for label, fields in {
    "offsets-float": dict(data_offsets=[0.0, 128.0]),
    "offsets-string": dict(data_offsets=["0", "128"]),
    "offsets-one": dict(data_offsets=[0]),
    "offsets-negative": dict(data_offsets=[-128, 0]),
    "offsets-reversed": dict(data_offsets=[128, 0]),
    "offsets-null": dict(data_offsets=None),
}.items():
    case(f"safetensors-{label}", "model.safetensors", NORM, "data_offsets")(
        set_entry(NORM, **fields))
for label, shape in {"negative": [-32], "float": [32.0], "non-integer": [2.5],
                     "string": ["32"], "scalar": 32, "bool": [True] * 32}.items():
    case(f"safetensors-shape-{label}", "model.safetensors", NORM, "shape")(
        set_entry(NORM, shape=shape))
case("safetensors-shape-overflowing", "model.safetensors", NORM, "should take")(
    set_entry(NORM, shape=[2 ** 62, 2 ** 62, 2 ** 62]))
case("safetensors-shape-mismatch", "model.safetensors", NORM, "should take")(
    set_entry(NORM, shape=[33]))
case("safetensors-dtype-list", "model.safetensors", NORM, "dtype")(
    set_entry(NORM, dtype=["F32"]))
case("safetensors-dtype-unknown", "model.safetensors", NORM, "dtype", "F8")(
    set_entry(NORM, dtype="F8"))
case("safetensors-entry-extra-key", "model.safetensors", NORM, "exactly")(
    set_entry(NORM, offsets=[0, 1]))


@case("safetensors-entry-list", "model.safetensors", NORM, "header entry")
def _(path):
    edit_header(path, lambda h: h.update({NORM: [1, 2, 3]}))


@case("safetensors-entry-missing-key", "model.safetensors", NORM, "exactly")
def _(path):
    edit_header(path, lambda h: h[NORM].pop("shape"))


@case("safetensors-overlap", "model.safetensors", "overlaps")
def _(path):  # two (32, 32) tensors on the same bytes (q_proj's own bytes, later, own nothing)
    edit_header(path, lambda h: h[Q0].update(data_offsets=h[O0]["data_offsets"]))


@case("safetensors-gap", "model.safetensors", "owned by no tensor")
def _(path):  # drop the first tensor's entry: its bytes stay, owned by none
    edit_header(path, lambda h: h.pop(min(h, key=lambda k: h[k]["data_offsets"][0])))


@case("safetensors-trailing-bytes", "model.safetensors", "8 trailing bytes")
def _(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes() + bytes(8))


@case("safetensors-truncated", "model.safetensors", "truncated")
def _(path):
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-4])


@case("safetensors-tiny", "model.safetensors", "truncated")
def _(path):
    (path / "model.safetensors").write_bytes(b"\x01\x02")


@case("safetensors-header-length", "model.safetensors", "header length")
def _(path):
    file = path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 2 ** 63) + file.read_bytes()[8:])


@case("safetensors-header-list", "model.safetensors", "not a JSON object")
def _(path):
    write_raw(path / "model.safetensors", [1, 2], b"")


@case("safetensors-header-not-utf8", "model.safetensors", "malformed safetensors header")
def _(path):
    write_raw(path / "model.safetensors", b'{"\xff\xfe": 1}', b"")


@case("safetensors-header-deeply-nested", "model.safetensors", "malformed safetensors header")
def _(path):
    write_raw(path / "model.safetensors", b"[" * 100_000 + b"]" * 100_000, b"")


@case("safetensors-header-empty", "model.safetensors", "empty safetensors header")
def _(path):
    write_raw(path / "model.safetensors", b" " * 8, read_raw(path / "model.safetensors")[1])


@case("safetensors-header-no-tensor", "model.safetensors", "lists no tensor", "bytes of data")
def _(path):
    write_raw(path / "model.safetensors", {}, read_raw(path / "model.safetensors")[1])


@case("safetensors-duplicate-key", "model.safetensors", NORM, "twice")
def _(path):  # json.loads would keep the second entry: one tensor silently gone
    file = path / "model.safetensors"
    header, data = read_raw(file)
    text = json.dumps(header)
    entry = json.dumps({NORM: header[NORM]})[1:-1]
    write_raw(file, text.replace("{", "{" + entry + ", ", 1).encode(), data)


@case("safetensors-metadata-list", "model.safetensors", "__metadata__")
def _(path):
    edit_header(path, lambda h: h.update(__metadata__=["x"]))


# ---- shard indexes ---------------------------------------------------------------------------

INDEX = "model.safetensors.index.json"


def shard(path, weight_map=None, index=None, duplicate=None):
    """Split model.safetensors into two shards; then write the given index or weight_map.
    duplicate: a tensor name written into both shards."""
    tensors = {k: np.asarray(v) for k, (_, v) in read_tensors(path / "model.safetensors").items()}
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in parts.items():
        extra = [duplicate] if duplicate and duplicate not in part else []
        write_tensors(path / file, {k: tensors[k] for k in part + extra})
    good = {k: file for file, part in parts.items() for k in part}
    if index is None:
        index = json.dumps({"weight_map": good if weight_map is None else weight_map(good)})
    (path / INDEX).write_bytes(index if isinstance(index, bytes) else index.encode())


for label, make in {
    "weight-map-list": lambda good: list(good),
    "weight-map-to-int": lambda good: {k: 1 for k in good},
    "weight-map-empty": lambda good: {},
    "shard-absolute": lambda good: {**good, NORM: "/etc/passwd"},
    "shard-parent": lambda good: {**good, NORM: "../elsewhere/b.safetensors"},
}.items():
    case(f"index-{label}", INDEX, "weight_map")(lambda path, make=make: shard(path, make))
case("index-list", INDEX, "expected a shard index")(lambda p: shard(p, index="[]"))


@case("index-beside-a-single-file", INDEX, "model.safetensors", "which")
def _(path):
    single = (path / "model.safetensors").read_bytes()
    shard(path)
    (path / "model.safetensors").write_bytes(single)
case("index-not-json", INDEX, "not valid JSON")(lambda p: shard(p, index="{"))
case("index-not-utf8", INDEX, "not UTF-8")(lambda p: shard(p, index=b'{"\xff": 1}'))
case("index-missing-shard", "c.safetensors", "not found")(
    lambda p: shard(p, lambda good: {**good, NORM: "c.safetensors"}))
case("index-tensor-in-two-shards", "b.safetensors", NORM, "also stored in")(
    lambda p: shard(p, duplicate=NORM))
case("index-tensor-in-other-shard", "a.safetensors", NORM, "does not place")(  # NORM is in a
    lambda p: shard(p, lambda good: {**good, NORM: "b.safetensors" if good[NORM] == "a.safetensors"
                                     else "a.safetensors"}))


# ---- config.json -----------------------------------------------------------------------------

def config_case(name, *words, **changes):
    def change(path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | changes))
    case(f"config-{name}", "config.json", *words)(change)


config_case("layers-1e9", "num_hidden_layers", "1000000000", num_hidden_layers=10 ** 9)
config_case("layers-1e6", "num_hidden_layers", num_hidden_layers=10 ** 6)
config_case("vocab-1e12", "vocab_size", vocab_size=10 ** 12)
config_case("positions-1e15", "max_position_embeddings", max_position_embeddings=10 ** 15)
config_case("eps-nan", "rms_norm_eps", "nan", rms_norm_eps=math.nan)
config_case("eps-negative", "rms_norm_eps", rms_norm_eps=-1e-6)
config_case("eps-string", "rms_norm_eps", rms_norm_eps="1e-6")
config_case("theta-inf", "rope_theta", "inf", rope_theta=math.inf)
config_case("theta-nested-nan", "rope_theta", rope_theta=None,
            rope_parameters={"rope_type": "default", "rope_theta": math.nan})
config_case("rope-parameters-list", "rope_parameters", rope_parameters=[1])
config_case("architectures-int", "architectures", architectures=5)
config_case("architectures-list-of-int", "architectures", architectures=[5])
config_case("model-type-int", "unsupported architecture", architectures=None, model_type=5)
config_case("hidden-float", "hidden_size", "integer", hidden_size=32.0)
config_case("hidden-bool", "hidden_size", "integer", hidden_size=True)
config_case("heads-zero", "num_attention_heads", num_attention_heads=0)
config_case("head-dim-odd", "head_dim", head_dim=7)
config_case("kv-heads-not-divisor", "num_key_value_heads", num_key_value_heads=3)
config_case("tie-string", "tie_word_embeddings", tie_word_embeddings="yes")
config_case("sliding-string", "use_sliding_window", use_sliding_window="no")
config_case("dtype-int", "torch_dtype", torch_dtype=5)
config_case("hidden-act-list", "hidden_act", hidden_act=["silu"])


@case("config-list", "config.json", "expected a JSON object")
def _(path):
    (path / "config.json").write_text("[1, 2]")


@case("config-not-utf8", "config.json", "not UTF-8")
def _(path):
    (path / "config.json").write_bytes(b'{"vocab_size": "\xe9"}')


@case("config-duplicate-key", "config.json", "duplicate", "hidden_size")
def _(path):
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text.replace("{", '{"hidden_size": 64, ', 1))


# ---- side files ------------------------------------------------------------------------------

GEN = "generation_config.json"
for label, eos in {"float": 2.7, "string": "x", "object": {}, "bool": True, "negative": -1,
                   "list-with-string": [1, "x"], "list-of-lists": [[1]]}.items():
    case(f"generation-config-eos-{label}", GEN, "eos_token_id")(
        lambda path, eos=eos: (path / GEN).write_text(json.dumps({"eos_token_id": eos})))
case("generation-config-eos-outside-vocab", GEN, "eos_token_id", "1024", "outside")(
    lambda path: (path / GEN).write_text(json.dumps({"eos_token_id": [2, 1024]})))
case("generation-config-list", GEN, "expected a JSON object")(
    lambda path: (path / GEN).write_text("[2]"))
case("generation-config-not-utf8", GEN, "not UTF-8")(
    lambda path: (path / GEN).write_bytes(b"\xff\xfe{}"))
case("generation-config-not-json", GEN, "not valid JSON")(
    lambda path: (path / GEN).write_text("{'eos_token_id': 2}"))
config_case("eos-in-config-float", "eos_token_id", eos_token_id=2.5)

TOK = "tokenizer_config.json"
for label, settings in {"bos-int": {"bos_token": 5}, "bos-content-int": {"bos_token":
                        {"content": 5}}, "add-bos-string": {"add_bos_token": "yes"}}.items():
    case(f"tokenizer-config-{label}", TOK, next(iter(settings)))(
        lambda path, s=settings: (path / TOK).write_text(json.dumps(s)))
case("tokenizer-config-list", TOK, "expected a JSON object")(
    lambda path: (path / TOK).write_text("[]"))
case("tokenizer-config-not-utf8", TOK, "not UTF-8")(
    lambda path: (path / TOK).write_bytes(b'{"bos_token": "\xc3"}'))


# ---- non-finite weights ----------------------------------------------------------------------

def poison(name, value, dtype="float32"):
    def change(path):
        tensors = {k: np.array(v) for k, (_, v) in read_tensors(path / "model.safetensors").items()}
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = value
        with np.errstate(over="ignore"):  # the float16 case overflows on purpose
            write_tensors(path / "model.safetensors", tensors, dtype)
    return change


case("weights-nan", "model.safetensors", Q0, "non-finite")(poison(Q0, np.nan))
case("weights-inf-bf16", "model.safetensors", NORM, "non-finite")(poison(NORM, np.inf, "bfloat16"))
case("weights-overflow-f16", "model.safetensors", O0, "non-finite")(
    poison(O0, 1e6, "float16"))  # 1e6 is finite in float32 but inf once stored as float16


# ---- the corpus, run -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A good fp32 checkpoint with a tokenizer (so tokenizer_config.json is read)."""
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
    path = tmp_path_factory.mktemp("good") / "ckpt"
    config = qwen2_config(num_key_value_heads=4, tie_word_embeddings=False, vocab_size=1024)
    return make_checkpoint(path, config, seed=1, tokenizer=train_tokenizer())


def test_the_good_checkpoint_loads(good):
    assert mt.load(good).config.num_hidden_layers == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_checkpoint_is_refused_naming_the_culprit(good, tmp_path, name):
    brk, file, words = CASES[name]
    path = tmp_path / "ckpt"
    shutil.copytree(good, path)
    brk(path)
    tracemalloc.start()
    tracer = sys.gettrace()                     # coverage's or a debugger's, put back after
    sys.settrace(counting(EVENTS))
    try:
        with pytest.raises(CheckpointError) as caught:
            mt.load(path)
    finally:
        sys.settrace(tracer)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    message = str(caught.value)
    assert file in message, f"the error does not name {file}: {message}"
    for word in words:
        assert word in message, f"the error does not name {word!r}: {message}"
    assert "\n" not in message
    assert peak < PEAK_BYTES, f"{peak / 2 ** 20:.0f} MB to refuse"


def test_the_corpus_covers_every_class():
    prefixes = {name.split("-")[0] for name in CASES}
    assert prefixes == {"safetensors", "index", "config", "generation", "tokenizer", "weights"}
    assert len(CASES) >= 80


def test_load_of_a_file_or_nothing_says_what_it_is(good, tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: is a file; load takes a checkpoint "
                                              r"directory"):
        mt.load(good / "config.json")
    with pytest.raises(CheckpointError, match=r"nope: checkpoint directory not found"):
        mt.load(tmp_path / "nope")


def test_a_symlinked_shard_inside_the_index_is_followed(good, tmp_path):
    """The Hugging Face cache links files to blobs elsewhere: a link is not an escape."""
    path = tmp_path / "ckpt"
    shutil.copytree(good, path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (path / "model.safetensors").rename(blobs / "x")
    (path / "model.safetensors").symlink_to(blobs / "x")
    names = list(read_tensors(path / "model.safetensors"))
    (path / INDEX).write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    assert mt.load(path).config.vocab_size == 1024


def test_zero_size_tensors_and_metadata_are_legal(tmp_path):
    write_tensors(tmp_path / "m.safetensors", {"a": np.zeros((0, 3)), "b": np.ones(2)})
    header, data = read_raw(tmp_path / "m.safetensors")
    header["__metadata__"] = {"format": "pt"}
    write_raw(tmp_path / "m.safetensors", header, data)
    tensors = read_tensors(tmp_path / "m.safetensors")
    assert tensors["a"][1].shape == (0, 3) and tensors["b"][1].tolist() == [1.0, 1.0]


CONFIG_MISTAKES = [  # (field, bad value, what the message says)
    ("num_hidden_layers", 2.5, "field 'num_hidden_layers' must be an integer, got 2.5"),
    ("hidden_size", 0, "field 'hidden_size' must be in [1, "),
    ("vocab_size", True, "field 'vocab_size' must be an integer, got True"),
    ("rms_norm_eps", -1e-6, "field 'rms_norm_eps' must be a finite number > 0"),
    ("rope_theta", float("nan"), "field 'rope_theta' must be a finite number > 0"),
    ("tie_word_embeddings", 1, "field 'tie_word_embeddings' must be true or false"),
    ("model_type", "gpt2", "model_type='gpt2' is not one of"),
    ("num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("head_dim", 15, "head_dim=15 must be even for RoPE"),
    ("torch_dtype", None, "field 'torch_dtype' must be a name"),
]


@pytest.mark.parametrize("name, bad, says", CONFIG_MISTAKES, ids=[c[0] for c in CONFIG_MISTAKES])
def test_a_model_config_built_in_python_is_held_to_config_jsons_rules(name, bad, says):
    """A ModelConfig made by hand, or changed with dataclasses.replace (a draft's first
    layers), is refused with the message config.json's reader gives, the source named
    "ModelConfig"."""
    import dataclasses

    from minitransformer.checkpoints.synth import qwen2_config
    from minitransformer.config import ModelConfig
    config = ModelConfig.from_dict(qwen2_config(num_attention_heads=4, num_key_value_heads=2,
                                                hidden_size=64, head_dim=16))
    with pytest.raises(CheckpointError) as e:
        dataclasses.replace(config, **{name: bad})
    assert str(e.value).startswith("ModelConfig: ") and says in str(e.value)


def test_a_cut_safetensors_file_blames_the_tensor_cut_short_not_the_last_listed(tmp_path):
    """'a' [0, 8) reaches past the 4 bytes stored; an empty 'b' at [8, 8) sorts after it and
    was once blamed for it."""
    from minitransformer.formats.safetensors_io import read_header
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}
    blob = json.dumps(header).encode()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(4))
    with pytest.raises(CheckpointError, match=r"truncated: tensor 'a' at \[0, 8\) needs bytes "
                                              r"up to 8 of the data section but the file "
                                              r"holds only 4$"):
        read_header(path)
