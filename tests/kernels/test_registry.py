"""The kernel table: duplicate refusal, opset -> schema since_version resolution,
module imports, the tuple-return convention, node-suite coverage."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import sys

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import helper

import hetero_exec.kernels as kernels_pkg
from hetero_exec.kernels import registry
from hetero_exec.kernels.registry import (
    DuplicateKernelError,
    KernelDef,
    has_op,
    kernel,
    lookup,
    registered,
)
from tests.kernels._ref import reference

TEST_DOMAIN = "test.hetero_exec.registry"


@pytest.fixture
def clean_test_domain():
    registered()  # load the real table first
    yield
    for key in [k for k in registry._TABLE if k[0] == TEST_DOMAIN]:
        del registry._TABLE[key]


# --- the decorator ---------------------------------------------------------------------


def test_decorator_refuses_duplicates(clean_test_domain):
    @kernel("Dup", since=1, domain=TEST_DOMAIN)
    def first(xp, x):
        return (x,)

    @kernel("Dup", since=3, domain=TEST_DOMAIN)
    def newer(xp, x):
        return (x + 1,)

    with pytest.raises(DuplicateKernelError) as ei:
        @kernel("Dup", since=1, domain=TEST_DOMAIN)
        def again(xp, x):
            return (x,)
    assert "Dup" in str(ei.value) and "1" in str(ei.value)
    assert lookup(TEST_DOMAIN, "Dup", 1).fn is first
    assert lookup(TEST_DOMAIN, "Dup", 2).fn is first
    assert lookup(TEST_DOMAIN, "Dup", 5).fn is newer


def test_refused_registration_leaves_the_table_unchanged(clean_test_domain):
    @kernel("Dup", since=4, domain=TEST_DOMAIN)
    def original(xp, x):
        return (x,)

    before = dict(registry._TABLE[(TEST_DOMAIN, "Dup")])
    with pytest.raises(DuplicateKernelError):
        @kernel("Dup", since=(2, 4, 9), domain=TEST_DOMAIN)
        def clash(xp, x):
            return (x,)
    assert registry._TABLE[(TEST_DOMAIN, "Dup")] == before
    assert lookup(TEST_DOMAIN, "Dup", 9).fn is original
    assert lookup(TEST_DOMAIN, "Dup", 2) is None
    with pytest.raises(DuplicateKernelError):  # the same since twice in one decorator
        kernel("Fresh", since=(5, 5), domain=TEST_DOMAIN)(lambda xp, x: (x,))
    assert (TEST_DOMAIN, "Fresh") not in registry._TABLE


def test_decorator_refuses_a_real_kernels_key():
    kdef = lookup("", "Relu", 14)
    with pytest.raises(DuplicateKernelError):
        kernel("Relu", since=kdef.since)(lambda xp, x: (x,))
    with pytest.raises(DuplicateKernelError):  # "ai.onnx" is the default domain too
        kernel("Relu", since=kdef.since, domain="ai.onnx")(lambda xp, x: (x,))
    assert lookup("", "Relu", 14) is kdef


def test_decorator_records_context_params_and_attrs(clean_test_domain):
    @kernel("Ctx", domain=TEST_DOMAIN, host_inputs=(1,))
    def ctx(xp, x, shape=None, *, axis=0, num_outputs, opset):
        return (x,)

    kdef = lookup(TEST_DOMAIN, "Ctx", 1)
    assert kdef.wants == frozenset({"num_outputs", "opset"})
    # attribute names: keyword parameters (an input may double as an old opset's attribute)
    assert {"shape", "axis"} <= kdef.attrs and not kdef.attrs & {"num_outputs", "opset"}
    assert kdef.host_inputs == frozenset({1})


# --- lookup: model opset -> schema since_version ---------------------------------------------


def _fake(op: str, since: int) -> KernelDef:
    return KernelDef("", op, since, lambda xp, *a: a)


def test_kernel_at_since_1_serves_opset_14_relu(monkeypatch):
    registered()
    k1 = _fake("Relu", 1)
    monkeypatch.setitem(registry._TABLE, ("", "Relu"), {1: k1})
    for opset in (1, 6, 13, 14, 21):
        assert lookup("", "Relu", opset) is k1
        assert lookup("ai.onnx", "Relu", opset) is k1


def test_lookup_goes_through_the_schema_since_version(monkeypatch):
    registered()
    # Add's schema versions: 1, 6, 7, 13, 14
    assert onnx.defs.get_schema("Add", 15, "").since_version == 14
    k7, k15 = _fake("Add", 7), _fake("Add", 15)
    monkeypatch.setitem(registry._TABLE, ("", "Add"), {7: k7, 15: k15})
    assert lookup("", "Add", 6) is None  # nothing at or below since 6
    assert lookup("", "Add", 13) is k7
    # a model at opset 15 runs Add-14: a kernel "since 15" is newer than that schema
    assert lookup("", "Add", 15) is k7
    k14 = _fake("Add", 14)
    monkeypatch.setitem(registry._TABLE, ("", "Add"), {7: k7, 14: k14})
    assert lookup("", "Add", 13) is k7
    assert lookup("", "Add", 14) is k14 and lookup("", "Add", 21) is k14


def test_real_table_resolution():
    for op, opset in [("Relu", 14), ("Add", 14), ("Split", 18), ("Softmax", 13), ("Cast", 21)]:
        kdef = lookup("", op, opset)
        assert kdef is not None, op
        schema_since = onnx.defs.get_schema(op, opset, "").since_version
        sinces = [k.since for k in registered() if k.domain == "" and k.op_type == op]
        assert kdef.since == max(s for s in sinces if s <= schema_since)
    assert lookup("", "NoSuchOp", 18) is None
    assert lookup("com.example", "Relu", 1) is None


# --- modules --------------------------------------------------------------------------------


def _kernel_modules() -> list[str]:
    # the files; a subpackage holds what kernels call (native: the compiled fast paths)
    return [f"{kernels_pkg.__name__}.{m.name}" for m in pkgutil.iter_modules(kernels_pkg.__path__)
            if not m.name.startswith("_") and m.name != "registry" and not m.ispkg]


def test_every_kernel_module_imports_and_registers():
    modules = _kernel_modules()
    assert len(modules) >= 15
    for name in modules:
        importlib.import_module(name)  # raises if the module is broken
    by_module = {k.fn.__module__ for k in registered()}
    assert set(modules) <= by_module, sorted(set(modules) - by_module)
    for mod in by_module:
        assert mod in sys.modules, mod
        importlib.import_module(mod)


def test_every_registered_kernel_is_callable_with_xp_first():
    import inspect

    for k in registered():
        params = list(inspect.signature(k.fn).parameters)
        assert params and params[0] == "xp", (k.key, params)


# --- the tuple convention -----------------------------------------------------------------------

R = np.random.default_rng(11)
A = R.standard_normal((2, 3, 4)).astype(np.float32)
B = R.standard_normal((2, 3, 4)).astype(np.float32)

SAMPLES = [
    ("Relu", [A], {}, 1),
    ("Add", [A, B], {}, 1),
    ("Transpose", [A], {"perm": [2, 0, 1]}, 1),
    ("Split", [A, np.array([1, 3], np.int64)], {"axis": 2}, 2),
    ("Shape", [A], {}, 1),
    ("ReduceSum", [A, np.array([1], np.int64)], {"keepdims": 0}, 1),
    ("Concat", [A, B], {"axis": 1}, 1),
    ("Softmax", [A], {"axis": -1}, 1),
    ("Cast", [A], {"to": onnx.TensorProto.INT32}, 1),
    ("TopK", [A, np.array([2], np.int64)], {"axis": -1}, 2),
    ("Where", [A > 0, A, B], {}, 1),
    ("MatMul", [A, B.transpose(0, 2, 1)], {}, 1),
    ("Identity", [A], {}, 1),
    ("Unsqueeze", [A, np.array([0], np.int64)], {}, 1),
]


@pytest.mark.parametrize("op,inputs,attrs,n_out", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_kernels_return_tuples(op, inputs, attrs, n_out):
    opset = 18
    kdef = lookup("", op, opset)
    assert kdef is not None
    extra = {}
    if "num_outputs" in kdef.wants:
        extra["num_outputs"] = n_out
    if "opset" in kdef.wants:
        extra["opset"] = kdef.since
    out = kdef.fn(np, *inputs, **attrs, **extra)
    assert type(out) is tuple, type(out)
    assert len(out) == n_out
    want = reference(op, inputs, opset=opset, n_outputs=n_out, **attrs)
    for got, ref in zip(out, want):
        got = np.asarray(got)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# --- node-suite coverage -------------------------------------------------------------------------

_TEXT_OP = re.compile(r"\b([A-Z][A-Za-z0-9]*)\s*[(<]")


def _schemas() -> dict[tuple[str, str], list]:
    out: dict[tuple[str, str], list] = {}
    for s in onnx.defs.get_all_schemas_with_history():
        out.setdefault((s.domain, s.name), []).append(s)
    return out


def _walk_nodes(nodes):
    for n in nodes:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(a.g.node)


def _body_ops(schema) -> set[tuple[str, str]]:
    """Ops used by the schema's function bodies (what the *_expanded cases run)."""
    fps = []
    for v in schema.function_opset_versions:
        fp = onnx.FunctionProto()
        fp.ParseFromString(schema.get_function_with_opset_version(v))
        fps.append(fp)
    if schema.context_dependent_function_opset_versions:
        attrs = {}
        for name, a in schema.attributes.items():
            if a.required and a.type == onnx.AttributeProto.GRAPH:  # e.g. SequenceMap's body
                attrs[name] = helper.make_graph(
                    [helper.make_node("Identity", ["b_in"], ["b_out"])], "b",
                    [helper.make_tensor_value_info("b_in", onnx.TensorProto.FLOAT, None)],
                    [helper.make_tensor_value_info("b_out", onnx.TensorProto.FLOAT, None)])
        tensor = helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)
        for n_in in {1, len(schema.inputs)}:
            node = helper.make_node(schema.name, [f"i{k}" for k in range(n_in)],
                                    [f"o{k}" for k in range(len(schema.outputs))], domain=schema.domain, **attrs)
            for tp in (tensor, helper.make_sequence_type_proto(tensor)):
                for v in schema.context_dependent_function_opset_versions:
                    try:
                        data = schema.get_context_dependent_function_with_opset_version(
                            v, node.SerializeToString(), [tp.SerializeToString()] * n_in)
                    except Exception:  # noqa: BLE001 - not every type fits every op
                        continue
                    fp = onnx.FunctionProto()
                    fp.ParseFromString(data)
                    fps.append(fp)
    return {("" if n.domain == "ai.onnx" else n.domain, n.op_type) for fp in fps for n in _walk_nodes(fp.node)}


