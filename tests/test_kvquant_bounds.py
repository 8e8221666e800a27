"""Each KV cache format's error, bounded from its definition and measured on the keys and values
a model really writes, and the logits error that bound allows.

The bound on one element x of a block (derived, not fitted):
- f16: round to nearest: |error| <= 2^-11 |x| (normal numbers), 2^-25 (subnormal spacing / 2).
- q8_0: s = max|x| / 127 of the block; codes are rint(x / s'), s' = s rounded to float16
  (|s' / s - 1| <= 2^-11), and no |x / s'| passes 127 by more than 0.06: |error| <= s' / 2.
- q4_0: s = (the block's x of largest |x|) / -8, v = x / s in [-8, 8]: codes -8..7, so
  |error| <= |s'| / 2 where v <= 7.5, and (v - 7) |s'| (at most one step) above, where the
  mirror image of the largest element is clipped to +7 (as llama.cpp does).
Every bound also carries the float32 product code x scale (2^-23 |x|). The scales s are worked
out here from the float values, never read from the cache, so a wrong divisor (scale), block
length or rounding rule shows as an error past its bound, and a cache read back as zeros too.

The logits bound is first order: logit i moves by at most sum_j |dL_i / dc_j| b_j when every
cached element c_j moves by at most b_j (its bound above). The derivatives are measured by
central differences, every element nudged in its own row of one batched forward pass, once per
model (they do not depend on the format).
"""
from math import gcd

import numpy as np
import pytest

import minitransformer as mt
from conftest import NEAR_TIE
from minitransformer.backend import to_numpy, xp
from minitransformer.checkpoints.synth import llama_config, make_checkpoint
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import dequantize
from minitransformer.model import forward, head

