"""The forward pass against an independent reference, and its float32 discipline."""
import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import BACKEND, to_device, to_numpy
from minitransformer.checkpoints.synth import llama_config, qwen2_config
from minitransformer.config import ModelConfig
from minitransformer.kvcache import KVCache
from minitransformer.model import forward, head, rope, rope_angles, rope_frequencies
from reference import reference_logits


def test_logits_match_independent_reference(tiny_model):
    ids = np.random.default_rng(0).integers(0, tiny_model.config.vocab_size, 11)
    ours = mt.logits(tiny_model, ids)
    ref = reference_logits(tiny_model, ids)
    assert ours.shape == (11, tiny_model.config.vocab_size) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_logits_match_reference_on_real_checkpoint(stories):
    ids = stories.tokenizer.encode("Once upon a time, there was a cat")
    np.testing.assert_allclose(mt.logits(stories, ids), reference_logits(stories, ids),
                               rtol=1e-4, atol=1e-4)


def test_cached_logits_equal_full_forward_stepwise(tiny_model):
    """Prefill 5 tokens, then feed the rest one at a time: same logits as one full pass."""
    ids = np.random.default_rng(1).integers(0, tiny_model.config.vocab_size, 12)
    full = mt.logits(tiny_model, ids)
    cache = KVCache.allocate(tiny_model.config, batch=1, max_len=12)
    steps = [to_numpy(head(tiny_model, forward(tiny_model, ids[None, :5], cache)))[0]]
    for t in range(5, 12):
        steps.append(to_numpy(head(tiny_model, forward(tiny_model, ids[None, t:t + 1], cache)))[0])
    np.testing.assert_allclose(np.concatenate(steps), full, rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [12]


def test_batched_rows_of_different_lengths_match_single_rows(tiny_model):
    """A batch whose rows hold different lengths decodes each row as if it were alone."""
    c, rng = tiny_model.config, np.random.default_rng(2)
    prompts = [rng.integers(0, c.vocab_size, n) for n in (3, 8)]
    cache = KVCache.allocate(c, batch=2, max_len=16)
    for b, p in enumerate(prompts):  # prefill row by row into one shared cache
        row = KVCache(k=[a[b:b + 1] for a in cache.k], v=[a[b:b + 1] for a in cache.v],
                      lengths=cache.lengths[b:b + 1])
        forward(tiny_model, p[None], row)
    nxt = np.array([[5], [7]])
    batched = to_numpy(head(tiny_model, forward(tiny_model, nxt, cache)))[:, 0]
    for b, p in enumerate(prompts):
        alone = mt.logits(tiny_model, np.concatenate([p, nxt[b]]))[-1]
        np.testing.assert_allclose(batched[b], alone, rtol=1e-5, atol=1e-5)


def test_rope_is_a_rotation_of_half_split_pairs():
    """Pair (x[i], x[i+d/2]) turns by position * theta^(-2i/d), and norms are kept."""
    x = np.random.default_rng(3).standard_normal((1, 1, 1, 8)).astype(np.float32)
    pos = np.array([[3]])
    c = ModelConfig.from_dict(qwen2_config(hidden_size=32, num_attention_heads=4,
                                           rope_theta=100.0))          # d = 8
    y = to_numpy(rope(to_device(x), *rope_angles(to_device(pos), rope_frequencies(c))))
    i = np.arange(4)
    angle = 3 * 100.0 ** (-2 * i / 8)
    z = (x[0, 0, 0, :4] + 1j * x[0, 0, 0, 4:]) * np.exp(1j * angle)
    np.testing.assert_allclose(y[0, 0, 0], np.concatenate([z.real, z.imag]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(y), np.linalg.norm(x), rtol=1e-6)


def llama3_config(**scaling):
    fields = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64} | scaling
    return ModelConfig.from_dict(llama_config(head_dim=16, rope_scaling=fields))


def test_llama3_rope_slows_only_the_pairs_longer_than_the_trained_context():
    """Llama 3's rule on d = 16, theta 1e4, a trained context of 64: pair 0 (wavelength 6.3)
    is under 64 / 4 and kept, pairs 3.. (wavelength 199 and up) pass 64 / 1 and turn 8x
    slower, pairs 1 and 2 (20 and 63) lie between and are blended; linear slows them all."""
    plain = to_numpy(rope_frequencies(ModelConfig.from_dict(llama_config(head_dim=16))))
    scaled = to_numpy(rope_frequencies(llama3_config()))
    wavelength = 2 * np.pi / plain
    assert scaled[0] == plain[0] and wavelength[0] < 16
    np.testing.assert_array_equal(scaled[3:], plain[3:] / np.float32(8))
    blend = (64 / wavelength[1:3] - 1) / 3                    # 0 at 64 .. 1 at 16
    np.testing.assert_allclose(scaled[1:3], (1 - blend) * plain[1:3] / 8 + blend * plain[1:3],
                               rtol=1e-6)
    assert np.all(plain[1:3] / 8 < scaled[1:3]) and np.all(scaled[1:3] < plain[1:3])
    linear = ModelConfig.from_dict(llama_config(head_dim=16, rope_scaling={
        "rope_type": "linear", "factor": 4.0}))
    np.testing.assert_array_equal(to_numpy(rope_frequencies(linear)), plain / np.float32(4))


def test_dynamic_rope_runs_within_the_trained_context():
    """transformers' dynamic NTK scaling changes nothing within the trained context and turns
    every cached key past it: the model is run within it, its positions that context."""
    c = ModelConfig.from_dict(llama_config(max_position_embeddings=256, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 128}))
    assert c.max_position_embeddings == 128
    np.testing.assert_array_equal(
        to_numpy(rope_frequencies(c)),
        to_numpy(rope_frequencies(ModelConfig.from_dict(llama_config()))))


