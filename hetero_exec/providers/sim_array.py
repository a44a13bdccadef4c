"""sim-gpu's device arrays: NumPy memory behind CuPy's boundaries.

A kernel that runs on sim-gpu gets `DeviceArray` values and the `SIM_CUPY` namespace as
``xp``. Both behave as CuPy 14 does where a kernel written for NumPy would break on a
GPU, so such a kernel fails here, on machines without one:

* **Implicit device-to-host conversion raises**, as in CuPy: ``np.asarray(x)`` /
  ``__array__``, the buffer protocol (``memoryview``, ``np.frombuffer``).
* **Host reads of device data inside a kernel raise** (stricter than CuPy, on purpose):
  ``.get()``, ``.tolist()``, ``.tobytes()``, ``bytes()``, ``xp.asnumpy`` called from kernel
  code. CuPy allows them (they synchronise and copy), but a kernel that needs device data
  on the host must say so in its registration: as a declared host input (the plan then
  hands it a host value, `exec.plan`) or as a host-only kernel. Outside kernels (IO binding
  users, tests) they work as in CuPy.
* **Size-1 reads are allowed**, as in CuPy: ``int(x)``, ``float(x)``, ``complex(x)``,
  ``bool(x)``, ``x.item()`` synchronise and read one element (data-dependent sizes, loop
  conditions). Each is counted in `STATS` (``syncs``). ``int()``/``float()`` need a 0-d
  array (NumPy 2's rule, which CuPy inherits by converting through NumPy). As in CuPy there is no
  ``__index__``: ``range(x)`` or ``slice(x)`` of a device scalar is a TypeError.
* **Host arrays do not mix in**: a ``numpy.ndarray`` (0-d too) passed to a ufunc, an
  operator or an ``xp`` function is a TypeError, as CuPy's "Unsupported type"; only the
  creation functions (``xp.asarray``, ``xp.array``...) and index arrays upload host data.
  Assigning a non-scalar host array into a device array is refused as CuPy's ``fill``.
* **NumPy functions dispatch only where CuPy implements them**
  (``__array_function__``/``__array_ufunc__`` with CuPy's lookup rules); ufunc methods
  only where CuPy has them (``maximum.reduce`` raises NotImplementedError as in CuPy).
* **``xp`` has CuPy's names and signatures only** (`cupy_surface`); a keyword CuPy does not
  take is a TypeError. Sorts are stable, as CuPy's are. Results CuPy returns as 0-d device arrays (reductions, a single
  element) stay 0-d device arrays; dtypes CuPy lacks (object, strings, bfloat16...) are
  refused.

The provider's own moves (`SimGpuProvider.to_device` / ``to_host``) use `upload` and
`download`, never the methods above.

Over 450 lines, one concern: CuPy's boundary, emulated. `DeviceArray`'s operators and
ufunc protocol dispatch through the `SIM_CUPY` namespace, and the namespace's functions
wrap and unwrap `DeviceArray` values through the same checks (`_unwrap`, `_wrap`, the
kernel-frame test of `_host_read`); apart, the two halves would import each other.
"""

from __future__ import annotations

import numbers
import sys
import threading
import types
import warnings
from typing import Any, Callable

import numpy as np

from hetero_exec.providers import _cupy_surface_data as SURFACE
from hetero_exec.providers.cupy_surface import signature


class ImplicitTransferError(TypeError):
    """A value crossed the host/device boundary without an explicit move."""


#: counters over all sim-gpu arrays of the process (reset freely; read by tests)
STATS = {"syncs": 0}
#: when a dict, every call into the namespace or an array method is recorded as
#: ``(cupy name, op, positional count, keyword names) -> count`` (see `recording`)
_RECORD: list[dict | None] = [None]
_DEVICE_KINDS = frozenset("biufc")

# -- moving values -------------------------------------------------------------


def _new(a: np.ndarray) -> "DeviceArray":
    d = object.__new__(DeviceArray)
    d._a = a
    return d


def upload(a: np.ndarray) -> "DeviceArray":
    """A device copy of a host array (the provider's move)."""
    _check_dtype(a.dtype, "to_device")
    return _new(a.copy())


