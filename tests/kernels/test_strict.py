"""The strict test backend refuses what a GPU refuses (or pays a sync for), allows what CuPy
allows, and changes no number. These tests import it directly, so they run on any backend."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minitransformer.kernels import blas, strict

HOST = np.arange(6, dtype=np.float32).reshape(2, 3)


@pytest.fixture
def x():
    return strict.asarray(HOST)


@pytest.mark.parametrize("convert", [
    np.asarray, np.array, float, int, bool, complex, lambda a: a.item(), lambda a: a.tolist(),
    lambda a: a.tobytes(), lambda a: [0, 1][a], lambda a: np.float64(a),
    lambda a: a.__array_interface__, lambda a: memoryview(a), lambda a: a.ctypes,
])
def test_implicit_device_to_host_conversions_raise(x, convert):
    with pytest.raises((TypeError, AttributeError)):
        convert(x[0, :1].sum() if convert in (float, int, bool, complex) else x)


@pytest.mark.parametrize("mix", [
    lambda a: a + HOST, lambda a: HOST * a, lambda a: np.exp(a) @ HOST.T,
    lambda a: np.concatenate([a, HOST]), lambda a: strict.where(HOST > 0, a, 0),
    lambda a: strict.exp(HOST), lambda a: np.maximum(a, HOST),
])
def test_host_arrays_mixed_into_device_operations_raise(x, mix):
    with pytest.raises(TypeError, match="host numpy array mixed with device arrays"):
        mix(x)


def test_what_cupy_allows_is_allowed_and_stays_on_the_device(x):
    assert type(x.sum()) is strict.DeviceArray and x.sum().shape == ()  # 0-d, not a number
    assert type(x * np.float32(2) + 1) is strict.DeviceArray             # scalars mix freely
    assert type(x[np.array([1, 0])]) is strict.DeviceArray               # host index: uploaded
    assert x.shape == (2, 3) and x.dtype == np.float32 and len(x) == 2   # host metadata
    y = strict.zeros((2, 3), dtype=strict.float32)
    y[:, 1] = np.array([7.0, 8.0])                                       # host value: uploaded
    y[0] = x[1]
    assert strict.to_host(y).tolist() == [[3.0, 4.0, 5.0], [0.0, 8.0, 0.0]]
    assert type(np.array_equal(x, x)) is strict.DeviceArray              # as cupy.array_equal
    assert isinstance(x, strict.ndarray)
    view = x[1:]
    assert view.base is x and view[:, 1:].base is x and x.base is None  # as CuPy's .base
    assert view.data.ptr == x.data.ptr + 3 * 4                          # addresses, no bytes


def test_to_host_is_the_way_off_and_a_copy(x):
    host = strict.to_host(x * 2)
    assert type(host) is np.ndarray
    np.testing.assert_array_equal(host, HOST * 2)
    host[0, 0] = 99
    assert strict.to_host(x)[0, 0] == 0


@pytest.mark.parametrize("route", blas.ROUTES)
def test_the_model_under_strict_gives_numpys_logits_bit_for_bit(checkpoint_dir, monkeypatch,
                                                                 route):
    """One subprocess with MT_BACKEND=strict: the wrapper changes no bit of the math, float or
    quantized. Same bits because both sides make the same calls: strict runs NumPy's own
    calls on the data it wraps (backend.numpy_kernel), and the route each product takes into
    BLAS, which a process otherwise measures for itself (blas.py), is fixed alike on both
    sides (MT_PRODUCTS there, blas.FIXED here), once for each route."""
    import minitransformer as mt
    from quant.qmodel import quantize_model
    path = checkpoint_dir("llama-bias-headdim")
    ids, schemes = [3, 1, 4, 1, 5], ("int8-row", "int4-g128", "nf4")
    code = ("import json, sys, minitransformer as mt; from quant.qmodel import quantize_model; "
            "m = mt.load(sys.argv[1]); "
            "print(json.dumps([mt.logits(m, [3, 1, 4, 1, 5]).tobytes().hex(), "
            "mt.generate(m, [3, 1, 4], 6, eos_token_id=[]), "
            "type(m.weights['model.norm.weight']).__name__] + "
            f"[mt.logits(quantize_model(m, s), [3, 1, 4, 1, 5]).tobytes().hex() "
            f"for s in {schemes!r}]))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, MT_BACKEND="strict", MT_PRODUCTS=route))
    assert done.returncode == 0, done.stderr
    logits, tokens, kind, *quantized = json.loads(done.stdout)
    monkeypatch.setattr(blas, "FIXED", route)
    model = mt.load(path)
    assert kind == "DeviceArray"
    assert bytes.fromhex(logits) == mt.logits(model, ids).tobytes()
    assert tokens == mt.generate(model, [3, 1, 4], 6, eos_token_id=[])
    for scheme, hexed in zip(schemes, quantized, strict=True):
        assert bytes.fromhex(hexed) == mt.logits(quantize_model(model, scheme), ids).tobytes(), \
            scheme
