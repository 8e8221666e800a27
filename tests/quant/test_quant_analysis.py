"""The error table, one matrix's outlier statistics, the activation study and the techniques
table; and, on the real stories260K weights, the ordering the chapter finds."""
import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.model import forward
from minitransformer.shape import ceil_div
from quant.absmax import absmax_per_group, absmax_per_row, absmax_per_tensor
from quant.activations import (
    capture_residuals,
    default_layer,
    int8_levels,
    log2_histogram,
    longest_run,
    per_dim_max,
    persistence,
    quantile_dims,
    top_dims,
)
from quant.analysis import default_outlier_matrix, error_table, outlier_stats
from quant.gguf_weight import gguf_quantize
from quant.nf4 import nf4
from quant.qmodel import SCHEMES, projection_names, quantize_model, resident_bytes
from quant.techniques import matmul_operands, measure


@pytest.fixture(scope="module")
def model(checkpoint_dir):
    return mt.load(checkpoint_dir("qwen2-mha-untied"))


def test_error_table_rows_are_the_per_matrix_errors(model):
    table = error_table(model.weights)
    names = projection_names(model.weights)
    assert [row.scheme for row in table] == list(SCHEMES)
    by_hand = {  # the quantizers called directly, not through the SCHEMES table
        "int8-tensor": lambda w: absmax_per_tensor(w, 8),
        "int8-row": lambda w: absmax_per_row(w, 8),
        "int4-tensor": lambda w: absmax_per_tensor(w, 4),
        "int4-row": lambda w: absmax_per_row(w, 4),
        "int4-g128": lambda w: absmax_per_group(w, 4, 128),
        "nf4": lambda w: nf4(w, 64),
    } | {f"q{b}_k": lambda w, b=b: gguf_quantize(w, f"Q{b}_K") for b in (2, 3, 4, 5, 6)}
    for row in table:
        direct = {n: by_hand[row.scheme](model.weights[n]).error for n in names}
        assert row.errors == direct
        assert row.mean == pytest.approx(np.mean(list(direct.values())), rel=1e-12)
        assert row.worst == max(direct.items(), key=lambda item: item[1])
        stored = sum(by_hand[row.scheme](model.weights[n]).nbytes for n in names)
        params = sum(model.weights[n].size for n in names)
        assert row.bits_per_weight == 8 * stored / params


def test_outlier_stats_count_only_what_lies_beyond(model):
    w = np.where(np.arange(4000).reshape(40, 100) % 2 == 0, 0.01, -0.01).astype(np.float32)
    w[3, 7], w[20, 50] = 0.5, -0.3
    s = outlier_stats("m", w)
    assert s.beyond == 2 and s.max_abs == np.float32(0.5) and s.size == 4000
    assert s.max_over_std == pytest.approx(0.5 / np.float64(w).std(), rel=1e-6)
    assert outlier_stats("m", w, sigmas=1000).beyond == 0


def test_default_outlier_matrix(model):
    names = projection_names(model.weights)
    w = dict(model.weights)
    w[names[5]] = to_numpy(w[names[5]]).copy()
    w[names[5]][0, 0] = 20 * w[names[5]].std()  # 20 sigma: INT4 per-tensor collapses here
    assert default_outlier_matrix(w) == names[5]
    w["model.layers.12.mlp.down_proj.weight"] = w[names[0]]  # the chapter's matrix, when present
    assert default_outlier_matrix(w) == "model.layers.12.mlp.down_proj.weight"


def test_log2_histogram_bins():
    bins = log2_histogram(np.array([0.2, 0.9, 1.0, 1.5, 3.0, 3.9, 1579.6]))
    assert [(b.low, b.high) for b in bins[:4]] == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert [b.count for b in bins] == [2, 2, 2] + [0] * 8 + [1]
    assert (bins[-1].low, bins[-1].high) == (1024, 2048)
    assert log2_histogram(np.array([2048.0]))[-1].count == 1  # the top edge belongs to the last


def test_int8_levels_with_one_outlier_dimension():
    rng = np.random.default_rng(0)
    h = rng.uniform(-1, 1, (400, 8)).astype(np.float32)
    h[:, 3] *= 1270.0                           # one dimension ~1000x the rest
    one = int8_levels(h, dims=[0, 5])
    assert one.scale == pytest.approx(np.abs(h).max() / 127)
    assert one.per_dim == {0: 1, 5: 1}          # |h| < 1 < half a step of ~10: all code 0
    kept = int8_levels(h, dims=[0, 5], exclude=1)
    assert kept.scale == pytest.approx(np.abs(np.delete(h, 3, axis=1)).max() / 127)
    assert min(kept.per_dim.values()) > 100


