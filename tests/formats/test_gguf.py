"""The GGUF importer on small files written here with the gguf package's own writer.

Every block format against ``gguf.quants.dequantize`` bit for bit; both architectures through a
forward pass against the same weights loaded from safetensors (exact: same float32 weights,
same code); the llama q/k permutation shown to matter; errors that name key, tensor and type.
"""
import numpy as np
import pytest

import minitransformer as mt
from minitransformer.checkpoints.synth import (
    llama_config,
    make_checkpoint,
    qwen2_config,
    qwen3_config,
    random_weights,
    train_tokenizer,
)
from minitransformer.errors import CheckpointError
from minitransformer.formats import gguf_types

pytest.importorskip("gguf")
import gguf

from gguf_files import MATRIX_TYPES, store, write_gguf

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def bits(x):
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("type_name", MATRIX_TYPES)
def test_dequantize_matches_gguf_bit_for_bit(type_name):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 96)).astype(np.float32)
    w[0, :32] = np.abs(w[0, :32])          # an all-positive block: Q4_1's minimum at work
    w[1, 32:64] = 0.0                      # an all-zero block: scale 0
    w[2, 5] = 40.0                         # an outlier
    stored, qtype, reference = store(w, type_name)
    ours = gguf_types.dequantize(stored, type_name, w.shape)
    assert ours.dtype == np.float32 and ours.shape == w.shape
    assert np.array_equal(bits(ours), bits(reference))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_dequantize_arbitrary_bytes_bit_for_bit(type_name):
    """Any stored bytes, not only what a quantizer writes (odd scales, every nibble)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    qtype = GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(4, 64 // block * block_bytes), dtype=np.uint8)
    if type_name in ("F16", "BF16"):  # keep them finite: NaN payloads are not the point
        raw[:, 1::2] &= 0x3F
    reference = dequantize(raw, qtype).reshape(4, 64)
    ours = gguf_types.dequantize(raw, type_name, (4, 64))
    assert np.array_equal(bits(ours), bits(reference))


def test_q4_nibble_order_is_llama_cpp_not_ours():
    """Code j in the low nibble of byte j, code j + 16 in its high nibble."""
    block = np.zeros((1, 18), dtype=np.uint8)
    block[0, :2] = np.array([1.0], dtype="<f2").view(np.uint8)
    block[0, 2] = 0x9F  # low nibble 15 -> weight 0, high nibble 9 -> weight 16
    w = gguf_types.dequantize(block, "Q4_0", (1, 32))[0]
    assert w[0] == 7.0 and w[16] == 1.0 and w[1] == -8.0


@pytest.mark.parametrize("kv_dtype", ["q8_0", "q4_0"])
def test_the_kv_caches_blocks_are_llama_cpps(kv_dtype):
    """The KV cache's q8_0 / q4_0 codes and scales, laid out as a GGUF block ([fp16 scale]
    [codes]), decode under the gguf package's own dequantize to the floats attention reads:
    the cache's nibble order and scale are llama.cpp's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from minitransformer.backend import to_device, to_numpy
    from minitransformer.kvquant import dequantize as read
    from minitransformer.kvquant import quantize

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)        # 3 vectors of 2 blocks each
    held = quantize(to_device(x), kv_dtype)
    codes = to_numpy(held.codes).reshape(6, -1).view(np.uint8)  # (blocks, 32 or 16 bytes)
    scales = to_numpy(held.scales).reshape(6, 1).astype("<f2").view(np.uint8)  # (blocks, 2)
    raw = np.concatenate([scales, codes], axis=1).reshape(3, -1)
    reference = dequantize(raw, GGMLQuantizationType[kv_dtype.upper()]).reshape(3, 64)
    assert np.array_equal(bits(to_numpy(read(held))), bits(reference))