def download(d: "DeviceArray") -> np.ndarray:
    """A host copy of a device array (the provider's move)."""
    return d._a.copy()


def device_dtype(dtype: Any) -> bool:
    """Whether CuPy has arrays of this dtype."""
    return np.dtype(dtype).kind in _DEVICE_KINDS


def _check_dtype(dt: np.dtype, where: str) -> None:
    if dt.kind not in _DEVICE_KINDS:
        raise ValueError(f"Unsupported dtype {dt} (cupy.{where}: CuPy has no arrays of it)")


def _wrap(r: Any) -> Any:
    """A NumPy result as CuPy returns it: arrays and NumPy scalars become device arrays."""
    t = type(r)
    if t is np.ndarray:
        if r.dtype.kind not in _DEVICE_KINDS:
            _check_dtype(r.dtype, "result")
        return _new(r)
    if isinstance(r, np.generic):
        return _wrap(np.asarray(r))
    if t is tuple or t is list:
        return t(_wrap(x) for x in r)
    return r


def _host_array_error(where: str) -> ImplicitTransferError:
    return ImplicitTransferError(
        f"{where}: Unsupported type <class 'numpy.ndarray'>: a host array where CuPy needs "
        f"a device array (an implicit host-to-device copy). Build it with xp.asarray, or "
        f"declare the input a host input of the kernel")


def _unwrap(v: Any, where: str) -> Any:
    t = type(v)
    if t is DeviceArray:
        return v._a
    if t is np.ndarray:
        raise _host_array_error(where)
    if t is tuple or t is list:
        return t(_unwrap(x, where) for x in v)
    return v


def _unwrap_host_ok(v: Any) -> Any:
    t = type(v)
    if t is DeviceArray:
        return v._a
    if t is tuple or t is list:
        return t(_unwrap_host_ok(x) for x in v)
    return v


# -- who is reading: kernel code or not -----------------------------------------

_KERNEL_CODES: list[Any] = [-1, {}]  # [registry generation, {code object: "domain::op"}]
_codes_lock = threading.Lock()


def _kernel_codes() -> dict:
    from hetero_exec.kernels.registry import generation, registered

    gen = generation()
    if _KERNEL_CODES[0] != gen:
        with _codes_lock:
            ops: dict[Any, set[str]] = {}
            for k in registered():
                code = getattr(k.fn, "__code__", None)
                if code is not None:
                    ops.setdefault(code, set()).add(f"{k.domain or 'ai.onnx'}::{k.op_type}")
            # one function may serve several ops (the element-wise helpers' wrappers)
            _KERNEL_CODES[1] = {code: names.pop() if len(names) == 1 else
                                f"one of {', '.join(sorted(names)[:3])}{'...' if len(names) > 3 else ''}"
                                for code, names in ops.items()}
            _KERNEL_CODES[0] = gen
    return _KERNEL_CODES[1]


def calling_kernel(depth: int = 2) -> str | None:
    """The ``domain::op`` of the registered kernel up the stack, if any."""
    codes = _kernel_codes()
    f = sys._getframe(depth)
    while f is not None:
        op = codes.get(f.f_code)
        if op is not None:
            return op
        f = f.f_back
    return None


def _host_read(what: str) -> None:
    op = calling_kernel(3)
    if op is not None:
        raise ImplicitTransferError(
            f"{what} of a device array inside kernel {op}: a host read of device data the "
            f"kernel does not declare. Declare the input in host_inputs (the plan then "
            f"passes a host value) or register the kernel host_only with the reason")


def _record(name: str, args: tuple, kwargs: dict) -> None:
    rec = _RECORD[0]
    if rec is not None:
        key = (name, calling_kernel(3) or "", len(args), tuple(sorted(kwargs)))
        rec[key] = rec.get(key, 0) + 1


class recording:
    """``with recording() as calls:`` collects the namespace and method calls made."""

    def __enter__(self) -> dict:
        self.calls: dict = {}
        _RECORD[0] = self.calls
        return self.calls

    def __exit__(self, *exc) -> None:
        _RECORD[0] = None


