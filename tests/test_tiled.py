"""Tiled attention: the plain attention's numbers within float32 tolerance on every shape,
the same greedy tokens, and never the whole score matrix in memory.

Tolerance (stated once, used everywhere): |tiled - plain| <= 1e-5 x (max |v| + |plain|),
elementwise. An output is a weighted mean of value vectors, so its rounding error scales with
the values, not with the (possibly cancelled) result. The two differ only in rounding: exp of
differences to a running maximum instead of the final one, sums in another order; measured
up to 1.2e-6 x max |v| (tiles of 1 key: 200 rescalings).
"""

import numpy as np
import pytest

import minitransformer as mt
from conftest import assert_like_solo
from minitransformer.backend import to_numpy, xp
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import dequantize, quantize
from minitransformer.measure.timing import peak_bytes
from minitransformer.model import causal_mask, forward, plain_attention
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.records import Request
from minitransformer.tiled import (
    TILED,
    CausalTiles,
    largest_score_block,
    tiled_attention,
    two_pass_attention,
)

TOLERANCE = 1e-5


def assert_close(tiled, plain, v):
    tiled, plain, v = to_numpy(tiled), to_numpy(plain), to_numpy(dequantize(v))
    assert tiled.shape == plain.shape and tiled.dtype == plain.dtype == np.float32
    np.testing.assert_allclose(tiled, plain, rtol=TOLERANCE,
                               atol=TOLERANCE * float(np.abs(v).max()))


def qkv(B, T, H, Hkv, S, d, seed=0):
    rng = np.random.default_rng(seed)
    return (xp.asarray(3 * rng.standard_normal(shape, dtype=np.float32))  # scores of ~10
            for shape in ((B, T, H, d), (B, Hkv, S, d), (B, Hkv, S, d)))


# (B, T, H, Hkv, S, d): prefill (T = S), decode (T = 1), a chunk after a cached prefix, GQA,
# MHA, MQA, S and T that tiles of 64 (and 7, and 1) do not divide
SHAPES = [(1, 1, 4, 2, 1, 8), (2, 1, 4, 2, 300, 16), (1, 200, 9, 3, 200, 64),
          (3, 5, 4, 1, 70, 8), (2, 65, 4, 4, 130, 16), (1, 129, 8, 2, 129, 32)]


@pytest.mark.parametrize("block", [64, 7, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_plain_attention_causal_and_unmasked(shape, block):
    B, T, H, Hkv, S, d = shape
    q, k, v = qkv(*shape)
    positions = xp.asarray(np.broadcast_to(np.arange(S - T, S), (B, T)))  # the last T slots
    visible = causal_mask(positions, S)
    assert_close(tiled_attention(q, k, v, visible, block), plain_attention(q, k, v, visible), v)
    assert_close(tiled_attention(q, k, v, None, block), plain_attention(q, k, v, None), v)
    tiles = CausalTiles(positions, S)       # the same mask, made a tile at a time (forward's)
    np.testing.assert_array_equal(to_numpy(tiles[:, 0:T, 0:S]), to_numpy(visible))
    assert_close(tiled_attention(q, k, v, tiles, block), plain_attention(q, k, v, visible), v)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_plain_attention_under_any_mask(shape):
    """Rows of different lengths (a padded batch) and random masks: a query's first visible
    key may sit in any tile, and whole tiles may be hidden."""
    B, T, H, Hkv, S, d = shape
    q, k, v = qkv(*shape, seed=1)
    rng = np.random.default_rng(2)
    visible = rng.random((B, T, S)) < 0.3
    visible[np.arange(B)[:, None], np.arange(T)[None], rng.integers(0, S, (B, T))] = True
    visible = xp.asarray(visible)   # every query sees at least one key
    for block in (64, 5):
        assert_close(tiled_attention(q, k, v, visible, block),
                     plain_attention(q, k, v, visible), v)
    lengths = rng.integers(1, S + 1, B)                 # short rows: slots past them hidden
    positions = xp.asarray(np.maximum(lengths[:, None] - T + np.arange(T), 0))
    visible = causal_mask(positions, S)
    assert_close(tiled_attention(q, k, v, visible, 16), plain_attention(q, k, v, visible), v)
    assert_close(tiled_attention(q, k, v, CausalTiles(positions, S), 16),
                 plain_attention(q, k, v, visible), v)


def held_as(kv_dtype, *arrays) -> tuple:
    """Float32 arrays as a cache of kv_dtype (f16, q8_0, q4_0) holds them."""
    if kv_dtype == "f16":
        return tuple(a.astype(xp.float16) for a in arrays)
    return tuple(quantize(a, kv_dtype) for a in arrays)


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "q4_0"])
def test_reads_a_quantized_cache_block_by_block(kv_dtype):
    q, k, v = qkv(2, 3, 4, 2, 150, 64)
    k_held, v_held = held_as(kv_dtype, k, v)
    visible = causal_mask(xp.asarray([[147, 148, 149]] * 2), 150)
    assert_close(tiled_attention(q, k_held, v_held, visible),
                 plain_attention(q, dequantize(k_held), dequantize(v_held), visible), v_held)