def test_dequantize_errors_name_the_problem():
    with pytest.raises(ValueError, match="IQ2_XS is not supported"):
        gguf_types.dequantize(np.zeros(74, np.uint8), "IQ2_XS", (1, 256))
    with pytest.raises(ValueError, match="rows of 48"):
        gguf_types.dequantize(np.zeros(34, np.uint8), "Q8_0", (1, 48))
    with pytest.raises(ValueError, match="takes 68 bytes, but 34"):
        gguf_types.dequantize(np.zeros(34, np.uint8), "Q8_0", (1, 64))


def model_files(tmp_path, config, seed=0, **kwargs):
    """-> (GGUF path, safetensors checkpoint of exactly the weights the GGUF stores)."""
    from minitransformer.checkpoints.synth import random_weights

    weights = random_weights(config, seed)
    expected = write_gguf(tmp_path / "m.gguf", config, weights, **kwargs)
    reference = make_checkpoint(tmp_path / "hf", config)
    from minitransformer.formats.safetensors_io import write_tensors
    write_tensors(reference / "model.safetensors", expected)
    return tmp_path / "m.gguf", reference, expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_forward_pass_matches_the_same_weights_from_safetensors(tmp_path, arch):
    make = llama_config if arch == "llama" else qwen2_config
    config = make(**SHAPE, tie_word_embeddings=arch == "qwen2")
    path, reference, expected = model_files(tmp_path, config)
    model, ref = mt.load(path), mt.load(reference)
    assert model.config == ref.config
    for name, w in expected.items():  # every tensor, every type, exactly
        assert np.array_equal(bits(mt_numpy(model.weights[name])), bits(w)), name
    ids = [3, 17, 42, 5, 88, 1, 60]
    assert np.array_equal(mt.logits(model, ids), mt.logits(ref, ids))
    assert mt.generate(model, ids, 6) == mt.generate(ref, ids, 6)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("family", ["qwen3", "qwen3-untied-bias", "llama3-rope", "linear-rope"])
def test_the_newer_families_load_from_gguf_as_from_safetensors(tmp_path, family):
    """Qwen3 (q/k norms as attn_q_norm / attn_k_norm, head_dim as key_length), Llama 3's rope
    scaling as llama.cpp stores it (rope_freqs.weight: each pair's frequency divisor) and
    linear scaling (rope.scaling.type): the same weights give the same logits from either file.
    Llama 3's divisors are its rule worked out in float32, so its logits agree to rounding."""
    config = {"qwen3": qwen3_config(**SHAPE),
              "qwen3-untied-bias": qwen3_config(**SHAPE, attention_bias=True,
                                                tie_word_embeddings=False),
              "llama3-rope": llama_config(**SHAPE, head_dim=16, rope_scaling=LLAMA3),
              "linear-rope": llama_config(**SHAPE, rope_scaling={"rope_type": "linear",
                                                                 "factor": 4.0})}[family]
    path, reference, expected = model_files(tmp_path, config)
    model, ref = mt.load(path), mt.load(reference)
    for name, w in expected.items():
        assert np.array_equal(bits(mt_numpy(model.weights[name])), bits(w)), name
    ids = [3, 17, 42, 5, 88, 1, 60]
    if family == "llama3-rope":
        np.testing.assert_allclose(mt.logits(model, ids), mt.logits(ref, ids), atol=1e-5)
        assert model.config.rope_scaling.divisors and model.config.rope_scaling.factor == 8.0
        write_gguf(tmp_path / "plain.gguf", config | {"rope_scaling": None},
                   random_weights(config))                # the same file, no rope_freqs
        assert not np.allclose(mt.logits(mt.load(tmp_path / "plain.gguf"), ids),
                               mt.logits(model, ids), atol=1e-4)
    else:
        assert model.config == ref.config
        assert np.array_equal(mt.logits(model, ids), mt.logits(ref, ids))
    assert mt.generate(model, ids, 6) == mt.generate(ref, ids, 6)


