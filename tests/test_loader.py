"""The loader: real formats read exactly, and every malformed checkpoint named in its error."""
import json
import shutil
import struct

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import CheckpointError
from minitransformer.backend import to_numpy
from minitransformer.formats.safetensors_io import (
    bf16_to_f32,
    f32_to_bf16,
    read_tensors,
    write_tensors,
)


def copy(checkpoint_dir, tmp_path, name="qwen2-gqa-tied-bf16"):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(name), dst)
    return dst


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key, value in changes.items():
        if value is None:
            del config[key]
    (path / "config.json").write_text(json.dumps(config))


def rewrite_weights(path, change):
    """Load the stored float32 tensors, let `change` edit the dict, write fp32."""
    tensors = {k: np.array(v, dtype=np.float32) if d == "F32" else bf16_to_f32(v)
               for k, (d, v) in read_tensors(path / "model.safetensors").items()}
    change(tensors)
    write_tensors(path / "model.safetensors", tensors, "float32")


def test_bf16_widening_is_exact_and_narrowing_rounds_to_nearest_even():
    bits = np.arange(0, 2 ** 16, dtype=np.uint32).astype(np.uint16)
    finite = ~np.isnan(bf16_to_f32(bits))
    # every bf16 value survives a round trip through float32 unchanged
    np.testing.assert_array_equal(f32_to_bf16(bf16_to_f32(bits))[finite], bits[finite])
    one = np.float32(1.0)
    halfway = np.array([one + np.float32(2 ** -8)], dtype=np.float32)      # tie -> even (1.0)
    above = np.array([one + np.float32(2 ** -8 + 2 ** -20)], dtype=np.float32)
    assert bf16_to_f32(f32_to_bf16(halfway))[0] == 1.0
    assert bf16_to_f32(f32_to_bf16(above))[0] == one + np.float32(2 ** -7)


def test_our_reader_agrees_with_the_safetensors_library(tmp_path):
    from safetensors.numpy import load_file, save_file
    x = {"a": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32),
         "b": np.arange(6, dtype=np.float16).reshape(2, 3)}
    save_file(x, str(tmp_path / "m.safetensors"))
    ours = read_tensors(tmp_path / "m.safetensors")
    for k, v in load_file(str(tmp_path / "m.safetensors")).items():
        assert ours[k][1].dtype == v.dtype
        np.testing.assert_array_equal(ours[k][1], v)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_storage_dtypes_load_to_float32(tmp_path, dtype):
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, random_weights
    path = make_checkpoint(tmp_path / dtype, qwen2_config(), seed=3, dtype=dtype)
    model = mt.load(path)
    w = to_numpy(model.weights["model.layers.0.mlp.up_proj.weight"])
    assert w.dtype == np.float32
    exact = random_weights(qwen2_config(), seed=3)["model.layers.0.mlp.up_proj.weight"]
    stored = {"float32": exact, "float16": exact.astype(np.float16).astype(np.float32),
              "bfloat16": bf16_to_f32(f32_to_bf16(exact))}[dtype]
    np.testing.assert_array_equal(w, stored)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout, products", [("row-major", None), ("column-major", None),
                                              (None, None), (None, "flat")])
def test_a_loaded_model_holds_nothing_of_its_file(tmp_path, monkeypatch, tied, layout, products):
    """float32 matrices reach the Model as views of the mapped file (copied once, where they
    are laid out): every array it keeps must be its own, so a file overwritten after the load
    changes nothing (each weight, laid out or not, the untied embedding, the layers' fields)."""
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, random_weights
    from minitransformer.kernels import blas
    monkeypatch.setattr(blas, "FIXED_LAYOUT", layout)             # None: measured (or recalled)
    monkeypatch.setattr(blas, "FIXED", products)                  # MT_PRODUCTS: its own layout
    config = qwen2_config(tie_word_embeddings=tied)
    path = make_checkpoint(tmp_path / "ckpt", config, seed=5)
    model = mt.load(path)
    file = path / "model.safetensors"
    header = 8 + struct.unpack("<Q", file.read_bytes()[:8])[0]
    with open(file, "r+b") as f:                                   # same size: no SIGBUS
        f.seek(header)
        f.write(bytes(file.stat().st_size - header))
    exact = random_weights(config, seed=5)
    for name, w in model.weights.items():
        np.testing.assert_array_equal(to_numpy(w), exact[name], err_msg=name)
    layer = model.layers[0]
    for field in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down"):
        assert np.any(to_numpy(getattr(layer, field)) != 0), field


def test_sharded_checkpoint_loads_the_same(checkpoint_dir, tmp_path):
    src = checkpoint_dir("qwen2-mha-untied")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = {k: v for k, (_, v) in read_tensors(dst / "model.safetensors").items()}
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        write_tensors(dst / file, {k: tensors[k] for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, part in shards.items() for k in part}}))
    ids = [1, 2, 3, 4]
    np.testing.assert_array_equal(mt.logits(mt.load(dst), ids), mt.logits(mt.load(src), ids))