# -- signatures -------------------------------------------------------------------

class _Checked:
    """Checks calls against CuPy's declared signature, once per call shape."""

    __slots__ = ("name", "_sig", "_seen")

    def __init__(self, name: str):
        self.name = name
        params = SURFACE.SIGNATURES.get(name)
        self._sig = signature(params) if params is not None else None
        self._seen: set = set()

    def check(self, args: tuple, kwargs: dict) -> None:
        if self._sig is None:
            return
        key = (len(args), tuple(kwargs))
        if key in self._seen:
            return
        try:
            self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"cupy.{self.name}{self._sig}: {e}") from None
        self._seen.add(key)


def _function(name: str, np_fn: Callable, host_ok: bool = False) -> Callable:
    checked = _Checked(name)
    where = f"cupy.{name}"

    def call(*args, **kwargs):
        checked.check(args, kwargs)
        if _RECORD[0] is not None:
            _record(name, args, kwargs)
        if host_ok:
            a = [_unwrap_host_ok(x) for x in args]
            kw = {k: _unwrap_host_ok(v) for k, v in kwargs.items()}
        else:
            a = [_unwrap(x, where) for x in args]
            kw = {k: _unwrap(v, where) for k, v in kwargs.items()} if kwargs else kwargs
        r = np_fn(*a, **kw)
        out = kwargs.get("out")
        if type(out) is DeviceArray and r is out._a:
            return out
        return _wrap(r)

    call.__name__ = call.__qualname__ = name.rsplit(".", 1)[-1]
    call.__doc__ = f"sim-gpu's cupy.{name}: NumPy's {getattr(np_fn, '__name__', name)} on device arrays"
    return call


# -- ufuncs -----------------------------------------------------------------------

_SCALARS = (numbers.Number, np.generic)
_UFUNC_KWARGS = frozenset(SURFACE.UFUNC_KWARGS)


def _ufunc_arg(x: Any, where: str) -> Any:
    t = type(x)
    if t is DeviceArray:
        return x._a
    if t is np.ndarray:
        raise _host_array_error(where)
    if isinstance(x, _SCALARS):
        return x
    raise TypeError(f"{where}: Unsupported type {t}")


class SimUfunc:
    """A CuPy ufunc over NumPy's: same inputs allowed, same methods implemented."""

    def __init__(self, name: str, np_fn: Any):
        self.__name__ = name
        self.name = f"cupy_{name}"
        self._np = np_fn
        self.nin = getattr(np_fn, "nin", 1)
        self.nout = getattr(np_fn, "nout", 1)
        self.nargs = self.nin + self.nout
        self._where = f"cupy.{name}"

    def __repr__(self) -> str:
        return f"<ufunc '{self.name}' (sim-gpu)>"

    def __call__(self, *args, **kwargs):
        bad = set(kwargs) - _UFUNC_KWARGS
        if bad:
            raise TypeError(f"Wrong arguments {dict((k, kwargs[k]) for k in sorted(bad))} "
                            f"({self._where} takes only {sorted(_UFUNC_KWARGS)})")
        if _RECORD[0] is not None:
            _record(self.__name__, args, kwargs)
        a = [_ufunc_arg(x, self._where) for x in args]
        out = kwargs.get("out")
        if out is not None:
            kwargs = dict(kwargs)
            kwargs["out"] = tuple(_ufunc_arg(o, self._where) for o in out) if type(out) is tuple \
                else _ufunc_arg(out, self._where)
        r = self._np(*a, **kwargs)
        if type(out) is DeviceArray and r is out._a:
            return out
        return _wrap(r)

    def _method(self, method: str) -> Callable:
        if self.__name__ not in SURFACE.UFUNC_METHODS.get(method, ()) or not isinstance(self._np, np.ufunc):
            raise NotImplementedError(f"`{self.name}.{method}` is not supported yet")
        return getattr(self._np, method)

    def _device(self, x: Any, method: str) -> np.ndarray:
        if type(x) is not DeviceArray:
            raise TypeError(f"{self._where}.{method}: Unsupported type {type(x)}")
        return x._a

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        fn = self._method("reduce")
        _record(f"{self.__name__}.reduce", (array,), {})
        return _wrap(fn(self._device(array, "reduce"), axis=axis, dtype=dtype,
                        out=None if out is None else self._device(out, "reduce"), keepdims=keepdims))

    def accumulate(self, array, axis=0, dtype=None, out=None):
        fn = self._method("accumulate")
        _record(f"{self.__name__}.accumulate", (array,), {})
        return _wrap(fn(self._device(array, "accumulate"), axis=axis, dtype=dtype,
                        out=None if out is None else self._device(out, "accumulate")))

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        fn = self._method("reduceat")
        _record(f"{self.__name__}.reduceat", (array, indices), {})
        return _wrap(fn(self._device(array, "reduceat"), _unwrap_host_ok(indices), axis=axis,
                        dtype=dtype, out=None if out is None else self._device(out, "reduceat")))

    def at(self, a, indices, b=None):
        fn = self._method("at")
        _record(f"{self.__name__}.at", (a, indices, b), {})
        if b is not None:
            b = _ufunc_arg(b, f"{self._where}.at")
        fn(self._device(a, "at"), _index(indices), b)

    def outer(self, A, B, **kwargs):
        _record(f"{self.__name__}.outer", (A, B), kwargs)
        A, B = _unwrap_host_ok(A), _unwrap_host_ok(B)  # CuPy uploads both (core.array)
        return _wrap(self._np.outer(A, B, **kwargs)) if isinstance(self._np, np.ufunc) \
            else self._method("outer")


