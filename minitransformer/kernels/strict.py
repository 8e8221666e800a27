"""A strict test backend: NumPy underneath, a GPU's rules on top (``MT_BACKEND=strict``).

No GPU has run this project's tests, and the mistakes a first GPU run finds are mostly one
kind: an array left on the device where host code expects host data. CuPy refuses some of
them (``np.asarray`` of a device array, a host array inside a device ufunc: TypeError) and
quietly pays for the rest with a transfer and a device sync per call (``float(x)``,
``int(x)``, ``bool(x)``, ``x.item()``, ``x.tolist()``, an ``if`` on a device value). This
module refuses all of them, so the suite run under it catches on a CPU what the GPU would
either reject or run slowly. The one way from device to host is ``backend.to_numpy``.

``xp`` is this module under ``MT_BACKEND=strict``: ``xp.zeros``, ``xp.exp``, ... are NumPy's,
with results wrapped as ``DeviceArray`` and host arrays refused as arguments (only
``xp.asarray`` / ``xp.array`` upload). As in CuPy: reductions give 0-d device arrays, never
Python numbers; Python and NumPy scalars mix freely with device arrays; host arrays and lists
may index a device array and be assigned into one (CuPy uploads them); shapes, dtypes and
``len`` are host metadata.

    >>> from minitransformer.kernels import strict
    >>> x = strict.asarray(numpy.arange(3.0))          # an upload
    >>> y = (x * 2).sum()                              # a 0-d device array, not a number
    >>> strict.to_host(y)
    array(6.)
    >>> float(y)
    Traceback (most recent call last):
    TypeError: float() of a device array: an implicit device-to-host transfer; use backend.to_numpy
    >>> x + numpy.ones(3)
    Traceback (most recent call last):
    TypeError: add: a host numpy array mixed with device arrays; move it with backend.to_device

Left out: device memory and streams, and CuPy's wrap-around of out-of-bounds indices (NumPy
still raises, so index checks stay the host code's job either way).
"""
import dataclasses
import operator

import numpy
from numpy.lib.mixins import NDArrayOperatorsMixin

# Values that are neither arrays nor containers of them: passed through as they are.
HOST_TYPES = frozenset({int, float, bool, complex, str, bytes, slice, type(None),
                        type(Ellipsis)})


