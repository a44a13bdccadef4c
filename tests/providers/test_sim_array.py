"""sim-gpu's strict arrays: CuPy's boundaries over NumPy memory (providers/sim_array.py).

Each rule is checked on the array and namespace directly, then through a session: test-only
kernels that convert device data to the host behind the plan's back fail on strict sim-gpu
(and run on cpu, and on sim-gpu with strict=False, which is what the strict mode adds).
"""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from hetero_exec import InferenceSession
from hetero_exec.errors import KernelError
from hetero_exec.kernels._common import host_ints
from hetero_exec.kernels.registry import has_op, kernel
from hetero_exec.providers import parse_provider
from hetero_exec.providers import sim_array as sa

xp = sa.SIM_CUPY


def dev(a) -> sa.DeviceArray:
    return parse_provider("sim-gpu").to_device(np.asarray(a))


# --- the array ---------------------------------------------------------------------------


def test_implicit_conversions_to_host_raise():
    x = dev(np.arange(6.0).reshape(2, 3))
    for convert in (np.asarray, np.array, np.ascontiguousarray, memoryview,
                    lambda a: np.frombuffer(a, dtype=np.float64)):
        with pytest.raises(TypeError):
            convert(x)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        np.asarray(x)


def test_explicit_reads_work_outside_kernels():
    x = dev([[1, 2], [3, 4]])
    np.testing.assert_array_equal(x.get(), [[1, 2], [3, 4]])
    assert x.tolist() == [[1, 2], [3, 4]] and xp.asnumpy(x).sum() == 10
    assert isinstance(x.get(), np.ndarray) and not isinstance(x, np.ndarray)


def test_size_one_reads_sync_as_in_cupy():
    x = dev(7)
    before = sa.STATS["syncs"]
    assert int(x) == 7 and float(dev([7])[0]) == 7.0 and bool(dev([7])) and x.item() == 7
    assert sa.STATS["syncs"] - before == 4
    with pytest.raises(ValueError, match="ambiguous"):
        bool(dev([1, 2]))
    with pytest.raises(TypeError):  # CuPy has no __index__: read it with int()
        range(dev(3))
    with pytest.raises(TypeError):
        dev([1, 2, 3])[: dev(2)]


def test_host_arrays_do_not_mix_in():
    x = dev([1.0, 2.0])
    host = np.ones(2)
    for op in (lambda: x + host, lambda: host + x, lambda: x * np.float32(2) + host,
               lambda: xp.maximum(x, host), lambda: xp.concatenate([x, host]),
               lambda: x + np.asarray(1.0)):
        with pytest.raises(sa.ImplicitTransferError, match="Unsupported type <class 'numpy.ndarray'>"):
            op()
    with pytest.raises(sa.ImplicitTransferError, match="non-scalar numpy.ndarray"):
        x[...] = host
    # scalars (Python and NumPy) and the creation functions are fine, as in CuPy
    assert (x * np.float32(2) + 1).get().tolist() == [3.0, 5.0]
    assert xp.asarray(host).get().tolist() == [1.0, 1.0]
    x[0] = np.float64(5)
    x[dev([1])] = 9.0
    assert x.get().tolist() == [5.0, 9.0]


def test_scalars_stay_device_arrays():
    x = dev(np.arange(6).reshape(2, 3))
    for r in (x.sum(), xp.max(x), x[1, 2], np.sum(x), xp.count_nonzero(x), x.argmax()):
        assert type(r) is sa.DeviceArray and r.shape == (), r
    assert xp.shape(x) == (2, 3) and xp.ndim(x) == 2  # host metadata, as in CuPy


def test_numpy_functions_dispatch_only_where_cupy_has_them():
    x = dev(np.arange(4.0))
    assert type(np.concatenate([x, x])) is sa.DeviceArray
    assert type(np.exp(x)) is sa.DeviceArray and type(np.linalg.norm(x)) is sa.DeviceArray
    for missing in (lambda: np.insert(x, 0, 1.0), lambda: np.nanpercentile(x, 50),
                    lambda: np.spacing(x)):
        with pytest.raises(TypeError):
            missing()


