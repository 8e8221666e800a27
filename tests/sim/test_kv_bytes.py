"""Experiment 8: the KV-cache bytes formula against the bytes of the arrays actually held."""
import numpy as np
import pytest

import exp08_cache_bytes as exp08
from minitransformer.backend import to_numpy
from minitransformer.checkpoints.synth import qwen25_05b_config
from minitransformer.config import ModelConfig
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import KV_DTYPES, QuantizedArray, cache_bytes_per_token
from minitransformer.model import forward
from sim.kv_memory import kv_bytes_per_token

QWEN = ModelConfig.from_dict(qwen25_05b_config())


def held_bytes(cache):
    """Independent of KVCache.nbytes: element count of every array held (a quantized cache's
    codes and scales) times its item size."""
    arrays = [part for a in cache.k + cache.v
              for part in ((a.codes, a.scales) if isinstance(a, QuantizedArray) else (a,))]
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays)


# bytes one head's vector takes, written out by hand: d floats, or d / g blocks of g codes of
# 8 or 4 bits and one 2-byte float16 scale each (g = 32, or gcd(32, d) for the small heads)
BY_HAND = {"f32": lambda d, g: 4 * d, "f16": lambda d, g: 2 * d,
           "q8_0": lambda d, g: d // g * (g + 2), "q4_0": lambda d, g: d // g * (g // 2 + 2)}


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("users, tokens", [(1, 1), (1, 7), (3, 5)])
def test_formula_equals_bytes_of_a_cache_filled_by_prefill(tiny_model, dtype, users, tokens):
    """Exactly `tokens` slots, filled by a real forward pass: nbytes == the formula, exactly."""
    c = tiny_model.config
    cache = KVCache.allocate(c, batch=users, max_len=tokens, kv_dtype=dtype)
    ids = np.random.default_rng(0).integers(0, c.vocab_size, (users, tokens))
    forward(tiny_model, ids, cache)
    assert cache.lengths.tolist() == [tokens] * users
    for layer in cache.k + cache.v:  # kv heads only, never the H query heads
        assert layer.shape == (users, c.num_key_value_heads, tokens, c.head_dim)
    formula = users * tokens * cache_bytes_per_token(c, dtype)
    by_hand = BY_HAND[dtype](c.head_dim, np.gcd(32, c.head_dim))
    assert formula == users * tokens * 2 * c.num_hidden_layers * c.num_key_value_heads * by_hand
    assert cache.nbytes == held_bytes(cache) == formula
    if dtype in ("f32", "f16"):
        assert kv_bytes_per_token(c, by_hand // c.head_dim) == cache_bytes_per_token(c, dtype)


def test_the_chapters_figures():
    """(1, 2, 295, 64) float16 per layer, 3,624,960 bytes for 295 tokens = 12,288 bytes/token."""
    r = exp08.row("Qwen2.5-0.5B", QWEN, "f16", 1, 295)
    assert r["layer_shape"] == (1, 2, 295, 64)
    assert r["measured"] == r["formula"] == 3_624_960
    assert r["per_token"] == 12_288 == r["measured"] // 295
    mha = exp08.row("MHA", exp08.replace(QWEN, num_key_value_heads=14), "f16", 1, 1)
    assert mha["measured"] == 86_016 == 7 * 12_288


def test_only_total_tokens_matter():
    """Users x tokens with the same product hold the same bytes (scaled-down chapter rows)."""
    held = {exp08.row("Qwen", QWEN, "f16", u, t)["measured"]
            for u, t in ((1, 256), (4, 64), (16, 16), (64, 4))}
    assert held == {256 * 12_288}


def test_preallocated_slots_count_whatever_they_hold(tiny_model):
    """A cache allocated for 10 slots and filled to 4 holds 10 slots' bytes: that is why the
    experiment allocates exactly N slots. The filled part alone is the formula for 4."""
    c = tiny_model.config
    cache = KVCache.allocate(c, batch=1, max_len=10)
    forward(tiny_model, np.array([[1, 2, 3, 4]]), cache)
    per_token = kv_bytes_per_token(c, 4)
    assert cache.nbytes == 10 * per_token
    assert sum(int(a[:, :, :4].nbytes) for a in cache.k + cache.v) == 4 * per_token


def test_fill_writes_every_slot_of_every_layer():
    cache = KVCache.allocate(QWEN, batch=2, max_len=3, kv_dtype="f16")
    exp08.fill(cache, 3)
    assert cache.lengths.tolist() == [3, 3]
    assert all((to_numpy(a) == 1).all() for a in cache.k + cache.v)


def test_headline_on_the_real_stories_model(stories):
    cache, per_token, formula = exp08.headline(stories, 295)
    c = stories.config  # 5 layers, 4 kv heads of dim 8
    assert formula == "2 * 5 * 4 * 8 * 2"
    assert cache.k[0].shape == (1, 4, 295, 8) and cache.k[0].dtype == np.float16
    assert cache.nbytes == 295 * per_token == 295 * 2 * 5 * 4 * 8 * 2
    assert kv_bytes_per_token(c, 2) == per_token


def test_script_table_is_exact(checkpoint_dir, monkeypatch, run_script):
    monkeypatch.setattr(exp08, "CHAPTER_ROWS", ((1, 295), (8, 32), (16, 16)))
    out, _ = run_script("exp08_cache_bytes", "--model", checkpoint_dir("qwen2-mqa-fp16"),
                        "--tokens", 20)
    assert "KV cache tensors per layer: (1, 1, 20, 8) float16" in out
    assert "measured: 1,280 bytes for 20 tokens = 64 bytes/token" in out  # 2 * 2 * 1 * 8 * 2
    formula = [line for line in out.splitlines() if line.startswith("formula : ")]
    assert formula[0].startswith("formula : 2 * 2 * 1 * 8 * 2")
    assert formula[0].endswith("= 64 bytes/token")
    assert "3,624,960" in out and "12,288" in out
    assert "formula == measured in 17 of 17 rows; same users x tokens, same bytes: yes" in out
    # the formats on --model (d = 8: one block of 8 codes + a 2-byte scale per head vector)
    assert "q8_0         40 B/token measured, formula 2 * 2 * 1 * 1 * 10 = 40: equal" in out
    assert "q4_0         24 B/token measured, formula 2 * 2 * 1 * 1 * 6 = 24: equal" in out
    assert "codes (1, 1, 20, 4) uint8 + scales (1, 1, 20, 1) float16" in out
