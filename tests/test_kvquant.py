"""The quantized KV cache: integer codes and float16 scales held, values within half a step
(each format's error and the logits error it allows: test_kvquant_bounds.py),
the same tokens through every cache that holds the same codes (contiguous, paged, swapped);
and blocks at the edges of float16's scale: an all-zero block (scale 0) and a block so small
that its scale is a float16 subnormal, rounded by up to half its own size, so that x / s lands
past the format's last code unless it is clipped there."""
import warnings

import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy, xp
from minitransformer.kvcache import KVCache
from minitransformer.kvquant import (
    KV_DTYPES,
    QuantizedArray,
    dequantize,
    quantize,
    vector_bytes,
    zeros,
)
from minitransformer.model import forward
from minitransformer.sampling import SamplingSettings
from minitransformer.serve.config import EngineConfig
from minitransformer.serve.engine import Engine
from minitransformer.serve.paged import PagedCache
from minitransformer.serve.records import Request

QUANTIZED = ("q8_0", "q4_0")


def random_vectors(shape, seed=0, spread=True):
    """Normal numbers, each vector scaled differently (as keys of different tokens are)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    return x * np.exp(rng.uniform(-3, 3, shape[:-1] + (1,))).astype(np.float32) if spread else x


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("d", [64, 128, 8, 16, 48])
def test_codes_are_integers_and_the_error_is_within_a_step(kv_dtype, d):
    x = random_vectors((3, 5, d))
    held = quantize(xp.asarray(x), kv_dtype)
    g = int(np.gcd(32, d))
    codes, scales = to_numpy(held.codes), to_numpy(held.scales)
    assert codes.dtype == (np.int8 if kv_dtype == "q8_0" else np.uint8)
    assert codes.shape == (3, 5, d if kv_dtype == "q8_0" else d // 2)
    assert scales.dtype == np.float16 and scales.shape == (3, 5, d // g)
    assert held.shape == x.shape and held.nbytes == 15 * vector_bytes(d, kv_dtype)
    error = np.abs(to_numpy(dequantize(held)) - x).reshape(3, 5, d // g, g).max(axis=-1)
    step = np.abs(scales.astype(np.float32))
    # q8_0: rounding to the nearest step (the float16 scale may push the largest number a hair
    # past code 127). q4_0: the largest magnitude lands on -8 exactly, its mirror image would
    # be +8 and is clipped to +7: one step at most, as in llama.cpp.
    bound = (0.5 if kv_dtype == "q8_0" else 1.0) * step * (1 + 2e-3) + 1e-30
    assert (error <= bound).all(), float((error / bound).max())


def test_values_on_the_grid_come_back_exactly():
    s = np.float32(0.25)                                   # a power of two: exact in float16
    q8 = np.arange(-127, 128, 8)[:32].astype(np.float32) * s / (127 / 127)
    q8[0] = -127 * s                                       # the block's max|x| sets s = 0.25
    back = to_numpy(dequantize(quantize(xp.asarray(q8[None]), "q8_0")))[0]
    np.testing.assert_array_equal(back, q8)
    q4 = np.tile(np.arange(-8, 8, dtype=np.float32), 2) * -s  # the max (+2) sits on code 0
    back = to_numpy(dequantize(quantize(xp.asarray(q4[None]), "q4_0")))[0]
    np.testing.assert_array_equal(back, q4)


def test_q4_0_packs_element_j_and_j_plus_16_in_byte_j():
    x = np.zeros(32, np.float32)
    x[0], x[16], x[3] = -8.0, 1.0, 7.0                     # s = -8 / -8 = 1: code = x + 8
    held = quantize(xp.asarray(x[None]), "q4_0")
    codes = to_numpy(held.codes)[0]
    assert float(to_numpy(held.scales)[0, 0]) == 1.0
    assert codes[0] == 0 | (9 << 4)                        # x[0] -> 0 low, x[16] -> 9 high
    assert codes[3] == 15 | (8 << 4)                       # x[3] -> 15 low, x[19] = 0 -> 8
    assert codes[1] == 8 | (8 << 4)


def test_an_all_zero_block_holds_zeros():
    for kv_dtype in QUANTIZED:
        back = to_numpy(dequantize(quantize(xp.zeros((2, 64), xp.float32), kv_dtype)))
        assert not back.any() and np.isfinite(back).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_caches_hold_codes_not_floats(tiny_model, kv_dtype):
    """Not acceptable: 'quantized' values kept as float32. Every array a q8_0/q4_0 cache holds
    is int8/uint8 codes or float16 scales, contiguous and paged alike."""
    c = tiny_model.config
    caches = [KVCache.allocate(c, 2, 10, kv_dtype), PagedCache.allocate(c, 6, 4, kv_dtype)]
    for cache in caches:
        for held in cache.k + cache.v:
            if kv_dtype in QUANTIZED:
                assert isinstance(held, QuantizedArray)
                assert {held.codes.dtype.name, held.scales.dtype.name} == \
                    {"int8" if kv_dtype == "q8_0" else "uint8", "float16"}
            else:
                assert held.dtype.name == {"f32": "float32", "f16": "float16"}[kv_dtype]
    assert caches[0].kv_dtype == caches[1].kv_dtype == kv_dtype
    assert caches[1].bytes_per_token * 6 * 4 == sum(a.nbytes for a in caches[1].k + caches[1].v)


@pytest.mark.parametrize("bad", ["int8", "Q8_0", "fp8", "", None, np.float32, 8])
def test_an_unknown_cache_dtype_is_a_clear_error(tiny_model, bad):
    c = tiny_model.config
    for make in (lambda: KVCache.allocate(c, 1, 4, bad), lambda: PagedCache.allocate(c, 4, 4, bad),
                 lambda: mt.generate(tiny_model, [1, 2], 2, kv_dtype=bad),
                 lambda: Engine(tiny_model, EngineConfig(num_gpu_blocks_override=4,
                                                         kv_cache_dtype=bad))):
        with pytest.raises(ValueError, match="use one of f32, f16, q8_0, q4_0"):
            make()


def test_misuse_is_refused(tiny_model):
    held = zeros((2, 3, 64), "q8_0")
    leading = "^a QuantizedArray is indexed on its leading axes only, not the head dim$"
    with pytest.raises(IndexError, match=leading):
        held[0, 0, :3]
    with pytest.raises(IndexError, match=leading):
        held[..., 0]
    with pytest.raises(ValueError, match="cannot write q4_0 blocks into a q8_0 cache"):
        held[0] = zeros((3, 64), "q4_0")
    with pytest.raises(ValueError, match="head dim must be even"):
        zeros((2, 7), "q4_0")
    with pytest.raises(ValueError, match="needs the cache"):
        mt.generate(tiny_model, [1], 1, cache=False, kv_dtype="q8_0")


@pytest.mark.parametrize("attention", ["plain", "tiled"])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_engine_gives_generates_tokens_for_the_same_cache_format(checkpoint_dir, kv_dtype,
                                                                 attention):
    """The paged cache quantizes the same keys/values into the same codes as the contiguous
    one, through preemption (swap out and back in) too: batch-invariant, bit for bit."""
    model = mt.load(checkpoint_dir("llama-gqa"))
    rng = np.random.default_rng(2)
    requests = [Request(tuple(rng.integers(0, 96, int(rng.integers(2, 9))).tolist()), 20,
                        eos_token_id=[], sampling=SamplingSettings(do_sample=bool(i % 2)),
                        seed=i) for i in range(5)]
    engine = Engine(model, EngineConfig(max_num_seqs=4, num_gpu_blocks_override=14, block_size=4,
                                         enable_prefix_caching=False, batch_invariant=True,
                                         kv_cache_dtype=kv_dtype, attention=attention))
    run = engine.run(requests)
    assert run.preemptions > 0
    for result in run.results:
        r = result.request
        alone = mt.generate(model, list(r.prompt), r.max_new_tokens, seed=r.seed,
                            eos_token_id=[], sampling=r.sampling, kv_dtype=kv_dtype,
                            attention=attention)
        assert result.tokens == alone


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_copy_on_write_and_swap_move_codes_and_scales_bit_for_bit(tiny_model, kv_dtype):
    cache = PagedCache.allocate(tiny_model.config, 8, 4, kv_dtype)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]                       # two full blocks
    cache.books.add("a", prompt)
    forward(tiny_model, np.array([prompt]), cache.view(["a"]))
    cache.books.seal("a", prompt)
    assert cache.books.add("b", prompt) == 7                # held in full: last block copied
    cache.do(cache.books.take_moves())
    (a0, a1), (b0, b1) = cache.books.seqs["a"].blocks, cache.books.seqs["b"].blocks
    assert a0 == b0 and a1 != b1
    for held in cache.k + cache.v:
        for part in (held.codes, held.scales):
            np.testing.assert_array_equal(to_numpy(part[b1]), to_numpy(part[a1]))
        assert to_numpy(held.scales[a1]).any()              # real blocks, not zeros
    before = [(to_numpy(h.codes[a1]), to_numpy(h.scales[a1])) for h in cache.k + cache.v]
    swapped = cache.books.swap_out("a")
    cache.do(cache.books.take_moves())                    # the pool copies it out
    assert isinstance(swapped.k[0], QuantizedArray) and isinstance(swapped.k[0].codes, np.ndarray)
    cache.books.swap_in("a", swapped)
    cache.do(cache.books.take_moves())
    a1 = cache.books.seqs["a"].blocks[1]
    for (codes, scales), held in zip(before, cache.k + cache.v, strict=True):
        np.testing.assert_array_equal(to_numpy(held.codes[a1]), codes)
        np.testing.assert_array_equal(to_numpy(held.scales[a1]), scales)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_engine_prices_its_pool_in_the_pools_format(tiny_model, kv_dtype):
    from minitransformer.kvquant import cache_bytes_per_token
    from minitransformer.serve.paged import check_fits
    need = 10**10 * 16 * cache_bytes_per_token(tiny_model.config, kv_dtype) + 8 * 8
    with pytest.raises(ValueError, match=f"slots need {need:,} bytes"):
        check_fits(tiny_model.config, 8, 10**10, 16, kv_dtype)

SUBNORMAL = 2.0 ** -24      # float16's smallest subnormal, the spacing of its tiny numbers


@pytest.mark.parametrize("kv_dtype, zero_code", [("q8_0", 0), ("q4_0", 8 | 8 << 4)])
def test_an_all_zero_block_gets_the_code_of_zero_without_a_warning(kv_dtype, zero_code):
    """Scale 0: the codes are those of 0 (q4_0: nibble 8 in both halves of each byte), not
    whatever a 0 / 0 = NaN becomes when cast to an integer, and numpy warns of nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        held = quantize(xp.zeros((2, 64), xp.float32), kv_dtype)
    assert (to_numpy(held.codes) == zero_code).all()