FEW = [s for s in SHAPES if s[1] <= 16] + [(8, 1, 9, 3, 1024, 64)]  # and SmolLM2's decode


@pytest.mark.parametrize("tile", [256, 64, 7, 1])
@pytest.mark.parametrize("shape", FEW, ids=str)
def test_two_passes_equal_plain_attention_and_one_tile_its_bits(shape, tile):
    """A few queries a row (decodes): causal over rows of different lengths (slots past a
    row's length hidden), and unmasked. Rows within one tile are plain's very calls: its
    bits; longer ones sum weights @ v a tile at a time: within the tolerance."""
    B, T, H, Hkv, S, d = shape
    q, k, v = qkv(*shape, seed=5)
    lengths = np.random.default_rng(6).integers(T, S + 1, B)
    lengths[0] = S
    positions = xp.asarray(lengths[:, None] - T + np.arange(T))             # (B, T)
    for visible in (causal_mask(positions, S), None):
        got, want = two_pass_attention(q, k, v, visible, tile), plain_attention(q, k, v, visible)
        if S <= tile:
            np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
        else:
            assert_close(got, want, v)


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "q4_0"])
def test_two_passes_read_a_quantized_cache_a_tile_at_a_time(kv_dtype):
    q, k, v = qkv(2, 1, 4, 2, 150, 64)
    k_held, v_held = held_as(kv_dtype, k, v)
    visible = causal_mask(xp.asarray([[149], [90]]), 150)
    floats = plain_attention(q, dequantize(k_held), dequantize(v_held), visible)
    np.testing.assert_array_equal(to_numpy(two_pass_attention(q, k_held, v_held, visible)),
                                  to_numpy(floats))                          # one tile
    assert_close(two_pass_attention(q, k_held, v_held, visible, 32), floats, v_held)