def test_namespace_has_cupy_names_and_signatures_only():
    with pytest.raises(AttributeError, match="CuPy 14.2.0 lacks it"):
        xp.insert  # noqa: B018
    with pytest.raises(AttributeError, match="does not emulate"):
        xp.RawKernel  # noqa: B018
    x = dev([1.0, 2.0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'where'"):
        xp.sum(x, where=x > 1)
    with pytest.raises(TypeError, match="Wrong arguments"):
        xp.add(x, x, where=x > 1)
    with pytest.raises(NotImplementedError, match="maximum.reduce"):
        xp.maximum.reduce(x)
    out = dev([0.0, 0.0, 0.0])
    xp.add.at(out, dev([0, 0, 2]), 1.0)
    assert out.get().tolist() == [2.0, 0.0, 1.0]
    with pytest.raises(NotImplementedError):
        xp.multiply.at(out, dev([0]), 2.0)
    assert xp.float32 is np.float32 and xp.ndarray is sa.DeviceArray and xp.newaxis is None


def test_dtypes_cupy_lacks_are_refused():
    with pytest.raises(ValueError, match="Unsupported dtype object"):
        xp.zeros(3, dtype=object)
    with pytest.raises(ValueError, match="Unsupported dtype"):
        dev([1.0]).astype(np.str_)
    # the provider keeps such values on the host, as gpu does
    assert type(dev(np.array(["a"], dtype=object))) is np.ndarray


def test_pickle_and_copies():
    x = dev([1, 2, 3])
    y = pickle.loads(pickle.dumps(x))
    assert type(y) is sa.DeviceArray and y.get().tolist() == [1, 2, 3]
    v = x[1:]
    v += 10  # a view writes through, as CuPy's does
    assert x.get().tolist() == [1, 12, 13]


def test_provider_moves_count_and_copy():
    prov = parse_provider("sim-gpu")
    a = np.arange(4, dtype=np.float32)
    d = prov.to_device(a)
    a[0] = 99
    assert prov.bytes_to_device == 16 and d.get()[0] == 0
    seq = prov.to_device([a, a])
    assert all(type(s) is sa.DeviceArray for s in seq)
    back = prov.to_host(seq)
    assert all(type(s) is np.ndarray for s in back) and prov.bytes_to_host == 32
    assert parse_provider(("sim-gpu", {"strict": False})).xp is np


# --- kernels that cross the boundary behind the plan's back ---------------------------------

DOMAIN = "test.strict"


def _register_test_kernels() -> None:
    if has_op(DOMAIN, "SecretAsarray"):
        return

    @kernel("SecretAsarray", domain=DOMAIN)
    def SecretAsarray(xp, x):  # np.asarray on a device value: works on NumPy only
        return (xp.asarray(np.asarray(x) * 2),)

    @kernel("SecretTolist", domain=DOMAIN)
    def SecretTolist(xp, x):  # a Python loop over the elements, read with tolist()
        return (xp.asarray([v * 2 for v in x.reshape(-1).tolist()], dtype=x.dtype).reshape(x.shape),)

    @kernel("SecretHostMix", domain=DOMAIN)
    def SecretHostMix(xp, x):  # a host constant mixed into device data
        return (x * 2 + np.zeros(x.shape, dtype=x.dtype),)

    @kernel("UndeclaredShape", domain=DOMAIN)
    def UndeclaredShape(xp, x, shape):  # reads input 1 on the host but does not say so
        return (x.reshape(host_ints(shape)),)

    @kernel("DeclaredShape", domain=DOMAIN, host_inputs=(1,))
    def DeclaredShape(xp, x, shape):  # the same kernel, declared: the plan hands a host value
        return (x.reshape(host_ints(shape)),)

    @kernel("Honest", domain=DOMAIN)
    def Honest(xp, x):
        return (x * 2,)


def _model(op: str, with_shape: bool = False) -> onnx.ModelProto:
    ins = ["x"]
    nodes = []
    if with_shape:
        # the shape is computed on the device (Abs of a graph input), not by host steps
        nodes.append(h.make_node("Abs", ["s"], ["shape"]))
        ins.append("shape")
    nodes.append(h.make_node(op, ins, ["y"], domain=DOMAIN))
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [2, 3])]
    if with_shape:
        inputs.append(h.make_tensor_value_info("s", T.INT64, [2]))
    out = h.make_tensor_value_info("y", T.FLOAT, [3, 2] if with_shape else [2, 3])
    g = h.make_graph(nodes, "g", inputs, [out])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)])
    m.ir_version = 8
    return m


def _feed(with_shape: bool = False) -> dict:
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    if with_shape:
        feed["s"] = np.array([3, -2], dtype=np.int64)
    return feed