class NoFloat64(np.ndarray):
    """An ndarray that refuses to exist as float64: every array derived from one is checked."""

    def __array_finalize__(self, obj):
        if self.dtype == np.float64:
            raise AssertionError("a float64 array appeared on the decode path")


@pytest.mark.skipif(BACKEND != "numpy", reason="the tripwire is an ndarray subclass")
def test_no_float64_on_the_decode_path(tiny_model):
    weights = {k: v.view(NoFloat64) for k, v in tiny_model.weights.items()}
    model = type(tiny_model)(tiny_model.config, weights)
    cache = KVCache.allocate(model.config, batch=1, max_len=8)
    cache.k = [a.view(NoFloat64) for a in cache.k]
    cache.v = [a.view(NoFloat64) for a in cache.v]
    forward(model, np.array([[1, 2, 3]]), cache)                         # prefill
    out = head(model, forward(model, np.array([[4]]), cache))           # decode
    assert isinstance(out, NoFloat64) and out.dtype == np.float32
    with pytest.raises(AssertionError, match="float64"):                # the tripwire works
        weights["model.norm.weight"] * np.float64(1.5) + np.zeros(1)


def test_decode_skips_the_mask_only_where_every_slot_is_seen(tiny_model):
    """No mask is the mask that hides nothing: same bits; rows of different lengths keep one."""
    from minitransformer.kvcache import KVCache
    from minitransformer.model import causal_mask, plain_attention, prepare
    c = tiny_model.config
    cache = KVCache.allocate(c, 2, 16)
    forward(tiny_model, np.array([[1, 2, 3], [4, 5, 6]]), cache)        # both rows 3 long
    assert prepare(tiny_model, [[7], [8]], cache).visible is None
    cache.trim([0, 1])                                                  # rows 3 and 2 long
    assert prepare(tiny_model, [[7], [8]], cache).visible is not None
    rng = np.random.default_rng(0)
    q = to_device(rng.standard_normal((2, 1, 4, 8)).astype(np.float32))
    k, v = (to_device(rng.standard_normal((2, 2, 5, 8)).astype(np.float32)) for _ in range(2))
    sees_all = causal_mask(to_device(np.array([[4], [4]])), 5)
    assert (to_numpy(plain_attention(q, k, v, None)) ==
            to_numpy(plain_attention(q, k, v, sees_all))).all()