def test_rope_freqs_of_the_wrong_length_is_named(tmp_path):
    config = llama_config(**SHAPE, head_dim=16, rope_scaling=LLAMA3)
    weights = random_weights(config)
    write_gguf(tmp_path / "m.gguf", config | {"rope_scaling": None}, weights, extra_tensors={
        "rope_freqs.weight": (np.ones(3, np.float32), gguf.GGMLQuantizationType.F32)})
    with pytest.raises(CheckpointError, match=r"'rope_freqs.weight' must hold 8 finite"):
        mt.load(tmp_path / "m.gguf")


def test_an_unknown_rope_scaling_type_is_named(tmp_path):
    config = llama_config(**SHAPE)
    path = tmp_path / "m.gguf"
    write_gguf(path, config | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
               random_weights(config))
    raw = path.read_bytes().replace(b"linear", b"yarn\x00\x00")
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"rope.scaling.type='yarn.*is not supported"):
        mt.load(path)


# A Q4_K_M file's kind of choices (Q4_K with Q6_K on v, down and the head) and every other
# type the importer decodes, on rows of whole super-blocks; the second layer in the
# blocks-of-32 types llama-quantize falls back to where rows are not.
K_LAYER = {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q5_K", "self_attn.v_proj": "Q6_K",
           "self_attn.o_proj": "Q3_K", "mlp.gate_proj": "Q2_K", "mlp.up_proj": "Q4_K",
           "mlp.down_proj": "Q6_K"}
