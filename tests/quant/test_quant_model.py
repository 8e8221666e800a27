"""A model run on quantized weights: the matmul hook, what is held in memory, and how close
the logits come to the float model's as bits rise."""
import tracemalloc
from dataclasses import fields, replace

import numpy as np
import pytest

import minitransformer as mt
from conftest import assert_like_solo
from minitransformer.backend import BACKEND, to_device, to_numpy
from quant.absmax import absmax_per_group, absmax_per_row
from quant.int8 import int8_activations
from quant.qmodel import SCHEMES, projection_names, quantize_model, resident_bytes
from quant.qweight import QWeight

PROMPT = [3, 17, 42, 5, 9, 60, 11, 2, 33, 71, 8, 19]


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return mt.load(checkpoint_dir("llama-gqa"))


def test_qweight_matmul_is_x_times_the_dequantized_matrix():
    w = 0.02 * np.random.default_rng(0).standard_normal((48, 200)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((2, 5, 200)).astype(np.float32)
    q = absmax_per_group(w, 4, 128)
    y = to_numpy(q.matmul(to_device(x)))
    assert y.shape == (2, 5, 48) and y.dtype == np.float32
    np.testing.assert_allclose(y, x @ to_numpy(q.dequantize()).T, rtol=1e-5, atol=1e-6)
    exact = x @ w.T
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 1.5 * q.error  # near it


def test_quantize_model_replaces_exactly_the_projections(model):
    q = quantize_model(model, "int4-g128")
    names = projection_names(model.weights)
    assert len(names) == 7 * model.config.num_hidden_layers
    for name, w in q.weights.items():
        if name in names:
            assert isinstance(w, QWeight) and w.shape == tuple(model.weights[name].shape)
        else:
            assert w is model.weights[name]  # embedding, norms, head: untouched, not copied
    assert not any(isinstance(w, QWeight) for w in model.weights.values())  # caller's model kept


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_resident_bytes_match_the_bits_per_weight(model, scheme):
    q = quantize_model(model, scheme)
    names = projection_names(model.weights)
    held = resident_bytes(q.weights)
    assert held["projections"] == sum(SCHEMES[scheme].nbytes(model.weights[n].shape)
                                      for n in names)
    assert held["other"] == resident_bytes(model.weights)["other"]
    tables = 0 if SCHEMES[scheme].gguf else 2 ** SCHEMES[scheme].bits * 4  # one shared table;
    assert held["levels"] == tables                       # GGUF blocks hold their own scales
    assert resident_bytes(q) == held  # a Model counts as its weights


def test_resident_bytes_names_what_it_cannot_count():
    with pytest.raises(ValueError, match="weights dict or a Model, got list"):
        resident_bytes([np.zeros(3)])


@pytest.mark.parametrize("scheme", ["int8-row", "nf4"])
def test_a_qweight_holds_no_float_copy_of_its_matrix(model, scheme):
    q = quantize_model(model, scheme)
    for name in projection_names(model.weights):
        w = q.weights[name]
        arrays = [getattr(w, f.name) for f in fields(w) if hasattr(getattr(w, f.name), "nbytes")]
        assert sum(a.nbytes for a in arrays) == w.nbytes + w.levels.nbytes
        assert w.codes.dtype == np.uint8 and w.scales.dtype == np.float16


@pytest.mark.skipif(BACKEND != "numpy", reason="tracemalloc sees host allocations only")
def test_the_allocator_agrees_with_resident_bytes(model):
    """What quantizing leaves allocated is the codes and scales, plus small Python objects."""
    tracemalloc.start()
    try:
        q = quantize_model(model, "int4-g128")
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    held = resident_bytes(q.weights)["projections"]
    n = len(projection_names(model.weights))
    assert held <= allocated <= held + 2048 * n


def relative_logit_error(model, scheme):
    ref = mt.logits(model, PROMPT)
    got = mt.logits(quantize_model(model, scheme), PROMPT)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def test_logits_approach_the_float_models_as_bits_rise(model):
    e = {s: relative_logit_error(model, s) for s in ("int8-row", "int4-row", "int8-tensor",
                                                     "int4-tensor")}
    assert e["int8-row"] < e["int4-row"] / 8      # 16x finer grid: error ~16x smaller
    assert e["int8-tensor"] < e["int4-tensor"] / 8
    assert 0 < e["int8-row"] < 0.01


def test_a_quantized_model_generates_the_same_tokens_with_and_without_the_cache(model):
    q = quantize_model(model, "nf4")
    fast = mt.generate(q, PROMPT, 12, eos_token_id=[])
    slow = mt.generate(q, PROMPT, 12, cache=False, eos_token_id=[])
    assert len(fast) == 12          # the cache's products and a recompute's: the near-tie rule
    assert_like_solo(q, fast, slow, PROMPT, eos_token_id=[])


def test_int8_activations_keep_outlier_columns_and_quantize_the_rest():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    x[1, 2, 5] = 40.0                                         # column 5 is an outlier
    y = to_numpy(int8_activations(to_device(x), 6.0))
    np.testing.assert_array_equal(y[..., 5], x[..., 5])      # kept exactly, every token
    rest = np.delete(x, 5, axis=-1)
    scale = np.abs(rest).max(axis=-1, keepdims=True) / 127   # one scale per token
    codes = np.delete(y, 5, axis=-1) / scale
    np.testing.assert_allclose(codes, np.round(codes), atol=1e-3)  # on the INT8 grid
    assert np.all(np.abs(np.delete(y, 5, axis=-1) - rest) <= 0.5 * scale * (1 + 1e-5))
    everything = to_numpy(int8_activations(to_device(x), np.inf))   # no decomposition
    assert not np.array_equal(everything[..., 5], x[..., 5])


def test_llm_int8_decomposition_rescues_an_outlier_column():
    rng = np.random.default_rng(3)
    w = 0.02 * rng.standard_normal((32, 64)).astype(np.float32)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    x[:, 7] *= 100.0
    q = absmax_per_row(w, 8)
    exact = x @ w.T
    error = {}
    for t in (None, 6.0, np.inf):
        y = to_numpy(replace(q, outlier_threshold=t).matmul(to_device(x)))
        error[t] = np.linalg.norm(y - exact)
    assert error[6.0] < error[np.inf] / 3      # decomposition beats plain W8A8
    assert error[None] <= error[6.0]           # weight-only is the floor


def test_bad_schemes_and_weights_are_named(model):
    with pytest.raises(ValueError, match="unknown scheme 'int3'"):
        quantize_model(model, "int3")
    name = projection_names(model.weights)[3]
    w = to_numpy(model.weights[name]).copy()
    w[0, 0] = np.nan
    broken = replace(model, weights=model.weights | {name: to_device(w)})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*inf or nan"):
        quantize_model(broken, "int8-row")


@pytest.mark.parametrize("threshold", [6, 0.0, np.float32(6.0), np.inf])
def test_outlier_thresholds_that_mean_something_are_kept(model, threshold):
    q = quantize_model(model, "int8-row", outlier_threshold=threshold)
    name = projection_names(model.weights)[0]
    assert q.weights[name].outlier_threshold == threshold


@pytest.mark.parametrize("threshold", [-1.0, np.nan, True, "6", [6.0]])
def test_bad_outlier_thresholds_are_named(model, threshold):
    with pytest.raises(ValueError, match=r"outlier_threshold must be None or a number >= 0"):
        quantize_model(model, "int8-row", outlier_threshold=threshold)


def test_a_quantized_model_batched_row_by_row_gets_each_rows_solo_bits(model):
    """Row by row (the engine's batch-invariant decode) a quantized weight multiplies each
    row as alone: last_logits_alone gives each row the logits of a batch of one."""
    from minitransformer.generate import last_logits, last_logits_alone
    q = quantize_model(model, "int4-g128")
    ids = np.array([PROMPT, PROMPT[::-1]])
    both = last_logits_alone(q, ids)
    for b in range(2):
        np.testing.assert_array_equal(both[b], last_logits(q, ids[b:b + 1])[0])


def test_dequantize_model_holds_the_specified_float_matrices(model):
    from minitransformer.linear import is_quantized
    from quant.qmodel import dequantize_model
    from quant.scales import relative_error
    q = quantize_model(model, "int4-g128")
    back = dequantize_model(q)
    for name, w in q.weights.items():
        if is_quantized(w):
            assert not is_quantized(back.weights[name])
            np.testing.assert_array_equal(to_numpy(back.weights[name]), to_numpy(w.dequantize()))
            assert relative_error(to_numpy(model.weights[name]), to_numpy(back.weights[name])) \
                == pytest.approx(w.error, rel=1e-6)   # the error measured when quantizing
    # the same function: logits agree with the quantized model's up to summation order
    np.testing.assert_allclose(mt.logits(back, PROMPT), mt.logits(q, PROMPT), rtol=1e-4,
                               atol=1e-4)