FORMATS = ("f16", "q8_0", "q4_0")
IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def blocks(x):
    """(..., d) -> (..., d / g, g): the format's blocks of g = gcd(32, d) along the head dim."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // gcd(32, d), gcd(32, d))


def bound(x, kv_dtype):
    """The largest |held - x| the format allows at each element of float32 x (..., d)."""
    x = np.asarray(x, np.float64)
    if kv_dtype == "f32":
        return np.zeros_like(x)                                      # held as computed
    product = 2.0 ** -23 * np.abs(x)
    if kv_dtype == "f16":
        return np.maximum(2.0 ** -11 * np.abs(x), 2.0 ** -25)
    b = blocks(x)
    if kv_dtype == "q8_0":
        step = np.abs(b).max(axis=-1, keepdims=True) / 127 * (1 + 2.0 ** -11)
        return (step / 2 + blocks(product)).reshape(x.shape)
    widest = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
    s = widest / -8                                                  # (..., nb, 1)
    v = np.divide(b, s, out=np.zeros_like(b), where=s != 0)         # x in steps: [-8, 8]
    per_step = np.maximum(0.5, v - 7 + 2.0 ** -8)                  # + s's float16 rounding
    return (np.abs(s) * (1 + 2.0 ** -11) * per_step + blocks(product)).reshape(x.shape)


def float_cache(model, ids=IDS):
    cache = KVCache.allocate(model.config, 1, len(ids))
    forward(model, np.array([ids]), cache)
    return cache


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """The tiny models' head dims (8, 16) are one block each; SmolLM2's 64 is two blocks of 32,
    and 128 four: where a wrong block length shows."""
    def make(d):
        config = llama_config(head_dim=d, num_attention_heads=4, num_key_value_heads=2)
        return mt.load(make_checkpoint(tmp_path_factory.mktemp(f"d{d}") / "m", config, seed=d))
    return {d: make(d) for d in (64, 128)}


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_the_held_keys_and_values_are_within_the_formats_bound(tiny_model, kv_dtype):
    """Every layer's keys and values of a 10-token prompt (float32, from the model), written
    into a cache of the format and read back as attention reads them. Measured on the tiny
    models: the largest error is 0.93-0.97 of its bound in f16, 0.989-0.999 in q8_0 and
    0.996-0.999 in q4_0 (some element lands within a hair of half a step)."""
    assert_held_within_bound(tiny_model, kv_dtype)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_blocks_of_32_along_a_wide_head(wide_heads, kv_dtype, d):
    assert_held_within_bound(wide_heads[d], kv_dtype)
    assert_same_as_the_definition(wide_heads[d], kv_dtype)


def assert_held_within_bound(model, kv_dtype):
    exact = float_cache(model)
    held = KVCache.allocate(model.config, 1, len(IDS), kv_dtype)
    worst = 0.0
    for layer in range(model.config.num_hidden_layers):
        k, v = exact.k[layer], exact.v[layer]                       # (1, Hkv, S, d)
        back = held.update(layer, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        for x, got in zip((k, v), back, strict=True):
            x, error = to_numpy(x), np.abs(to_numpy(dequantize(got)) - to_numpy(x))
            ratio = error / bound(x, kv_dtype)
            assert (ratio <= 1).all(), f"layer {layer}: error {ratio.max():.3f} x its bound"
            worst = max(worst, float(ratio.max()))
    assert worst > 0.1      # it did round, by about what the format allows


class NudgedCache(KVCache):
    """A float32 cache that adds dk[layer], dv[layer] (B, T, Hkv, d) to what is written, or
    passes it through round(x, layer) first: the float model with its cache entries moved."""
    nudge = None

    def update(self, layer, k, v, slots=None):
        k, v = self.nudge(layer, k, v)
        return super().update(layer, k, v, slots)


def nudged(model, ids, B, nudge):
    cache = NudgedCache(**vars(KVCache.allocate(model.config, B, len(ids))))
    cache.nudge = nudge
    return to_numpy(head(model, forward(model, np.broadcast_to(np.array(ids), (B, len(ids))),
                                        cache)))                    # (B, T, V)


def abs_jacobian(model, h=1e-3):
    """|dL / dc_j| over every cached element j -> (rows, T, V): one row per nudge."""
    c, T = model.config, len(IDS)
    shape = (T, c.num_key_value_heads, c.head_dim)                  # one layer's k, as written
    n = int(np.prod(shape))
    L, rows = c.num_hidden_layers, 2 * c.num_hidden_layers * n     # (layer, k or v, element)
    eye = np.eye(rows, dtype=np.float32).reshape(rows, L, 2, *shape)

    def by(sign):
        def nudge(layer, k, v):
            return (k + xp.asarray(sign * h * eye[:, layer, 0]),
                    v + xp.asarray(sign * h * eye[:, layer, 1]))
        return nudge
    return np.abs(nudged(model, IDS, rows, by(1)) - nudged(model, IDS, rows, by(-1))) / (2 * h)


@pytest.fixture(scope="module")
def jacobians():
    """model -> abs_jacobian(model), measured once per model: it does not depend on the format
    (only the bounds b_j it is weighed by do)."""
    made = {}

    def of(model):
        if id(model) not in made:
            made[id(model)] = (model, abs_jacobian(model))        # the model kept: its id stays
        return made[id(model)][1]
    return of


def first_order_bound(model, kv_dtype, jacobian):
    """sum_j |dL / dc_j| b_j over every cached element j -> (T, V)."""
    exact, L = float_cache(model), model.config.num_hidden_layers
    b = np.stack([np.stack([bound(to_numpy(held[layer])[0].transpose(1, 0, 2), kv_dtype)
                            for held in (exact.k, exact.v)]) for layer in range(L)])
    return np.tensordot(b.reshape(-1), jacobian, axes=1)            # (T, V)


@pytest.mark.parametrize("kv_dtype", ("f32",) + FORMATS)
def test_logits_move_within_the_first_order_bound_of_the_format(tiny_model, jacobians, kv_dtype):
    """Prefill and decode through the format against the float32 cache's logits: within
    sum_j |dL/dc_j| b_j, plus the float32 rounding between the cached and the one-pass call
    shapes: NEAR_TIE (4 x the largest measured, relative to the logits' largest |logit|,
    tests/conftest.py) times the logits' scale. The f32 cache (b = 0, no bound to compute) is
    held to that alone. Measured on the tiny models (logits of spread 0.11-0.13): the error is
    0.19-0.47 of the bound in every format, e.g. q4_0 1.1e-2 to 2.8e-2 against bounds of 8e-2
    to 0.23 (the bound adds every element's worst case with one sign); a cache read back as
    zeros moves them by the logits' whole spread."""
    ids = np.array([IDS])
    exact = mt.logits(tiny_model, IDS)
    cache = KVCache.allocate(tiny_model.config, 1, len(IDS), kv_dtype)
    prefill = to_numpy(head(tiny_model, forward(tiny_model, ids[:, :9], cache)))[0]
    decode = to_numpy(head(tiny_model, forward(tiny_model, ids[:, 9:], cache)))[0]
    error = np.abs(np.concatenate([prefill, decode]) - exact)        # (T, V)
    rounding = NEAR_TIE * float(np.abs(exact).max())
    if kv_dtype == "f32":
        assert (error <= rounding).all(), f"{error.max() / rounding:.2f} x the rounding"
        return
    allowed = first_order_bound(tiny_model, kv_dtype, jacobians(tiny_model)) + rounding
    assert (error <= allowed).all(), f"{(error / allowed).max():.2f} x the bound"
    assert error.max() > rounding                                    # it does quantize


def reference_round_trip(x, kv_dtype):
    """The format from its definition, in NumPy: x (..., d) float32 -> what the cache holds."""
    if kv_dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    b = blocks(x)
    if kv_dtype == "q8_0":
        s = (np.abs(b).max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
        lo, hi = -127, 127
    else:
        widest = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)
        s = (widest / -8).astype(np.float16).astype(np.float32)
        lo, hi = -8, 7
    codes = np.rint(b / np.where(s == 0, 1, s)).clip(lo, hi)
    return (codes * s).reshape(x.shape)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_logits_are_the_float_models_over_the_rounded_keys_and_values(tiny_model, kv_dtype):
    """A cache of the format gives the logits of the float32 model whose every key and value
    is rounded by the format's definition as it is written (NudgedCache): the same values, the
    same attention calls (one pass over the prompt, of the same shapes), so the same bits."""
    assert_same_as_the_definition(tiny_model, kv_dtype)


def assert_same_as_the_definition(model, kv_dtype):
    ids = np.array([IDS])
    cache = KVCache.allocate(model.config, 1, len(IDS), kv_dtype)
    got = to_numpy(head(model, forward(model, ids, cache)))

    def rounded(layer, k, v):
        return tuple(xp.asarray(reference_round_trip(to_numpy(a), kv_dtype)) for a in (k, v))
    expected = nudged(model, IDS, 1, rounded)
    np.testing.assert_array_equal(got, expected)


# --- the paths that read earlier chunks' held keys (docs/kv-cache.md, "Exactness") ----------
# Every path writes its keys and values into the cache and attends over what the cache holds, a
# whole prompt's own keys included. What differs between a whole prefill, a chunked one and a
# prefix hit is the shape of the products that compute the keys (T rows, or a chunk's): their
# last bits. A format rounds to its grid, so where an element lies within those bits of a grid
# boundary, the two paths hold it a whole step apart, and every later layer moves with it. The
# bound: each path holds every element within b_j of what that path computed, so each path's
# logits lie within B = sum_j |dL/dc_j| b_j of the float32 cache's (first order, as above), and
# two paths of one format within 2 B of each other, plus the float32 rounding of each.
CHUNKS = (4, 7)                         # IDS in three chunks: 0-3, 4-6, 7-9
CACHED = 6                              # a prefix hit: positions 0-5 from a longer prompt's pass


def paths(model, kv_dtype, ids=IDS):
    """The logits (T, V) of ids through a cache of the format three ways: one pass, in chunks
    (CHUNKS), and after a prefix hit (positions < CACHED computed in the pass of a longer
    prompt, ids + 2 tokens, the rest in a pass of their own); and the caches they leave."""
    out, caches = {}, {}
    for name, edges in (("whole", ()), ("chunked", CHUNKS), ("prefix hit", (CACHED,))):
        cache = RecordingCache(**vars(KVCache.allocate(model.config, 1, len(ids) + 2, kv_dtype)))
        if name == "prefix hit":
            longer = forward(model, np.array([ids + [7, 7]]), cache)          # another prompt
            cache.trim(len(ids) + 2 - CACHED)
            first = [to_numpy(head(model, longer))[0, :CACHED]]
        else:
            first = []
        starts = [0, *edges] if name != "prefix hit" else [CACHED]
        logits = first + [to_numpy(head(model, forward(model, np.array([ids[a:b]]), cache)))[0]
                          for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]
        out[name], caches[name] = np.concatenate(logits), cache
    return out, caches


class RecordingCache(KVCache):
    """A cache that keeps the float keys and values each pass computed, layer by layer, at
    their slots (what the format rounded)."""
    computed = None

    def update(self, layer, k, v, slots=None):
        if self.computed is None:
            self.computed = {}
        positions = self.positions(k.shape[1])[0]
        for held, x in ((self.computed.setdefault((layer, "k"), {}), k),
                        (self.computed.setdefault((layer, "v"), {}), v)):
            for t, p in enumerate(positions.tolist()):
                held[p] = to_numpy(x)[0, t]                            # (Hkv, d)
        return super().update(layer, k, v, slots)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_chunks_and_prefix_hits_stay_within_twice_the_formats_bound(tiny_model, jacobians,
                                                                   kv_dtype):
    """Chunked prefill and a prefix hit against the whole prompt in the same format: within
    2 B + 2 x the float32 rounding (B the first-order bound above), and each within B of the
    float32 cache. Measured on the tiny models: no element lies that near a boundary, so the
    paths differ by float32 rounding alone (at most 1.2e-7, under 0.001 x 2 B) in every
    format; on SmolLM2 they do not (docs/kv-cache.md), where B is too costly to measure."""
    got, _ = paths(tiny_model, kv_dtype)
    exact = mt.logits(tiny_model, IDS)
    rounding = NEAR_TIE * float(np.abs(exact).max())
    B = first_order_bound(tiny_model, kv_dtype, jacobians(tiny_model))
    for name in ("chunked", "prefix hit"):
        to_whole = np.abs(got[name] - got["whole"])
        assert (to_whole <= 2 * B + 2 * rounding).all(), \
            f"{name}: {(to_whole / (2 * B + 2 * rounding)).max():.2f} x 2 B"
        assert (np.abs(got[name] - exact) <= B + rounding).all(), name


@pytest.mark.parametrize("kv_dtype", ("f16", "q4_0"))
def test_every_path_holds_what_it_computed_within_the_formats_bound_on_smollm2(smollm2,
                                                                              kv_dtype):
    """On SmolLM2 (30 layers, two blocks of 32 per head): whole, chunked and after a prefix
    hit, every held key and value is within the format's bound of what that path computed; the
    paths' float keys differ in their last bits, and their held ones by up to a step."""
    ids = smollm2.tokenizer.encode("The capital of France is Paris, and the capital of")
    _, caches = paths(smollm2, kv_dtype, ids)
    worst = 0.0
    for name, cache in caches.items():
        for layer in range(smollm2.config.num_hidden_layers):
            for which, store in (("k", cache.k), ("v", cache.v)):
                x = np.stack([cache.computed[layer, which][p] for p in range(len(ids))], axis=1)
                held = to_numpy(dequantize(store[layer]))[0, :, :len(ids)]     # (Hkv, T, d)
                ratio = np.abs(held - x) / bound(x, kv_dtype)
                assert (ratio <= 1).all(), f"{name}, layer {layer} {which}: {ratio.max():.3f}"
                worst = max(worst, float(ratio.max()))
    assert worst > 0.5                                  # it did round