class DeviceArray(NDArrayOperatorsMixin):
    """An array "on the device": NumPy data that refuses to be read implicitly on the host.
    Unhashable, as arrays are (the mixin's __eq__ makes its __hash__ None)."""

    __slots__ = ("_data", "_owner")

    def __init__(self, data: numpy.ndarray):
        self._data = data
        self._owner: DeviceArray | None = None  # the one whose memory this one views (_view)

    # -- what reaches the host only through backend.to_numpy -------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("implicit conversion of a device array to a NumPy array "
                        "(np.asarray, np.array, a NumPy function on host data); "
                        "use backend.to_numpy")

    def _refuse(self, what):
        raise TypeError(f"{what} of a device array: an implicit device-to-host transfer; "
                        "use backend.to_numpy")

    def __float__(self):
        self._refuse("float()")

    def __int__(self):
        self._refuse("int()")

    def __index__(self):
        self._refuse("int() (as an index)")

    def __complex__(self):
        self._refuse("complex()")

    def __bool__(self):
        self._refuse("bool() (an if or while on a device value)")

    def item(self, *args):
        self._refuse(".item()")

    def tolist(self):
        self._refuse(".tolist()")

    def tobytes(self, *args, **kwargs):
        self._refuse(".tobytes()")

    # -- device-side behaviour ---------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = [device_data(x, ufunc.__name__) for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(device_data(o, ufunc.__name__) for o in kwargs["out"])
        return wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        if any(not issubclass(t, DeviceArray) for t in types):
            raise TypeError(f"{func.__name__}: a host numpy array mixed with device arrays; "
                            "move it with backend.to_device")
        result = func(*unwrap_all(args, func.__name__), **unwrap_all(kwargs, func.__name__))
        if isinstance(result, (bool, float)):  # array_equal, allclose: 0-d on the device too
            result = numpy.asarray(result)
        return wrap(result)

    def __getitem__(self, key):
        return self._view(self._data[index_data(key)])

    # straight to NumPy's operator on the data, as x + y below (_operator)
    def __neg__(self):
        return wrap(-self._data)

    def __abs__(self):
        return wrap(abs(self._data))

    def __invert__(self):
        return wrap(~self._data)

    @property
    def T(self):
        return self._view(self._data.T)

    def _view(self, result):
        """Wrap a result of an operation on self, remembering the owner if it is a view."""
        out = wrap(result)
        if type(out) is DeviceArray and out._data.base is not None:
            owner = self if self._data.base is None else self._owner
            if owner is not None and out._data.base is owner._data:
                out._owner = owner
        return out

    @property
    def base(self):
        """The array this one views (None for an owner), the same object each time, as
        CuPy's .base: `w.base is stack` is how a view of a stack is recognized."""
        if self._data.base is None:
            return None
        return self._owner if self._owner is not None else DeviceArray(self._data.base)

    @property
    def data(self):
        """Where the data lives, as CuPy's MemoryPointer: .ptr, an address (no bytes)."""
        return DevicePointer(self._data.__array_interface__["data"][0])

    def __setitem__(self, key, value):
        self._data[index_data(key)] = value._data if isinstance(value, DeviceArray) else value

    def __len__(self):
        return len(self._data)

    def __iter__(self):
        return (wrap(row) for row in self._data)

    def __repr__(self):
        return f"DeviceArray({self._data!r})"

    def __getattr__(self, name):
        """shape, dtype, reshape, sum, astype, T, ...: NumPy's, with array results wrapped.
        Never the __array_interface__ / buffer / dlpack doors: NumPy would read through them."""
        if name.startswith("__") or name in ("ctypes", "tofile", "dump", "dumps"):
            raise AttributeError(f"a device array has no {name!r} on the host")
        value = getattr(self._data, name)
        if callable(value):
            return lambda *a, **k: self._view(value(*unwrap_all(a, name), **unwrap_all(k, name)))
        return self._view(value)


def _operator(name, reflected=False):
    """x + y and friends, straight to NumPy's operator on the data: the same refusals as the
    ufuncs, without NumPy's override dispatch on every arithmetic step (the suite's speed)."""
    op = getattr(operator, name)

    def method(self, other):
        other = device_data(other, name)
        return wrap(op(other, self._data) if reflected else op(self._data, other))
    method.__name__ = f"__{'r' if reflected else ''}{name.strip('_')}__"
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_",
              "or_", "xor", "lshift", "rshift", "lt", "le", "eq", "ne", "gt", "ge"):
    _dunder = _name.rstrip("_")
    setattr(DeviceArray, f"__{_dunder}__", _operator(_name))
    if _name not in ("lt", "le", "eq", "ne", "gt", "ge"):
        setattr(DeviceArray, f"__r{_dunder}__", _operator(_name, reflected=True))
for _name in ("shape", "dtype", "ndim", "size", "nbytes", "itemsize", "strides"):
    setattr(DeviceArray, _name, property(operator.attrgetter(f"_data.{_name}")))


class DevicePointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def wrap(value):
    """NumPy results -> device arrays (a NumPy scalar from a reduction becomes a 0-d array)."""
    kind = type(value)
    if kind is numpy.ndarray:
        return DeviceArray(value)
    if kind in HOST_TYPES or kind is DeviceArray:
        return value
    if isinstance(value, numpy.generic):
        return DeviceArray(numpy.asarray(value))
    if isinstance(value, numpy.ndarray):  # a subclass (memmap, ...)
        return DeviceArray(numpy.asarray(value))
    if kind in (tuple, list) and any(isinstance(v, (numpy.ndarray, numpy.generic))
                                     for v in value):
        return kind(wrap(v) for v in value)
    return value


