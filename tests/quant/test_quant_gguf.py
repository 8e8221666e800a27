"""quant/'s llama.cpp quantizers: the bytes llama-quantize writes, and the matrices held so.

Q8_0, Q5_0 and Q5_1 against the gguf package's own ``gguf.quants.quantize`` byte for byte (it
implements those, not the k-quants nor IQ4_NL). The k-quants and IQ4_NL against llama.cpp's
C reference: the digests below are of the bytes ggml's ``quantize_row_q*_K_ref`` and
``quantize_iq4_nl`` wrote for MATRIX (ggml d99724f2, built with cc -O2, no fused multiply-add;
scripts/dev/measure_kquants.py rebuilds and compares from any ggml or llama.cpp checkout).
"""
import hashlib

import numpy as np
import pytest

from minitransformer.backend import to_numpy
from minitransformer.formats.gguf_types import FORMATS, dequantize
from quant import ggml_blocks, gguf_weight, kquants
from quant.gguf_weight import GGUFWeight, gguf_quantize, stored_bytes, stored_type
from quant.schemes import SCHEMES


def matrix():
    """16 rows of 512: Gaussian, with the cases that branch: a zero row, all-positive and
    all-negative rows, a constant row, tiny weights, outliers, values on a grid, a zero
    sub-block, every other weight zero."""
    rng = np.random.default_rng(41)
    w = rng.standard_normal((16, 512)).astype(np.float32)
    w[0] = 0
    w[1], w[2], w[3] = np.abs(w[1]), -np.abs(w[2]), 0.25
    w[4, :256] *= 1e-3
    w[5, 7], w[6, 300] = 30, -30
    w[7] = np.round(w[7] * 4) / 4
    w[8, :16] = 0
    w[9, ::2] = 0
    return w


# sha256 (first 16 hex digits) of llama.cpp's bytes for matrix(), measured as the docstring says
LLAMA_CPP = {"Q2_K": "543c36f4785b1896", "Q3_K": "780e2435a0419c28", "Q4_K": "a659e2c4f9eb6a9b",
             "Q5_K": "00026edde3e15973", "Q6_K": "736cc1f5214b5d93",
             "IQ4_NL": "d3e2d5d3f66ee70f", "Q8_0": "aa900e04399b0c6e",
             "Q5_0": "8f5e2c051de60f5b", "Q5_1": "3137135404520c7b"}
QUANTIZE = {"Q2_K": kquants.q2_k, "Q3_K": kquants.q3_k, "Q4_K": kquants.q4_k,
            "Q5_K": kquants.q5_k, "Q6_K": kquants.q6_k, "IQ4_NL": ggml_blocks.iq4_nl,
            "Q8_0": ggml_blocks.q8_0, "Q5_0": ggml_blocks.q5_0, "Q5_1": ggml_blocks.q5_1}


# and for 1,024 super-blocks of Gaussian weights (rng 0, (256, 1024)): rare branches, such as
# Q3_K's fifth pass moving a code, happen in one block of a thousand
LLAMA_CPP_GAUSSIAN = {"Q2_K": "fcccb4e717ddf15a", "Q3_K": "b87ea5c62a091b57",
                      "Q4_K": "0ef151abff41d975", "Q5_K": "5ee5bf989156cc38",
                      "Q6_K": "3d1d5dd6fdd2143b", "IQ4_NL": "1fca09810f579b42"}


def digest(stored) -> str:
    return hashlib.sha256(stored.tobytes()).hexdigest()[:16]