def test_missing_directory_and_files(tmp_path, checkpoint_dir):
    with pytest.raises(CheckpointError, match="directory not found"):
        mt.load(tmp_path / "nope")
    path = copy(checkpoint_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        mt.load(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        mt.load(path)


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unsupported architecture"),
    (dict(hidden_size=None), "'hidden_size' is missing"),
    (dict(num_key_value_heads=3), "not a multiple"),
    (dict(hidden_size="32"), "must be an integer"),
    (dict(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling.rope_type='yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "rope_scaling.original_max_position_embeddings is missing"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}),
     "rope_scaling field.s. 'attention_factor' are not supported"),
    (dict(rope_scaling={"rope_type": "linear", "factor": -2.0}), "must be a finite number > 0"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                        "high_freq_factor": 1.0, "original_max_position_embeddings": 64}),
     "high_freq_factor=1.0 must be greater than low_freq_factor=4.0"),
    (dict(rope_scaling={"rope_type": ["llama3"]}), "rope_type=.'llama3'. is not supported"),
    (dict(use_sliding_window=True, sliding_window=4, layer_types=["full_attention"]),
     "layer_types must list 2 of full_attention, sliding_attention"),
    (dict(use_sliding_window=True, sliding_window=4, layer_types=["full", "sliding"]),
     "layer_types must list 2"),
    (dict(use_sliding_window=True, max_window_layers=0), "'sliding_window' is missing"),
    (dict(use_sliding_window=True, sliding_window=0, max_window_layers=0),
     r"'sliding_window' must be in \[1"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(use_sliding_window=True, sliding_window=4), "'max_window_layers' is missing"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(num_hidden_layers=0), r"must be in \[1, 1024\], got 0"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "rope_type"),
])
def test_bad_config_fields(tmp_path, checkpoint_dir, changes, message):
    path = copy(checkpoint_dir, tmp_path)
    edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        mt.load(path)


def test_malformed_config_json(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        mt.load(path)


def test_config_disagreeing_with_tensors_names_the_tensor(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    edit_config(path, intermediate_size=65)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                              r"\(64, 32\) but config.json implies \(65, 32\)"):
        mt.load(path)


def test_missing_extra_and_wrongly_typed_tensors(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError,
                       match=r"missing tensor\(s\) model.layers.1.self_attn.k_proj"):
        mt.load(path)
    path = copy(checkpoint_dir, tmp_path / "b")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model.layers.0.extra"):
        mt.load(path)
    path = copy(checkpoint_dir, tmp_path / "c", "qwen2-mha-untied")  # float32 storage
    from safetensors.numpy import save_file
    tensors = {k: v for k, (_, v) in read_tensors(path / "model.safetensors").items()}
    tensors["model.norm.weight"] = np.zeros(32, dtype=np.int32)  # right shape, wrong type
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has dtype I32"):
        mt.load(path)


def test_truncated_and_malformed_safetensors(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        mt.load(path)
    file.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        mt.load(path)
    file.write_bytes(struct.pack("<Q", 10) + b"{garbage!}" + data[100:])
    with pytest.raises(CheckpointError, match="malformed safetensors header"):
        mt.load(path)
    file.write_bytes(struct.pack("<Q", 10 ** 9) + data[8:])
    with pytest.raises(CheckpointError, match="header length"):
        mt.load(path)


def test_bad_tokenizer_file_is_named(tmp_path, checkpoint_dir):
    from minitransformer.checkpoints.synth import make_checkpoint, qwen2_config, train_tokenizer
    path = make_checkpoint(tmp_path / "t", qwen2_config(vocab_size=1024),
                           tokenizer=train_tokenizer())
    tokenizer = mt.load(path).tokenizer
    assert tokenizer.decode(tokenizer.encode("the cache")) == "the cache"
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot be read"):
        mt.load(path)


def test_eos_ids_from_generation_config(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    assert mt.load(path).eos_token_ids == (5, 9)


def test_sampling_defaults_from_generation_config(tmp_path, checkpoint_dir):
    """The loader reads generation_config.json's sampling settings onto the model (null ones
    and fields that are not sampling settings left out); the quality battery's penalty is its."""
    from minitransformer.measure.quality import default_repetition_penalty

    path = copy(checkpoint_dir, tmp_path)
    assert mt.load(path).sampling_defaults == {}
    assert default_repetition_penalty(mt.load(path)) == 1.1                  # the fallback
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 5, "temperature": 0.6, "top_p": None, "repetition_penalty": 1.2,
         "max_length": 64}))
    model = mt.load(path)
    assert model.sampling_defaults == {"temperature": 0.6, "repetition_penalty": 1.2}
    assert model.eos_token_ids == (5,) and default_repetition_penalty(model) == 1.2


def test_eos_ids_fall_back_to_config_json(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    edit_config(path, eos_token_id=7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": None,
                                                            "temperature": 0.5}))
    model = mt.load(path)
    assert model.eos_token_ids == (7,) and model.sampling_defaults == {"temperature": 0.5}


def test_null_fields_take_the_hugging_face_defaults(tmp_path, checkpoint_dir):
    """num_key_value_heads: null means MHA; head_dim: null means hidden / heads."""
    path = copy(checkpoint_dir, tmp_path, "qwen2-mha-untied")  # 4 q heads, 4 kv heads, 32 / 4
    edit_config(path, num_key_value_heads=None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"head_dim": None}))
    c = mt.load(path).config
    assert (c.num_key_value_heads, c.head_dim) == (4, 8)


def test_nested_rope_theta(tmp_path, checkpoint_dir):
    path = copy(checkpoint_dir, tmp_path)
    edit_config(path, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert mt.load(path).config.rope_theta == 5e5