# -- the array --------------------------------------------------------------------

def _index(key: Any) -> Any:
    """An index as NumPy takes it; CuPy uploads host index arrays, but has no __index__."""
    t = type(key)
    if t is DeviceArray:
        return key._a
    if t is tuple:
        return tuple(_index(k) for k in key)
    if t is slice:
        for part in (key.start, key.stop, key.step):
            if type(part) is DeviceArray:
                raise TypeError("slice indices must be integers or None or have an __index__ "
                                "method (a device scalar has none: read it with int())")
        return key
    if t is list:
        return [_index(k) for k in key]
    return key


def _fill_value(value: Any) -> Any:
    t = type(value)
    if t is DeviceArray:
        return value._a
    if t is np.ndarray and value.ndim == 0 or isinstance(value, _SCALARS):
        return value
    if t is np.ndarray or t is list or t is tuple:
        raise ImplicitTransferError(
            "non-scalar numpy.ndarray cannot be used for fill (CuPy refuses assignment from "
            "host arrays into a device array); upload it with xp.asarray first")
    return value


class DeviceArray:
    """A sim-gpu device array (`cupy.ndarray` as sim-gpu has it): see the module doc."""

    __slots__ = ("_a", "__weakref__")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, *args, **kwargs):
        raise TypeError("sim-gpu device arrays come from xp functions or the provider's "
                        "to_device, not from the constructor")

    # -- attributes (CuPy's ndarray attributes) -----------------------------
    @property
    def shape(self) -> tuple:
        return self._a.shape

    @shape.setter
    def shape(self, value) -> None:
        self._a.shape = value

    @property
    def dtype(self) -> np.dtype:
        return self._a.dtype

    @property
    def ndim(self) -> int:
        return self._a.ndim

    @property
    def size(self) -> int:
        return self._a.size

    @property
    def nbytes(self) -> int:
        return self._a.nbytes

    @property
    def itemsize(self) -> int:
        return self._a.itemsize

    @property
    def strides(self) -> tuple:
        return self._a.strides

    @property
    def flags(self):
        return self._a.flags

    @property
    def T(self) -> "DeviceArray":
        return _new(self._a.T)

    @property
    def mT(self) -> "DeviceArray":
        return _new(self._a.mT)

    @property
    def real(self) -> "DeviceArray":
        return _wrap(self._a.real)

    @property
    def imag(self) -> "DeviceArray":
        return _wrap(self._a.imag)

    @property
    def base(self) -> "DeviceArray | None":
        return None if self._a.base is None else _wrap(self._a.base)

    @property
    def device(self) -> "SimDevice":
        return SIM_DEVICE

    # -- conversions --------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise ImplicitTransferError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly. (sim-gpu, as CuPy: a kernel must not read "
            "device data on the host)")

    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """The explicit host copy (CuPy's ``get``); refused inside kernels (module doc)."""
        _host_read(".get()")
        a = np.array(self._a, order=order, copy=True)
        if out is not None:
            out[...] = a
            return out
        return a

    def tolist(self) -> Any:
        _host_read(".tolist()")
        return self._a.tolist()

    def tobytes(self, order="C") -> bytes:
        _host_read(".tobytes()")
        return self._a.tobytes(order)

    def __bytes__(self) -> bytes:
        _host_read("bytes()")
        return bytes(self._a)

    def item(self) -> Any:
        if self._a.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        STATS["syncs"] += 1
        return self._a.item()

    def __int__(self) -> int:
        STATS["syncs"] += 1
        return int(self._a)

    def __float__(self) -> float:
        STATS["syncs"] += 1
        return float(self._a)

    def __complex__(self) -> complex:
        STATS["syncs"] += 1
        return complex(self._a)

    def __bool__(self) -> bool:
        n = self._a.size
        if n == 0:
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, "
                          "but in future this will result in an error. Use `array.size > 0` "
                          "to check that an array is not empty.", DeprecationWarning, stacklevel=2)
            return False
        if n > 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        STATS["syncs"] += 1
        return bool(self._a)

    def set(self, arr: np.ndarray, stream=None) -> None:
        """CuPy's explicit host-to-device copy into this array."""
        if type(arr) is not np.ndarray:
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("Shape or dtype mismatch")
        self._a[...] = arr

    def fill(self, value) -> None:
        v = _fill_value(value)
        if type(v) is np.ndarray and v.ndim:
            raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
        self._a.fill(v)

    # CuPy-only scatter methods (ufunc.at's back end)
    def scatter_add(self, slices, value) -> None:
        np.add.at(self._a, _index(slices), _fill_value(value))

    def scatter_max(self, slices, value) -> None:
        np.maximum.at(self._a, _index(slices), _fill_value(value))

    def scatter_min(self, slices, value) -> None:
        np.minimum.at(self._a, _index(slices), _fill_value(value))

    # -- Python protocols ---------------------------------------------------
    def __len__(self) -> int:
        if self._a.ndim == 0:
            raise TypeError("len() of unsized object")
        return self._a.shape[0]

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._a.shape[0]))

    def __getitem__(self, key) -> "DeviceArray":
        return _wrap(self._a[_index(key)])

    def __setitem__(self, key, value) -> None:
        self._a[_index(key)] = _fill_value(value)

    def __repr__(self) -> str:
        return repr(self._a)

    def __str__(self) -> str:
        return str(self._a)

    def __format__(self, spec: str) -> str:
        return format(self._a, spec)

    def __reduce__(self):
        return (_unpickle, (self._a,))

    def __copy__(self) -> "DeviceArray":
        return _new(self._a.copy())

    def __deepcopy__(self, memo) -> "DeviceArray":
        return _new(self._a.copy())

    # -- NumPy's protocols, with CuPy's rules -------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method not in ("__call__", "outer", "at", "reduce", "accumulate", "reduceat"):
            return NotImplemented
        func = SIM_CUPY.__dict__.get(ufunc.__name__)
        if not isinstance(func, SimUfunc):
            return NotImplemented
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            kwargs["out"] = out[0]
        for x in inputs:
            if not (isinstance(x, (DeviceArray, np.ndarray)) or isinstance(x, _SCALARS)):
                return NotImplemented
        if ufunc.__name__ in ("greater", "greater_equal", "less", "less_equal", "equal", "not_equal"):
            # CuPy's workaround for numpy/numpy#12142: 0-d host arrays compare as scalars
            inputs = tuple(x.item() if type(x) is np.ndarray and x.ndim == 0 else x for x in inputs)
        if method != "__call__":
            func = getattr(func, method)
        return func(*inputs, **kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        module: Any = SIM_CUPY
        try:
            for part in func.__module__.split(".")[1:]:
                module = getattr(module, part)
            sim_func = getattr(module, func.__name__)
        except AttributeError:
            return NotImplemented
        if sim_func is func:
            return NotImplemented
        for t in types_:
            if not issubclass(t, (DeviceArray, np.ndarray)):
                return NotImplemented
        return sim_func(*args, **kwargs)

    # -- operators (CuPy's: through its ufuncs) -----------------------------
    def _cmp(self, other, name):
        if not isinstance(other, (DeviceArray, np.ndarray)) and not isinstance(other, _SCALARS):
            return NotImplemented
        if type(other) is np.ndarray and other.ndim == 0:
            other = other.item()
        return SIM_CUPY.__dict__[name](self, other)

    def __eq__(self, other):  # type: ignore[override]
        return self._cmp(other, "equal")

    def __ne__(self, other):  # type: ignore[override]
        return self._cmp(other, "not_equal")

    def __lt__(self, other):
        return self._cmp(other, "less")

    def __le__(self, other):
        return self._cmp(other, "less_equal")

    def __gt__(self, other):
        return self._cmp(other, "greater")

    def __ge__(self, other):
        return self._cmp(other, "greater_equal")

    def __neg__(self):
        return SIM_CUPY.negative(self)

    def __pos__(self):
        return SIM_CUPY.positive(self)

    def __abs__(self):
        return SIM_CUPY.absolute(self)

    def __invert__(self):
        return SIM_CUPY.invert(self)

    def __matmul__(self, other):
        return SIM_CUPY.matmul(self, other)

    def __rmatmul__(self, other):
        return SIM_CUPY.matmul(other, self)

    def __divmod__(self, other):
        return SIM_CUPY.divmod(self, other)

    def __rdivmod__(self, other):
        return SIM_CUPY.divmod(other, self)


def _binary_ops() -> None:
    ops = {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
           "floordiv": "floor_divide", "mod": "remainder", "pow": "power", "and": "bitwise_and",
           "or": "bitwise_or", "xor": "bitwise_xor", "lshift": "left_shift", "rshift": "right_shift"}
    for op, uname in ops.items():
        def fwd(self, other, _u=uname):
            return SIM_CUPY.__dict__[_u](self, other)

        def rev(self, other, _u=uname):
            return SIM_CUPY.__dict__[_u](other, self)

        def inplace(self, other, _u=uname):
            SIM_CUPY.__dict__[_u](self, other, out=self)
            return self

        for dunder, fn in ((f"__{op}__", fwd), (f"__r{op}__", rev), (f"__i{op}__", inplace)):
            fn.__name__ = dunder
            setattr(DeviceArray, dunder, fn)


#: ndarray members with a hand-written version above, or not emulated
_NOT_EMULATED = frozenset({"data", "flat", "cstruct", "mdspan", "reduced_view", "toDlpack",
                           "dump", "dumps", "tofile"})


def _array_methods() -> None:
    """Every ndarray method CuPy has and DeviceArray does not define yet: NumPy's method
    (or function) on the NumPy array, checked against CuPy's signature."""
    for full, kind in SURFACE.NAMES.items():
        if not full.startswith("ndarray.") or kind != "method":
            continue
        name = full[len("ndarray."):]
        if name in _NOT_EMULATED or name in DeviceArray.__dict__:
            continue
        setattr(DeviceArray, name, _method(name))


def _method(name: str) -> Callable:
    checked = _Checked(f"ndarray.{name}")
    where = f"cupy.ndarray.{name}"
    np_fn = getattr(np, name, None)

    def method(self, *args, **kwargs):
        checked.check(args, kwargs)
        if _RECORD[0] is not None:
            _record(f"ndarray.{name}", args, kwargs)
        a = [_unwrap(x, where) for x in args]
        kw = {k: _unwrap(v, where) for k, v in kwargs.items()} if kwargs else kwargs
        if name in ("sort", "argsort"):  # stable, as CuPy's (see _stable)
            kw = dict(kw, kind="stable")
            if len(a) > 1:
                a = a[:1]
        bound = getattr(self._a, name, None)
        r = bound(*a, **kw) if bound is not None else np_fn(self._a, *a, **kw)
        if r is self._a:
            return self
        return _wrap(r)

    method.__name__ = method.__qualname__ = name
    return method


def _unpickle(a: np.ndarray) -> DeviceArray:
    return _new(a)


class SimDevice:
    """What ``x.device`` returns (CuPy: a cupy.cuda.Device)."""

    id = 0

    def __repr__(self) -> str:
        return "<sim-gpu Device 0>"

    def synchronize(self) -> None:
        pass


SIM_DEVICE = SimDevice()


# -- the namespace ----------------------------------------------------------------

class SimNamespace(types.ModuleType):
    """A module with CuPy's names only; a missing one says whether CuPy has it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        prefix = self.__name__.partition(".")[2]
        full = f"{prefix}.{name}" if prefix else name
        if full in SURFACE.NAMES:
            raise AttributeError(f"cupy.{full} exists in CuPy but sim-gpu does not emulate it")
        raise AttributeError(f"module 'cupy' has no attribute {full!r} (CuPy {SURFACE.VERSION} "
                             f"lacks it: a kernel using it would fail on the GPU)")


#: names that take host data (CuPy's creation functions copy it to the device)
HOST_OK = frozenset({"array", "asarray", "asanyarray", "frombuffer", "fromfile", "fromfunction",
                     "fromiter", "fromstring", "loadtxt", "genfromtxt"})
#: functions NumPy answers with a Python scalar and CuPy with a 0-d device array
_DEVICE_SCALAR_RESULTS = frozenset({"count_nonzero", "array_equal", "array_equiv", "allclose"})


def _asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if type(a) is DeviceArray:
        _host_read("cupy.asnumpy()")
        r = np.array(a._a, order=order, copy=True)
        if out is not None:
            out[...] = r
            return out
        return r
    return np.asarray(a, order=order)


def _get_array_module(*args):
    return SIM_CUPY if any(type(a) is DeviceArray for a in args) else np


def _fuse(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


_CUSTOM: dict[str, Any] = {"asnumpy": _asnumpy, "get_array_module": _get_array_module,
                           "fuse": _fuse, "is_available": lambda: True}


def _stable(fn: Callable) -> Callable:
    """CuPy's sorts are stable whatever ``kind`` says (Thrust's stable sort; CuPy ignores
    the argument), NumPy's default quicksort is not: ties come out as on the GPU."""
    def sort(a, axis=-1, kind=None):
        return fn(a, axis=axis, kind="stable")

    return sort