def test_persistence_and_runs():
    maxima = np.array([[5, 1, 1], [1, 5, 1], [5, 1, 2], [5, 2, 1.0]])
    assert list(top_dims(maxima[2], 2)) == [0, 2]
    assert persistence(maxima, 0, 1) == [0, 2, 3]
    assert longest_run([0, 2, 3]) == (2, 3) and longest_run([4]) == (4, 4)
    assert quantile_dims(np.array([3.0, 1.0, 2.0]), (1.0, 0.5, 0.0)) == [0, 2, 1]
    assert [default_layer(n) for n in (24, 8, 5, 2)] == [16, 5, 3, 0]


def test_captured_residuals_are_the_forward_pass(model):
    ids = [1, 5, 9, 13, 2]
    h = capture_residuals(model, ids)
    c = model.config
    assert h.shape == (c.num_hidden_layers, len(ids), c.hidden_size) and h.dtype == np.float32
    final = to_numpy(forward(model, np.array([ids])))[0]
    g = to_numpy(model.weights["model.norm.weight"])
    last = h[-1] / np.sqrt((h[-1] ** 2).mean(-1, keepdims=True) + c.rms_norm_eps) * g
    np.testing.assert_allclose(last, final, rtol=1e-5, atol=1e-5)
    assert per_dim_max(h).shape == (c.num_hidden_layers, c.hidden_size)


def test_per_dim_max_is_the_largest_magnitude_over_the_tokens():
    h = np.array([[[1.0, -5.0, 0.0], [-3.0, 2.0, 0.5]],       # layer 0: 2 tokens x 3 dims
                  [[0.0, 0.5, -9.0], [-7.0, 4.0, 1.0]]])      # layer 1
    np.testing.assert_array_equal(per_dim_max(h), [[3.0, 5.0, 0.5], [7.0, 4.0, 9.0]])


def test_techniques_order_on_an_outlier_column(model):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    x[:, 9] *= 200.0                     # a systematic outlier feature
    w = 0.05 * rng.standard_normal((48, 64)).astype(np.float32)
    rows = {t.name.split(" (")[0]: t for t in measure(x, w)}
    per_tensor, vector = rows["INT8 per-tensor"].error, rows["vector-wise INT8"].error
    assert rows["LLM.int8 decomposition"].error < vector / 2 < per_tensor / 2
    assert rows["SmoothQuant migration"].error < per_tensor / 3
    assert rows["LLM.int8 decomposition"].note == "1 of 64 columns in float"
    assert rows["GPTQ / AWQ"].error is None
    x_in, w_in = matmul_operands(model, np.ones((3, 32), np.float32), 1)
    assert x_in.shape == (3, 32) and w_in.shape == (32, 32)


# ---- the real weights: the chapter's ordering ------------------------------------------------

def test_stories260k_error_ordering(stories):
    by = {row.scheme: row for row in error_table(stories.weights)}
    assert by["int8-row"].mean < 0.01                            # INT8 per-row: about free
    assert by["int8-row"].mean < by["int8-tensor"].mean
    worst = by["int4-tensor"]                                    # INT4 per-tensor: far worst
    for row in by.values():
        if row is not worst:
            assert worst.mean > 1.5 * row.mean and worst.worst[1] > row.worst[1]
    # 4-bit: per-row > group-128 > NF4. Group-128 gains little here: 30 of the 35 matrices
    # have rows of 64 weights, where a group of 128 is the whole row (it is per-row).
    assert by["int4-row"].mean > by["int4-g128"].mean > by["nf4"].mean


def test_stories260k_resident_bytes_match_bits_per_weight(stories):
    names = projection_names(stories.weights)
    shapes = [stories.weights[n].shape for n in names]
    # codes at their width, plus a float16 scale per row (per-row) or per run of the group
    # along each row, the short last run of a 172-wide row included
    for scheme, bits, group in [("int8-row", 8, None), ("int4-g128", 4, 128), ("nf4", 4, 64)]:
        held = resident_bytes(quantize_model(stories, scheme).weights)["projections"]
        assert held == sum(out * cols * bits // 8 + 2 * out * ceil_div(cols, group or cols)
                           for out, cols in shapes)
