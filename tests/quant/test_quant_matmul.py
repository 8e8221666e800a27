"""The row-blocked quantized matmul against its specification, x @ dequantize().T.

Exact things with ==: the float rows a block is converted into (the sign-extension and byte-
table tricks give exactly the levels the specification looks up). The products within float
summation error: |fast - spec| <= 4 n eps (|x| @ |W_hat|.T), n the inner length, because
per-row schemes scale the output ((x . c) s) where the specification scales the weights.
"""
import numpy as np
import pytest

from minitransformer.backend import BACKEND, to_device, to_numpy
from quant import matmul
from quant.schemes import SCHEMES

QWEIGHTS = sorted(s for s in SCHEMES if SCHEMES[s].gguf is None)  # codes + scales apart
pytestmark = pytest.mark.skipif(BACKEND != "numpy", reason="the blocked path is NumPy's")

# odd rows and columns; ragged groups (200 = 128 + 72, 576 = 4.5 x 128)
SHAPES = [(48, 256), (37, 128), (7, 9), (130, 200), (12, 576)]


def weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = 0.02 * rng.standard_normal(shape).astype(np.float32)
    w[rng.integers(0, shape[0], 3), rng.integers(0, shape[1], 3)] *= 20  # outliers
    return w


def within_summation_error(fast, spec, x, w_hat):
    bound = 4 * x.shape[-1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w_hat).T)
    assert fast.shape == spec.shape and fast.dtype == np.float32
    assert np.all(np.abs(fast - spec) <= bound + 1e-30)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), (4, 5)])  # 20 rows: a prefill
def test_blocked_matmul_is_the_dequantized_product(monkeypatch, scheme, shape, lead):
    monkeypatch.setattr(matmul, "BLOCK_FLOATS", 1000)  # many blocks and a short last one
    q = SCHEMES[scheme].quantize(weights(shape))
    x = np.random.default_rng(1).standard_normal(lead + (shape[1],)).astype(np.float32)
    w_hat = to_numpy(q.dequantize())
    fast = to_numpy(q.matmul(to_device(x)))
    within_summation_error(fast, x @ w_hat.T, x, w_hat)


@pytest.mark.parametrize("scheme", QWEIGHTS)
@pytest.mark.parametrize("shape", [(48, 256), (7, 10), (37, 128)])
def test_each_block_holds_exactly_the_specified_levels(scheme, shape):
    q = SCHEMES[scheme].quantize(weights(shape))
    out, cols = shape
    table = matmul.lookup_table(q)
    levels = to_numpy(q.levels)[to_numpy(q.unpacked_codes()).astype(int)].reshape(shape)
    for r0, r1 in [(0, 2), (2, out), (0, out)]:
        block = matmul.levels_block(q, r0, r1, table)
        if q.bits == 4 and table is None:   # the INT4 grid: 16 x levels, byte's pair swapped
            block = block.reshape(r1 - r0, cols // 2, 2)[:, :, ::-1].reshape(r1 - r0, cols) / 16
        np.testing.assert_array_equal(block, levels[r0:r1])
        x = np.eye(cols, dtype=np.float32)  # and x in the same order: x_b @ block.T is exact
        np.testing.assert_array_equal(matmul.block_columns(q, table, x) @
                                      matmul.levels_block(q, r0, r1, table).T, levels[r0:r1].T)


def test_integer_grids_need_no_table_and_nf4_does():
    w = weights((8, 128))
    assert matmul.lookup_table(SCHEMES["int8-row"].quantize(w)) is None
    assert matmul.lookup_table(SCHEMES["int4-g128"].quantize(w)) is None
    assert matmul.lookup_table(SCHEMES["nf4"].quantize(w)).shape == (256,)


def test_shapes_without_whole_bytes_or_groups_take_the_specification():
    for scheme, shape in (("int4-g128", (5, 201)), ("nf4", (4, 9)), ("int4-row", (3, 7))):
        q = SCHEMES[scheme].quantize(weights(shape))
        assert not matmul.fast_layout(q)
        x = np.random.default_rng(2).standard_normal((2, shape[1])).astype(np.float32)
        np.testing.assert_array_equal(q.matmul(x), x @ to_numpy(q.dequantize()).T)