_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


def _gemm(fn: Callable) -> Callable:
    """A product computed as cuBLAS computes it, every element the same way wherever it
    sits in the matrices:

    * float16 runs with float32 compute (CuPy's sgemmEx/GemmEx with CUBLAS_COMPUTE_32F):
      it accumulates in float32 and rounds once, where NumPy's float16 matmul rounds at
      every step;
    * float32 accumulates in float64 and rounds once. OpenBLAS's Haswell and Zen sgemm
      kernels round rows of a product differently (identical rows of A give two values,
      alternating in groups of six rows), which a GPU's tiles do not: a light squeezenet
      whose 1000 logits are equal (about 9.5e9, 1024 apart per float32 step) came out of
      sim-gpu unequal on those hosts, and its softmax one-hot instead of uniform. Rounding
      a float64 sum once gives equal rows equal results on every host's BLAS (about 2.3x
      a float32 product's time: sim-gpu is for testing placement, not for speed)."""
    def product(*args, **kwargs):
        dtypes = {getattr(a, "dtype", None) for a in args}
        if _F16 in dtypes:
            compute, result = np.float32, _F16
        elif dtypes == {_F32} or dtypes == {_F32, None}:
            compute, result = np.float64, _F32
        else:
            return fn(*args, **kwargs)
        out = kwargs.pop("out", None)
        wide = [a.astype(compute) if getattr(a, "dtype", None) == result else a for a in args]
        r = fn(*wide, **kwargs).astype(result)
        if out is None:
            return r
        np.copyto(out, r, casting="same_kind")
        return out

    product.__name__ = getattr(fn, "__name__", "product")
    return product