FALLBACK_LAYER = {"self_attn.q_proj": "Q5_0", "self_attn.k_proj": "Q5_1",
                  "self_attn.v_proj": "Q8_0", "self_attn.o_proj": "IQ4_NL",
                  "mlp.gate_proj": "IQ4_NL", "mlp.up_proj": "Q5_0", "mlp.down_proj": "Q8_0"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_mix_of_k_quants_gives_the_logits_of_its_dequantized_weights(tmp_path, arch):
    make = llama_config if arch == "llama" else qwen2_config
    config = make(**SHAPE | {"hidden_size": 256, "intermediate_size": 512},
                  tie_word_embeddings=False)
    types = {"model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K"}
    for layer, kinds in enumerate((K_LAYER, FALLBACK_LAYER)):
        types |= {f"model.layers.{layer}.{m}.weight": t for m, t in kinds.items()}
    path, reference, expected = model_files(tmp_path, config, types=types)
    model, meta, stored = gguf_module().read_model(path)
    assert stored.pop("F32") == sum(w.ndim == 1 for w in expected.values())   # norms, biases
    assert stored == {"Q4_K": 3, "Q5_K": 1, "Q6_K": 3, "Q3_K": 1, "Q2_K": 1,
                      "Q5_0": 2, "Q5_1": 1, "Q8_0": 2, "IQ4_NL": 2}
    for name, w in expected.items():    # every tensor: the gguf package's dequantization
        assert np.array_equal(bits(mt_numpy(model.weights[name])), bits(w)), name
    ids = [3, 17, 42, 5, 88, 1, 60]
    ref = mt.load(reference)
    assert np.array_equal(mt.logits(model, ids), mt.logits(ref, ids))
    assert mt.generate(model, ids, 6) == mt.generate(ref, ids, 6)


def gguf_module():
    from minitransformer.formats import gguf as module
    return module


def mt_numpy(x):
    from minitransformer.backend import to_numpy
    return to_numpy(x)


def test_llama_q_k_permutation_matters(tmp_path, monkeypatch):
    """Without undoing llama.cpp's interleaving the logits change: the check above can fail."""
    from minitransformer.formats import gguf as gguf_module

    config = llama_config(**SHAPE)
    path, reference, _ = model_files(tmp_path, config, types={}, seed=2)
    ids = [3, 17, 42, 5, 88, 1, 60]
    right = mt.logits(mt.load(reference), ids)
    monkeypatch.setattr(gguf_module, "unpermute", lambda w, heads: w)
    wrong = mt.logits(mt.load(path), ids)
    assert np.abs(wrong - right).max() > 1e-3


def test_attention_biases_and_untied_head(tmp_path):
    config = llama_config(**SHAPE, attention_bias=True, tie_word_embeddings=False)
    path, reference, _ = model_files(tmp_path, config, seed=3)
    model = mt.load(path)
    assert model.config.attention_bias and not model.config.tie_word_embeddings
    ids = [1, 2, 3, 4]
    assert np.array_equal(mt.logits(model, ids), mt.logits(mt.load(reference), ids))


def test_non_finite_weight_names_the_tensor(tmp_path):
    config = qwen2_config(**SHAPE)
    from minitransformer.checkpoints.synth import random_weights
    weights = random_weights(config)
    weights["model.layers.1.mlp.up_proj.weight"][2, 3] = np.inf
    write_gguf(tmp_path / "m.gguf", config, weights,
               types={"model.layers.1.mlp.up_proj.weight": "F32"})
    with pytest.raises(mt.CheckpointError, match=r"m\.gguf: tensor 'blk\.1\.ffn_up\.weight' "
                                                 r"holds a non-finite value"):
        mt.load(tmp_path / "m.gguf")


@pytest.mark.parametrize("type_name", ["IQ4_XS", "IQ2_XXS", "IQ3_S", "TQ2_0"])
def test_unsupported_type_names_tensor_and_type(tmp_path, type_name):
    """The i-quants left out (and the ternary types) are refused by name, before any decoding."""
    config = qwen2_config(**SHAPE | {"hidden_size": 256})
    from minitransformer.checkpoints.synth import random_weights
    weights = random_weights(config)
    weights.pop("model.layers.1.mlp.up_proj.weight")                      # (128, 256)
    qtype = gguf.GGMLQuantizationType[type_name]
    stored = np.zeros((128, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8)   # one block a row
    write_gguf(tmp_path / "m.gguf", config, weights,
               extra_tensors={"blk.1.ffn_up.weight": (stored, qtype)})
    with pytest.raises(mt.CheckpointError, match=rf"'blk\.1\.ffn_up\.weight': GGML type "
                                                 rf"{type_name} is not supported"):
        mt.load(tmp_path / "m.gguf")


@pytest.mark.parametrize("drop, message", [
    ("llama.block_count", "llama.block_count is missing"),
    ("llama.attention.layer_norm_rms_epsilon", "layer_norm_rms_epsilon is missing"),
])
def test_missing_metadata_names_the_key(tmp_path, drop, message):
    config = llama_config(**SHAPE)
    from minitransformer.checkpoints.synth import random_weights
    write_gguf(tmp_path / "m.gguf", config, random_weights(config), drop_keys=(drop,))
    with pytest.raises(mt.CheckpointError, match=message):
        mt.load(tmp_path / "m.gguf")


def test_bad_files_are_named(tmp_path):
    with pytest.raises(mt.CheckpointError, match="GGUF file not found"):
        mt.load(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(mt.CheckpointError, match="bad.gguf: not a GGUF file"):
        mt.load(bad)
    config = qwen2_config(**SHAPE)
    from minitransformer.checkpoints.synth import random_weights
    weights = random_weights(config)
    weights.pop("model.layers.1.mlp.down_proj.weight")
    write_gguf(tmp_path / "m.gguf", config, weights)
    with pytest.raises(mt.CheckpointError, match=r"missing tensor\(s\) blk\.1\.ffn_down\.weight$"):
        mt.load(tmp_path / "m.gguf")


def test_unknown_tensor_is_named(tmp_path):
    from gguf import GGMLQuantizationType
    config = qwen2_config(**SHAPE)
    from minitransformer.checkpoints.synth import random_weights
    write_gguf(tmp_path / "m.gguf", config, random_weights(config),
               extra_tensors={"blk.0.ffn_gate_exps.weight": (np.zeros((4, 64), np.float32),
                                                             GGMLQuantizationType.F32)})
    with pytest.raises(mt.CheckpointError, match="unexpected tensor 'blk.0.ffn_gate_exps"):
        mt.load(tmp_path / "m.gguf")


TEXTS = ["The cat sat on the mat.", "  two  spaces, tabs\tand\nnewlines\n\n",
         "Unicode: café, naïve, 東京, emoji 🙂", "<|endoftext|>The end<|endoftext|>",
         "It's 2024: 13 cats cost $1,250.75"]


@pytest.fixture(scope="module")
def bpe():
    return train_tokenizer(1024)


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_tokenizer_round_trips(tmp_path, bpe, pre):
    config = qwen2_config(**SHAPE | {"vocab_size": 1024})
    from minitransformer.checkpoints.synth import random_weights
    write_gguf(tmp_path / "m.gguf", config, random_weights(config), tokenizer=bpe, pre=pre)
    tok = mt.load(tmp_path / "m.gguf").tokenizer
    special = bpe.token_to_id("<|endoftext|>")
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.backend.decode(ids, skip_special_tokens=False) == text
        if pre == "gpt2":  # the same split as the tokenizer the file was made from
            assert ids == bpe.encode(text).ids
    assert tok.encode("<|endoftext|>a")[0] == special  # a control token stays whole
    assert tok.decode(tok.encode("<|endoftext|>hello")) == "hello"


def test_smollm_splits_every_digit(tmp_path, bpe):
    config = qwen2_config(**SHAPE | {"vocab_size": 1024})
    from minitransformer.checkpoints.synth import random_weights
    write_gguf(tmp_path / "m.gguf", config, random_weights(config), tokenizer=bpe,
               pre="smollm")
    tok = mt.load(tmp_path / "m.gguf").tokenizer
    pieces = [tok.backend.decode([i]) for i in tok.encode("in 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_chat_template_is_kept(tmp_path, bpe):
    config = qwen2_config(**SHAPE | {"vocab_size": 1024})
    from minitransformer.checkpoints.synth import random_weights
    write_gguf(tmp_path / "m.gguf", config, random_weights(config), tokenizer=bpe)
    tok = mt.load(tmp_path / "m.gguf").tokenizer
    ids = tok.chat_prompt([{"role": "user", "content": "Hi"}])
    assert tok.backend.decode(ids, skip_special_tokens=False) == \
        "<|endoftext|>user: Hi\nassistant:"


def test_unsupported_pre_tokenizer_is_named(tmp_path, bpe):
    config = qwen2_config(**SHAPE | {"vocab_size": 1024})
    from minitransformer.checkpoints.synth import random_weights
    write_gguf(tmp_path / "m.gguf", config, random_weights(config), tokenizer=bpe,
               pre="chatglm-bpe")
    with pytest.raises(mt.CheckpointError, match="tokenizer.ggml.pre='chatglm-bpe'"):
        mt.load(tmp_path / "m.gguf")


def test_every_type_the_gguf_package_knows_is_decoded_or_refused_by_its_name():
    """The table of GGML type ids holds every id of the installed gguf package under its
    name, and each type decoded here has the block the package gives it; any other id is no
    GGML type, said so (not "type id N")."""
    from minitransformer.formats.gguf_file import GGML_TYPES
    from minitransformer.formats.gguf_types import FORMATS, PLAIN_FORMATS, SUPPORTED
    for qtype in gguf.GGMLQuantizationType:
        assert GGML_TYPES[qtype.value] == qtype.name
        if qtype.name in FORMATS:
            block = FORMATS[qtype.name]
            assert (block.weights, block.nbytes) == gguf.GGML_QUANT_SIZES[qtype]
        elif qtype.name in PLAIN_FORMATS:
            assert np.dtype(PLAIN_FORMATS[qtype.name]).itemsize == \
                gguf.GGML_QUANT_SIZES[qtype][1]
    assert set(SUPPORTED) <= set(GGML_TYPES.values())
    assert GGML_TYPES[42] == "Q2_0"         # ggml's, after the package's last (Q1_0, 41)