@pytest.mark.parametrize("op, caught", [
    ("SecretAsarray", "Implicit conversion to a NumPy array"),
    ("SecretTolist", r"\.tolist\(\) of a device array inside kernel test\.strict::SecretTolist"),
    ("SecretHostMix", "Unsupported type <class 'numpy.ndarray'>"),
])
def test_secret_host_conversion_is_caught_on_strict_sim_gpu(op, caught):
    _register_test_kernels()
    m = _model(op)
    want = _feed()["x"] * 2
    np.testing.assert_array_equal(InferenceSession(m, ["cpu"]).run(None, _feed())[0], want)
    lenient = InferenceSession(m, [("sim-gpu", {"strict": False})], require_gpu=True)
    np.testing.assert_array_equal(lenient.run(None, _feed())[0], want)  # plain NumPy: unseen
    sess = InferenceSession(m, ["sim-gpu"], require_gpu=True)
    with pytest.raises(KernelError, match=caught) as ei:
        sess.run(None, _feed())
    assert f"{DOMAIN}::{op}" in str(ei.value) and "sim-gpu:0" in str(ei.value)


def test_undeclared_host_input_is_caught_and_a_declared_one_is_moved_by_the_plan():
    _register_test_kernels()
    want = _feed()["x"].reshape(3, 2)
    sess = InferenceSession(_model("UndeclaredShape", True), ["sim-gpu"], require_gpu=True)
    with pytest.raises(KernelError, match=r"\.get\(\) of a device array inside kernel "
                                          r"test\.strict::UndeclaredShape.*host_inputs"):
        sess.run(None, _feed(True))
    sess = InferenceSession(_model("DeclaredShape", True), ["sim-gpu"], require_gpu=True)
    prov = sess._build.providers[0]
    h0 = prov.bytes_to_host
    np.testing.assert_array_equal(sess.run(None, _feed(True))[0], want)
    assert prov.bytes_to_host - h0 == 16 + want.nbytes  # the shape (moved by the plan) + y


def test_honest_kernel_runs_on_strict_sim_gpu():
    _register_test_kernels()
    sess = InferenceSession(_model("Honest"), ["sim-gpu"], require_gpu=True)
    np.testing.assert_array_equal(sess.run(None, _feed())[0], _feed()["x"] * 2)


# --- products ------------------------------------------------------------------------------

_EQUAL_ROWS = r"""
import json, logging
import numpy as np
from threadpoolctl import threadpool_info
from hetero_exec.providers import parse_provider
from hetero_exec.providers import sim_array as sa
from tests.model_suites import CASES, run_model_case

arch = [i.get("architecture") for i in threadpool_info() if i["internal_api"] == "openblas"]
rng = np.random.default_rng(0)
W = np.full((1000, 512), 0.02, np.float32)  # 1000 equal rows, as squeezenet's conv10
X = (rng.random((512, 169), np.float32) * 1e6).astype(np.float32)
dev = parse_provider("sim-gpu")


def distinct(Y):
    return max(len(np.unique(Y[:, j])) for j in range(Y.shape[1]))


Y = dev.to_host(sa.SIM_CUPY.matmul(dev.to_device(W), dev.to_device(X)))
logging.disable(logging.WARNING)
try:
    run_model_case(CASES["real/test_squeezenet"], providers=[("sim-gpu", {"exclude_ops": ["Relu"]}),
                                                             "cpu"], hetero=True)
    squeezenet = "passed"
except AssertionError as e:
    squeezenet = str(e)[:200]
print(json.dumps({"arch": arch, "numpy": distinct(W @ X), "sim": distinct(Y),
                  "error": float(np.abs(Y - (W.astype(np.float64) @ X).astype(np.float32)).max()),
                  "squeezenet": squeezenet}))
"""


def test_equal_rows_give_equal_products_whatever_the_hosts_blas():
    """OpenBLAS's Haswell/Zen sgemm kernels round equal rows of a product differently; a
    GPU's do not, and sim-gpu's products must not either: light squeezenet's 1000 equal
    logits (~9.5e9) came out unequal on such hosts, its softmax one-hot, not uniform.
    Run with those kernels forced (OPENBLAS_CORETYPE), in a subprocess."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", _EQUAL_ROWS], env=env, capture_output=True,
                         text=True, timeout=120, check=True, cwd=root)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["arch"] != ["Haswell"]:
        pytest.skip(f"numpy's OpenBLAS does not run its Haswell kernels here: {got['arch']}")
    assert got["numpy"] > 1, got  # the host's own product: what makes this test able to fail
    assert got["sim"] == 1 and got["error"] == 0.0, got
    assert got["squeezenet"] == "passed", got