def test_forward_with_tiled_attention_equals_plain(tiny_model):
    """Every tiny model, without and with a cache, prefill then decode, two rows of
    different lengths."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tiny_model.config.vocab_size, (2, 11))
    plain = forward(tiny_model, ids)                    # hidden states: within 1e-5 of ~1
    assert_close(forward(tiny_model, ids, way=TILED), plain, xp.ones(1))
    caches = {a: KVCache.allocate(tiny_model.config, 2, 16, attention=a)
              for a in ("plain", "tiled")}
    for a, cache in caches.items():
        cache.lengths[:] = [0, 3]
    for step in (ids[:, :8], ids[:, 8:9], ids[:, 9:10]):
        plain = forward(tiny_model, step, caches["plain"])
        assert_close(forward(tiny_model, step, caches["tiled"]), plain, xp.ones(1))


def test_the_engine_and_generate_take_it(tiny_model):
    prompt = [5, 6, 7, 8, 9]
    alone = mt.generate(tiny_model, prompt, 6, eos_token_id=[], attention="tiled")
    engine = Engine(tiny_model, EngineConfig(max_num_seqs=2, num_gpu_blocks_override=8,
                                              block_size=4, attention="tiled",
                                              batch_invariant=True))
    run = engine.run([Request(tuple(prompt), 6, eos_token_id=[])])
    assert run.results[0].tokens == alone   # batch-invariant, prompt whole: generate's products
    assert_like_solo(tiny_model, alone, mt.generate(tiny_model, prompt, 6, eos_token_id=[],
                                                    cache=False, attention="tiled"),
                     prompt, eos_token_id=[])            # a recompute: other products


@pytest.mark.parametrize("bad", ["flash", "", None, "Tiled"])
def test_an_unknown_attention_is_a_clear_error(tiny_model, bad):
    with pytest.raises(ValueError, match="use one of plain, tiled"):
        KVCache.allocate(tiny_model.config, 1, 4, attention=bad)
    with pytest.raises(ValueError, match="use one of plain, tiled"):
        mt.generate(tiny_model, [1, 2], 1, cache=False, attention=bad)
    with pytest.raises(ValueError, match="use one of plain, tiled"):
        Engine(tiny_model, EngineConfig(num_gpu_blocks_override=4, attention=bad))
    if bad is not None:                                 # None: forward's default, plain
        with pytest.raises(ValueError, match="a model.Attention"):
            forward(tiny_model, np.array([[1, 2]]), way=bad)
    with pytest.raises(ValueError, match="a cache attends its own way"):
        forward(tiny_model, np.array([[1, 2]]), KVCache.allocate(tiny_model.config, 1, 4),
                way=TILED)
    with pytest.raises(ValueError, match="block"):
        tiled_attention(*qkv(1, 1, 1, 1, 4, 8), block=0)


@pytest.mark.parametrize("block", [64, 16])
def test_a_hidden_tile_between_visible_ones_is_skipped_not_the_rest(block):
    """Keys 64..127 hidden from every query, those before and after visible: the hidden tiles
    are skipped and the keys after them still count (the causal tiles never hide a span
    before visible keys; an explicit mask may)."""
    shape = (2, 6, 4, 2, 192, 8)
    q, k, v = qkv(*shape, seed=3)
    visible = np.ones((2, 6, 192), bool)
    visible[:, :, 64:128] = False
    visible = xp.asarray(visible)
    assert_close(tiled_attention(q, k, v, visible, block), plain_attention(q, k, v, visible), v)


def test_each_query_row_keeps_its_own_maximum():
    """Two queries whose scores lie 200 apart (about +100 and -100): each row's softmax is
    shifted by its own maximum. Shifted by the larger one, the other row's exps would all
    underflow to 0 (exp(-200) < float32's smallest), leaving 0 / 0."""
    rng = np.random.default_rng(4)
    d = 16
    k = xp.asarray((1 + 0.1 * rng.standard_normal((1, 1, 8, d))).astype(np.float32))
    v = xp.asarray(rng.standard_normal((1, 1, 8, d)).astype(np.float32))
    q = xp.asarray(np.array([25.0, -25.0], np.float32)[None, :, None, None] *
                   np.ones((1, 2, 1, d), np.float32))                  # scores ~ +-25 * 16 / 4
    plain = plain_attention(q, k, v, None)
    assert np.isfinite(to_numpy(plain)).all()
    for block in (64, 3):
        assert_close(tiled_attention(q, k, v, None, block), plain, v)


def test_one_tile_is_the_softmax_formula_in_float32_bit_for_bit():
    """Queries and keys within one tile: nothing is rescaled (the running sums start at 0 and
    take the tile's sums exactly), so the result is softmax's formula with the row maximum
    subtracted, computed in float32 by the same products: the same bits. (A running maximum
    kept wider than float32 would make the tile's exps and products wider: other bits.)"""
    B, T, H, Hkv, S, d = 1, 5, 4, 2, 40, 16
    G = H // Hkv
    q, k, v = qkv(B, T, H, Hkv, S, d)
    qg = q.reshape(B, T, Hkv, G, d).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, d)
    s = (qg @ k.transpose(0, 1, 3, 2)) * (1.0 / d ** 0.5)                 # (B, Hkv, G*T, S)
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    want = (p @ v) / p.sum(axis=-1, keepdims=True)                          # (B, Hkv, G*T, d)
    want = want.reshape(B, Hkv, G, T, d).transpose(0, 3, 1, 2, 4).reshape(B, T, H * d)
    got = tiled_attention(q, k, v)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


@pytest.mark.skipif(xp is not np, reason="tracemalloc sees NumPy's allocations only")
def test_never_holds_the_score_matrix():
    """A 1,024-token causal prefill of one head: the plain attention's scores are 4 MiB (and
    its peak several times that); the tiled one's peak, its mask made inside too, is under
    1/8 of the score matrix (its tiles are 16 KB; the output and a copy of q are most of it)."""
    n, d = 1024, 64
    q, k, v = qkv(1, n, 1, 1, n, d)
    positions = xp.arange(n)[None]
    scores = n * n * 4
    plain = peak_bytes(lambda: plain_attention(q, k, v, causal_mask(positions, n))).peak_bytes
    tiled = peak_bytes(lambda: tiled_attention(q, k, v, CausalTiles(positions, n))).peak_bytes
    assert plain > scores
    assert tiled < scores / 8
    assert largest_score_block(n, n) == 64 * 64 * 4


SMOLLM2_TIE = 1e-3  # as test_smollm2: a top-two gap under which float32 order may pick either


def test_greedy_tokens_on_smollm2_equal_plain_up_to_a_near_tie(smollm2):
    """The test prompts' greedy tokens (stored, with the gap between the top two logits at each
    step; plain attention gives them, test_smollm2) up to the first near tie, at most 8."""
    import json
    from pathlib import Path

    model = smollm2
    golden = json.loads((Path(__file__).parent / "fixtures" / "smollm2_golden.json").read_text())
    for case in golden["cases"]:
        steps = next((i for i, g in enumerate(case["greedy_gaps"]) if g < SMOLLM2_TIE),
                     len(case["greedy"]))
        steps = min(steps, 8)
        assert steps >= 4
        assert mt.generate(model, case["ids"], steps, attention="tiled") == \
            case["greedy"][:steps]