@pytest.mark.parametrize("type_name", LLAMA_CPP)
def test_the_bytes_are_llama_cpps(type_name):
    stored = QUANTIZE[type_name](matrix())
    assert stored.dtype == np.uint8
    assert stored.shape == (16, 512 // FORMATS[type_name].weights * FORMATS[type_name].nbytes)
    assert digest(stored) == LLAMA_CPP[type_name]


@pytest.mark.parametrize("type_name", LLAMA_CPP_GAUSSIAN)
def test_a_thousand_super_blocks_are_llama_cpps(type_name):
    w = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    assert digest(QUANTIZE[type_name](w)) == LLAMA_CPP_GAUSSIAN[type_name]


def hard_cases():
    """Matrices of 32-blocks whose rounding is on a knife's edge: halves, ties for the largest
    magnitude, tiny and huge scales."""
    rng = np.random.default_rng(5)
    yield rng.standard_normal((64, 256)).astype(np.float32) * 0.02
    grid = rng.integers(-16, 17, (64, 256)).astype(np.float32) / 2      # halves everywhere
    grid[:, 0], grid[:, 31] = 8, -8                                       # |max| tied
    yield grid
    yield np.float32(1e-6) * rng.standard_normal((8, 64)).astype(np.float32)
    yield np.float32(6e4) * np.tanh(rng.standard_normal((8, 64))).astype(np.float32)
    yield np.zeros((2, 64), np.float32)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_1"])
def test_blocks_of_32_are_the_gguf_packages_bytes(type_name):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    for w in hard_cases():
        ours = QUANTIZE[type_name](w)
        assert np.array_equal(ours, quantize(w, gguf.GGMLQuantizationType[type_name]))


@pytest.mark.parametrize("type_name", sorted(gguf_weight.QUANTIZERS))
def test_a_matrix_quantized_a_chunk_of_rows_at_a_time_is_the_same_bytes(type_name,
                                                                        monkeypatch):
    """quantize_blocks's chunks of rows (here 3 rows of 512, the last chunk 1 row) give the
    bytes of the whole matrix quantized at once."""
    monkeypatch.setattr(gguf_weight, "CHUNK_WEIGHTS", 3 * 512 + 7)
    w = matrix()[:13]
    assert np.array_equal(gguf_weight.quantize_blocks(w, type_name),
                          gguf_weight.QUANTIZERS[type_name](w))


def test_more_bits_less_error():
    w = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    errors = [gguf_quantize(w, f"Q{b}_K").error for b in (2, 3, 4, 5, 6)]
    assert errors == sorted(errors, reverse=True)
    assert 0.25 < errors[0] < 0.35 and 0.01 < errors[-1] < 0.025, errors


@pytest.mark.parametrize("type_name, cols, stored", [
    ("Q4_K", 1536, "Q4_K"), ("Q4_K", 576, "Q5_0"), ("Q5_K", 576, "Q5_1"),
    ("Q6_K", 576, "Q8_0"), ("Q3_K", 576, "IQ4_NL"), ("Q2_K", 576, "IQ4_NL"),
    ("Q4_K", 9, "F16"), ("Q6_K", 200, "F16")])
def test_rows_that_are_not_super_blocks_take_llama_quantizes_fallback(type_name, cols, stored):
    assert stored_type(type_name, cols) == stored
    w = np.random.default_rng(0).standard_normal((3, cols)).astype(np.float32)
    q = gguf_quantize(w, type_name)
    assert isinstance(q, GGUFWeight) and q.type_name == stored and q.scheme == type_name
    assert q.nbytes == stored_bytes(type_name, (3, cols)) == SCHEMES[type_name.lower()].nbytes(
        (3, cols))
    assert np.array_equal(to_numpy(q.dequantize()), dequantize(q.blocks, stored, (3, cols)))


def test_bits_per_weight_come_from_the_block_layout():
    expected = {"q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}
    for name, bits in expected.items():
        assert SCHEMES[name].bits_per_weight((576, 1536)) == bits
        assert gguf_quantize(np.ones((2, 512), np.float32), name.upper()).bits_per_weight == bits


def test_a_non_finite_weight_is_refused_by_position():
    w = np.ones((2, 256), np.float32)
    w[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"weight \[1, 3\] is nan"):
        gguf_quantize(w, "Q4_K")


def test_the_measuring_script_finds_ggml_quants_or_says_why_not(tmp_path):
    from measure_kquants import main, sources

    for layout in ("ggml", "llama.cpp"):
        root = tmp_path / layout
        src = root / ("src" if layout == "ggml" else "ggml/src")
        src.mkdir(parents=True)
        (src / "ggml-quants.c").write_text("")
        assert sources(root)[0] == src / "ggml-quants.c"
    with pytest.raises(ValueError, match=r"no src/ggml-quants.c or ggml/src/ggml-quants.c: not "
                                         r"a ggml or llama.cpp checkout"):
        main(["--ggml", str(tmp_path / "ggml" / "src")])


def test_a_large_matrix_is_quantized_once_and_kept(monkeypatch, tmp_path):
    """The blocks of a matrix of KEPT_WEIGHTS or more are kept: the same matrix and type is
    read back, bytes and error equal; another matrix, a file cut short, a changed quantizer or
    MT_QUANT_CACHE=off quantize again."""
    from quant import gguf_weight
    monkeypatch.setenv("MT_WEIGHTS_DIR", str(tmp_path))
    w = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    assert w.size >= gguf_weight.KEPT_WEIGHTS
    calls, real = [], gguf_weight.QUANTIZERS["Q4_K"]
    monkeypatch.setitem(gguf_weight.QUANTIZERS, "Q4_K", lambda m: calls.append(1) or real(m))
    first, second = gguf_quantize(w, "Q4_K"), gguf_quantize(w, "Q4_K")
    assert len(calls) == 1 and np.array_equal(first.blocks, second.blocks)
    assert first.error == second.error and np.array_equal(first.blocks, real(w))
    kept, = (tmp_path / "quantized").glob("Q4_K-*.npy")
    other = w.copy()
    other[0, 0] += 1
    assert not np.array_equal(gguf_quantize(other, "Q4_K").blocks, first.blocks)
    assert len(calls) == 2
    kept.write_bytes(kept.read_bytes()[:100])                      # cut short
    assert np.array_equal(gguf_quantize(w, "Q4_K").blocks, first.blocks) and len(calls) == 3
    monkeypatch.setattr(gguf_weight, "quantizers_digest", lambda: "another quantizer")
    gguf_quantize(w, "Q4_K")
    assert len(calls) == 4
    monkeypatch.setenv("MT_QUANT_CACHE", "off")
    gguf_quantize(w, "Q4_K")
    assert len(calls) == 5


def test_exp16_tells_weights_already_on_a_4_bit_grid():
    from exp16_quant_error import share_on_a_4_bit_grid

    w = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    on_grid = dequantize(ggml_blocks.q5_1(w), "Q5_1", w.shape)     # 32 levels: not 4-bit
    assert share_on_a_4_bit_grid(w) == 0.0 and share_on_a_4_bit_grid(on_grid) < 0.5
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize
    q4_1 = dequantize(quantize(w, gguf.GGMLQuantizationType.Q4_1), "Q4_1", w.shape)
    assert share_on_a_4_bit_grid(q4_1) == 1.0


@pytest.mark.parametrize("type_name, cols", [("Q4_K", 512), ("Q6_K", 576)])  # 576: Q8_0
def test_blocks_decoded_once_multiply_bit_for_bit_and_are_counted(type_name, cols):
    """decoded() holds the floats the blocks decode to: every product (one row, a few, a
    prefill's many; over more than one step of rows) gives the very bits decoding at each
    product gives, and what is held counts the floats too."""
    from quant import gguf_weight
    from quant.qmodel import resident_bytes
    rng = np.random.default_rng(3)
    out = 2 * gguf_weight.ROWS_PER_STEP + 5
    q = gguf_quantize(rng.standard_normal((out, cols)).astype(np.float32), type_name)
    d = q.decoded()
    for M in (1, 4, 40):
        x = rng.standard_normal((M, cols)).astype(np.float32)
        assert np.array_equal(to_numpy(d.matmul(x)), to_numpy(q.matmul(x)))
    assert resident_bytes({"w": d})["projections"] == q.nbytes + 4 * out * cols
    assert d.nbytes == q.nbytes and d.bits_per_weight == q.bits_per_weight   # the blocks'
