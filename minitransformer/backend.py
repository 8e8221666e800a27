"""The one place that decides which array library runs the model: NumPy or CuPy.

Set the environment variable ``MT_BACKEND`` before importing minitransformer:

    MT_BACKEND=numpy   (default) everything runs on the CPU
    MT_BACKEND=cupy    the same model code runs on an NVIDIA GPU through CuPy
    MT_BACKEND=strict  for tests: NumPy wrapped so that every implicit device-to-host
                       conversion raises, as on a GPU (see strict.py); the CI runs it too

It is read once, at import; an unknown value or a missing CuPy is an error right here rather
than a surprise later (errors.SettingError: the command line and the scripts print it as one
error line). Model code does ``from minitransformer.backend import xp`` and never
imports numpy for array math, so the code on the screen is the code that ran on either device.

Two CuPy traps this module exists to contain (CuPy's "differences from NumPy" page):
reductions return 0-d device arrays, not Python numbers, so convert with ``int()``/``float()``
at the boundaries; and out-of-bounds integer indices wrap around silently instead of raising,
so indices (slots, block tables) are validated on the host before they reach the device.
"""
import os
from typing import TYPE_CHECKING, Any

import numpy

from minitransformer.checks import environment_choice
from minitransformer.errors import SettingError

BACKENDS = ("numpy", "cupy", "strict")
BACKEND = environment_choice("MT_BACKEND", BACKENDS, "a backend", "for numpy") or "numpy"

# An array of the backend that runs: NumPy's, CuPy's or strict's DeviceArray. The type checker
# takes it as anything (the three share NumPy's API, not a type); the shape is the comment beside.
Array = Any

if TYPE_CHECKING:
    # the type checker reads xp as NumPy, the API all three backends offer, and checks the
    # model's array calls against NumPy's; the calls one backend alone has are made on it by name
    xp = numpy
elif BACKEND == "numpy":
    xp = numpy
elif BACKEND == "cupy":
    try:
        import cupy as xp
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise SettingError(
            f"MT_BACKEND=cupy but CuPy cannot be imported ({e}): pip install -e '.[gpu]' "
            "(a CuPy wheel matching your CUDA), or unset MT_BACKEND to run on NumPy"
        ) from e
else:
    from minitransformer.kernels import strict as xp


def to_numpy(a):
    """Any backend array (or scalar) -> a host numpy array."""
    if BACKEND == "cupy":
        import cupy
        return cupy.asnumpy(a)
    if BACKEND == "strict":
        from minitransformer.kernels import strict
        return strict.to_host(a)
    return numpy.asarray(a)


def numpy_kernel(fn):
    """A function written for NumPy arrays -> the same function for this backend's arrays.

    For the routes written against NumPy's own calls (blas.py, quant/matmul.py): on NumPy it
    is fn itself; under strict, fn runs on the NumPy data the device arrays wrap, as a kernel
    runs on device memory (no transfer), so strict makes NumPy's very calls, with its bits.
    CuPy takes its own route before reaching one of these.
    """
    if BACKEND == "strict":
        from minitransformer.kernels import strict
        return strict.kernel(fn)
    return fn


def to_device(a):
    """A host array -> an array of the active backend (no copy on NumPy)."""
    return xp.asarray(a)


def synchronize():
    """Wait for the device to finish queued work, so wall-clock timings mean something."""
    if BACKEND == "cupy":
        import cupy
        cupy.cuda.Stream.null.synchronize()


def memory_bytes() -> tuple[int, str]:
    """-> (bytes arrays of the active backend can use at most, where): the GPU's free memory
    on CuPy, the machine's physical memory otherwise. A size checked against it fails with
    the project's own message before NumPy tries (and reports "Unable to allocate 931 TiB")."""
    if BACKEND == "cupy":
        import cupy
        return int(cupy.cuda.Device().mem_info[0]), "free GPU memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