def node_suite_ops() -> set[tuple[str, str]]:
    """(domain, op_type) of every op the ONNX backend node suite builds, read from the
    source of onnx's case definitions (make_node("Op", ...) and ONNX-text bodies), plus
    the ops of those ops' function bodies. (Building the 1884 cases themselves takes
    far longer than this whole file may.)"""
    import onnx.backend.test.case.node as node_cases

    schemas = _schemas()
    names: dict[str, set[str]] = {}
    for domain, name in schemas:
        names.setdefault(name, set()).add(domain)
    found: set[tuple[str, str]] = set()
    root = os.path.dirname(node_cases.__file__)
    for folder, _, files in os.walk(root):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            with open(os.path.join(folder, fn)) as f:
                tree = ast.parse(f.read())
            for c in ast.walk(tree):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    hits = {c.value} if c.value in names else {m for m in _TEXT_OP.findall(c.value) if m in names}
                    for name in hits:
                        found.update((d, name) for d in names[name])
    todo = list(found)
    while todo:
        key = todo.pop()
        for schema in schemas.get(key, []):
            for op in _body_ops(schema):
                if op not in found:
                    found.add(op)
                    todo.append(op)
    return found


def _has_function_body(domain: str, op: str) -> bool:
    return any(s.function_opset_versions or s.context_dependent_function_opset_versions
               for s in _schemas().get((domain, op), []))


def test_every_node_suite_op_has_a_kernel_or_a_function_body():
    ops = node_suite_ops()
    # the scan really sees the suite: known ops of every kind are in it
    for expected in [("", "Conv"), ("", "Scan"), ("", "Loop"), ("", "SequenceAt"), ("", "SequenceEmpty"),
                     ("", "RandomUniformLike"), ("", "StringNormalizer"), ("ai.onnx.ml", "LabelEncoder"),
                     ("ai.onnx.preview.training", "Adam")]:
        assert expected in ops, expected
    assert len(ops) >= 190
    missing = sorted(f"{d or 'ai.onnx'}::{op}" for d, op in ops
                     if not has_op(d, op) and not _has_function_body(d, op))
    assert not missing, missing
