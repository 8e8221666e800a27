"""The backend switch: chosen once from MT_BACKEND, with a clear error for a bad value."""
import os
import subprocess
import sys

import pytest


def run(value):
    env = dict(os.environ, MT_BACKEND=value)
    code = "import minitransformer.backend as b; print(b.xp.__name__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_default_is_numpy():
    assert run("numpy").stdout.strip() == "numpy"


def test_unknown_backend_is_a_clear_error():
    result = run("tensorflow")
    assert result.returncode != 0
    assert "MT_BACKEND='tensorflow' is not a backend" in result.stderr


def test_missing_cupy_is_a_clear_error():
    try:
        import cupy  # noqa: F401 (imported only to learn whether CuPy imports here)
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    result = run("cupy")
    assert result.returncode != 0 and "MT_BACKEND=cupy but CuPy cannot be imported" in result.stderr


def test_strict_is_the_test_backend():
    assert run("strict").stdout.strip() == "minitransformer.kernels.strict"