#: NumPy functions standing in for CuPy's where their behaviour differs
_NUMPY_AS_CUPY: dict[str, Callable] = {
    "sort": _stable(np.sort), "argsort": _stable(np.argsort),
    **{name: _gemm(getattr(np, name)) for name in ("matmul", "dot", "tensordot")},
}


def _scalar_result(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        r = fn(*args, **kwargs)
        return _new(np.asarray(r)) if isinstance(r, (bool, int, float, np.generic)) else r

    call.__name__ = fn.__name__
    return call


class SimRandomState:
    """cupy.random.RandomState over NumPy's generator (its draws differ from CuPy's)."""

    def __init__(self, seed=None, method=None):
        self._rs = np.random.RandomState(seed)

    def __getattr__(self, name: str) -> Any:
        full = f"random.RandomState.{name}"
        if SURFACE.NAMES.get(full) != "method" or name.startswith("_"):
            raise AttributeError(f"cupy.{full} does not exist in CuPy {SURFACE.VERSION}")
        checked = _Checked(full)
        fn = getattr(self._rs, name)

        def method(*args, **kwargs):
            checked.check(args, kwargs)
            _record(full, args, kwargs)
            return _wrap(fn(*[_unwrap(a, f"cupy.{full}") for a in args], **kwargs))

        return method


def _member(full: str, kind: str, np_mod: Any) -> Any:
    """The sim object for one CuPy name, or None when sim-gpu does not emulate it."""
    name = full.rsplit(".", 1)[-1]
    np_obj = getattr(np_mod, name, None) if np_mod is not None else None
    if kind == "numpy":
        return np_obj
    if full in _CUSTOM:
        return _CUSTOM[full]
    if kind == "ufunc":
        return SimUfunc(name, np_obj) if np_obj is not None else None
    if kind in ("function", "gufunc"):
        if np_obj is None or not callable(np_obj):
            return None
        fn = _function(full, _NUMPY_AS_CUPY.get(full, np_obj), host_ok=full in HOST_OK)
        return _scalar_result(fn) if full in _DEVICE_SCALAR_RESULTS else fn
    if kind == "class":
        if full == "ndarray":
            return DeviceArray
        if full == "random.RandomState":
            return SimRandomState
        if isinstance(np_obj, type) and issubclass(np_obj, BaseException):
            return np_obj
        exc = getattr(np, "exceptions", None)
        return getattr(exc, name, None) if exc is not None else None
    if kind == "constant":
        return np_obj if np_obj is not None or name == "newaxis" else None
    return None


def _build() -> SimNamespace:
    # not named "cupy": code that keys state by xp.__name__ (kernels/random.py) must not
    # mix sim-gpu's NumPy-backed objects with real CuPy's in one process
    root = SimNamespace("sim_cupy", "sim-gpu's CuPy namespace: NumPy behind CuPy's names")
    spaces = {"": root}
    for sub in sorted(n for n, k in SURFACE.NAMES.items() if k == "module"):
        ns = SimNamespace(f"sim_cupy.{sub}")
        parent, _, leaf = sub.rpartition(".")
        setattr(spaces[parent], leaf, ns)
        spaces[sub] = ns
    np_spaces = {"": np}
    for sub in spaces:
        if sub:
            mod = np
            for part in sub.split("."):
                mod = getattr(mod, part, None) if mod is not None else None
            np_spaces[sub] = mod
    for full, kind in SURFACE.NAMES.items():
        parent, _, leaf = full.rpartition(".")
        if parent not in spaces or kind == "module":
            continue  # class members are handled by their classes
        obj = _member(full, kind, np_spaces[parent])
        if obj is not None or (kind == "constant" and leaf == "newaxis"):
            setattr(spaces[parent], leaf, obj)
    return root


SIM_CUPY = _build()
_binary_ops()
_array_methods()