def device_data(x, what):
    """An argument of a device operation -> its NumPy data; a host array is an error."""
    kind = type(x)
    if kind is DeviceArray:
        return x._data
    if kind in HOST_TYPES:
        return x
    if isinstance(x, numpy.ndarray):
        raise TypeError(f"{what}: a host numpy array mixed with device arrays; "
                        "move it with backend.to_device")
    if kind in (list, tuple):
        return kind(device_data(v, what) for v in x)
    return x  # NumPy scalars, dtypes, types: host values that CuPy takes as they are


def unwrap_all(args, what):
    """Positional (a tuple) or keyword (a dict) arguments -> the same with NumPy data."""
    if type(args) is dict:
        return {k: device_data(v, what) for k, v in args.items()} if args else args
    return [device_data(v, what) for v in args]


def index_data(key):
    """An index: device arrays unwrapped; host arrays and lists allowed (CuPy uploads them)."""
    if isinstance(key, DeviceArray):
        return key._data
    if isinstance(key, tuple):
        return tuple(k._data if isinstance(k, DeviceArray) else k for k in key)
    return key


def to_host(a) -> numpy.ndarray:
    """The one way off the device (backend.to_numpy calls it): a host copy, as cupy.asnumpy."""
    if isinstance(a, DeviceArray):
        return a._data.copy()
    return numpy.asarray(a)


def kernel(fn):
    """fn, a function of NumPy arrays -> the same function of device arrays, run on their data
    as a device kernel runs on device memory: device arrays among the arguments (also as the
    fields of a dataclass, such as a quantized weight) are passed as the NumPy arrays they
    wrap, and array results come back wrapped. No transfer and nothing refused: inside, the
    calls are exactly the ones a NumPy run makes (backend.numpy_kernel).

    >>> double = kernel(lambda a: numpy.multiply(a, 2))
    >>> double(asarray([1.0, 2.0]))
    DeviceArray(array([2., 4.]))
    """
    def on_data(*args):
        return wrap(fn(*(data_of(a) for a in args)))
    on_data.__name__ = getattr(fn, "__name__", "kernel")
    return on_data


def data_of(a):
    """A kernel's argument -> the NumPy data it wraps (a dataclass: its fields' data)."""
    if type(a) is DeviceArray:
        return a._data
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return dataclasses.replace(a, **{f.name: data_of(getattr(a, f.name))
                                         for f in dataclasses.fields(a) if f.init})
    return a


def asarray(a, dtype=None, **kwargs):
    """Host (or device) data -> a device array. From the host it is an upload: a copy in
    memory of its own, as on a GPU (code that relied on the two aliasing would fail there)."""
    if isinstance(a, DeviceArray):
        return wrap(numpy.asarray(a._data, dtype=dtype, **kwargs))
    return DeviceArray(numpy.array(a, dtype=dtype, copy=True, **kwargs))


def array(a, dtype=None, **kwargs):
    if isinstance(a, DeviceArray):
        return wrap(numpy.array(a._data, dtype=dtype, **kwargs))
    return DeviceArray(numpy.array(a, dtype=dtype, **kwargs))


ndarray = DeviceArray  # isinstance(w, xp.ndarray) asks "a plain device array?", as with CuPy


def __getattr__(name):
    """xp.<name>: NumPy's function with device results and host arguments refused, or NumPy's
    constant / dtype / type as is (xp.float32 is numpy.float32 in CuPy too)."""
    value = getattr(numpy, name)
    if isinstance(value, type) or not callable(value):
        return value

    def device_function(*args, **kwargs):
        return wrap(value(*unwrap_all(args, name), **unwrap_all(kwargs, name)))
    device_function.__name__ = name
    globals()[name] = device_function  # made once: the next xp.<name> finds it directly
    return device_function