def alternating(value, d=32):
    """One block: value, -value, value, ..."""
    x = np.full((1, d), value, np.float32)
    x[0, 1::2] = -value
    return x


def test_q8_0_codes_stay_in_minus_127_to_127_when_the_scale_rounds_down():
    """max|x| / 127 = 1.4 subnormal steps, which float16 rounds to 1: x / s is then about
    +-178. The codes must stop at +-127, symmetric (not wrap around int8, nor reach -128)."""
    held = quantize(alternating(127 * 1.4 * SUBNORMAL), "q8_0")
    assert float(to_numpy(held.scales)[0, 0]) == SUBNORMAL       # the rounding this needs
    np.testing.assert_array_equal(to_numpy(held.codes)[0], [127, -127] * 16)
    back = to_numpy(dequantize(held))[0]
    np.testing.assert_array_equal(np.sign(back), np.sign(alternating(1.0)[0]))


def test_q4_0_codes_stay_in_their_nibble_when_the_scale_rounds_down():
    """The widest x / -8 = 1.4 subnormal steps, rounded to 1: x / s is about -11 and +11.
    The widest must land on code 0 (-8) and its opposite on 15 (+7), so every value keeps
    its sign (a code below 0 would wrap to 13..15, above 15 spill into the other nibble)."""
    x = alternating(8 * 1.4 * SUBNORMAL)
    held = quantize(x, "q4_0")
    assert abs(float(to_numpy(held.scales)[0, 0])) == SUBNORMAL
    back = to_numpy(dequantize(held))[0]
    np.testing.assert_array_equal(np.sign(back), np.sign(x[0]))
    s = abs(float(to_numpy(held.scales)[0, 0]))
    np.testing.assert_array_equal(np.abs(back), np.where(x[0] > 0, 8 * s, 7 * s))


def test_quantize_refuses_a_float_format_by_name():
    with pytest.raises(ValueError, match="'f16' is not a quantized format"):
        quantize(xp.zeros((1, 32), xp.float32), "f16")


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0", "q4_0"])
def test_attention_reads_float32_from_every_format(kv_dtype):
    """dequantize gives float32 whatever the store holds (not float16, nor float64)."""
    from minitransformer.kvquant import zeros
    held = zeros((2, 32), kv_dtype)
    held[0] = xp.asarray(alternating(0.5)[0])
    assert to_numpy(dequantize(held)).dtype == np.float32
