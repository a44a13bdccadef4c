"""The msgpack wire format as a network input: every malformed frame is a
WireFormatError, nothing else (pure: no Ray)."""

from __future__ import annotations

import ml_dtypes
import msgpack
import numpy as np
import pytest

from actors.transport.wire import (
    WireFormatError,
    decode_request,
    decode_response,
    decode_tensor,
    decode_tensors,
    encode_request,
    encode_response,
    encode_tensor,
    encode_tensors,
    tensor_from_list,
    tensor_to_list,
)


def _frame(**fields):
    base = {"v": 1, "dtype": "float32", "shape": [2], "data": np.ones(2, np.float32).tobytes()}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...}, use_bin_type=True)


@pytest.mark.parametrize("frame, says", [
    (_frame(shape=[-1]), "non-negative"),
    (_frame(shape=[3]), "needs 12 bytes"),
    (_frame(shape=[True, 2]), "non-negative integers"),
    (_frame(shape="2"), "list of at most"),
    (_frame(shape=[1] * 65), "list of at most"),
    (_frame(dtype="object"), "unknown dtype 'object'"),
    (_frame(dtype=">f4"), "unknown dtype '>f4'"),
    (_frame(dtype="float33"), "unknown dtype"),
    (_frame(dtype=7), "dtype must be a string"),
    (_frame(data="text"), "not bytes"),
    (_frame(data=...), "fields"),
    (_frame(extra=1), "fields"),
    (_frame(v=2), "version 2"),
    (_frame(v=True), "version True"),
    (_frame(dtype="string", data=..., items=[b"\xff"], shape=[1]), "not UTF-8"),
    (_frame(dtype="string", data=..., items=[b"a"], shape=[2]), "needs 2 items"),
    (_frame(dtype="string", data=..., items=["a"], shape=[1]), "not bytes"),
    (msgpack.packb([1, 2]), "is a map"),
    (encode_tensor(np.ones(2)) + b"\x00", "extra data"),
    (encode_tensor(np.ones(2))[:-3], "not a msgpack frame"),
    (b"\x81\xa1v\x01\x81", "not a msgpack frame"),  # truncated inside a map
    (b"\x82\xa1v\x01\xa1v\x01", "duplicate key 'v'"),
    (msgpack.packb({1: 2}), "not a msgpack frame"),  # integer map key
    (b"\x91" * 5000, "not a msgpack frame"),  # nesting deeper than the unpacker allows
    (b"", "not a msgpack frame"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_tensor_frames_name_what_is_wrong(frame, says):
    with pytest.raises(WireFormatError, match=None) as e:
        decode_tensor(frame)
    assert says in str(e.value)


@pytest.mark.parametrize("arr", [np.arange(6, dtype=np.float32).reshape(2, 3),
                                 np.array(7, dtype=np.int64), np.zeros((0, 4), np.int8),
                                 np.ones((1, 1, 2), bool),
                                 np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16),
                                 np.arange(4, dtype=">i4")],
                         ids=["f32", "scalar", "empty", "bool", "bf16", "big-endian"])
def test_compact_tensors_round_trip(arr):
    got = tensor_from_list(msgpack.unpackb(msgpack.packb(tensor_to_list(arr))))
    assert got.shape == arr.shape and got.dtype == arr.dtype.newbyteorder("=")
    assert np.array_equal(got.astype(np.float64), arr.astype(np.float64))


_F32 = np.ones(2, np.float32).tobytes()


@pytest.mark.parametrize("value, says", [
    ({"dtype": "float32"}, "[dtype, shape, data]"),
    (["float32", [2]], "[dtype, shape, data]"),
    (["object", [2], _F32], "unknown dtype 'object'"),
    ([7, [2], _F32], "dtype must be a string"),
    (["float32", [-1], _F32], "non-negative"),
    (["float32", [True, 2], _F32], "non-negative"),
    (["float32", "2", _F32], "list of at most"),
    (["float32", [1] * 65, _F32], "list of at most"),
    (["float32", [3], _F32], "needs 12 bytes of data, got 8"),
    (["float32", [2], "text"], "str, not bytes"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_malformed_compact_tensors_name_what_is_wrong(value, says):
    with pytest.raises(WireFormatError) as e:
        tensor_from_list(value)
    assert says in str(e.value)


def test_a_compact_tensor_is_numeric():
    with pytest.raises(WireFormatError, match="numeric"):
        tensor_to_list(np.array(["a"]))


def test_frame_over_the_limit_is_refused_before_it_is_read():
    frame = encode_tensor(np.zeros(1000, np.float32))
    with pytest.raises(WireFormatError, match="exceeds the limit of 100 bytes"):
        decode_tensor(frame, max_bytes=100)
    assert decode_tensor(frame, max_bytes=len(frame)).shape == (1000,)


def _mutate(rng: np.random.Generator, frame: bytes) -> bytes:
    b = bytearray(frame)
    kind = rng.integers(6)
    if kind == 0:  # flip a few bits
        for _ in range(rng.integers(1, 4)):
            i = rng.integers(len(b))
            b[i] ^= 1 << int(rng.integers(8))
    elif kind == 1:  # overwrite a byte with a random one
        b[rng.integers(len(b))] = int(rng.integers(256))
    elif kind == 2:  # truncate
        b = b[: rng.integers(len(b))]
    elif kind == 3:  # insert random bytes
        i = rng.integers(len(b) + 1)
        b[i:i] = rng.integers(0, 256, rng.integers(1, 6), dtype=np.uint8).tobytes()
    elif kind == 4:  # delete a slice
        i = rng.integers(len(b))
        del b[i: i + int(rng.integers(1, 6))]
    else:  # replace a type-tag-looking byte with msgpack's interesting ones
        b[rng.integers(len(b))] = int(rng.choice([0xC0, 0xC1, 0xC2, 0xC4, 0xD9, 0xDC, 0xDE,
                                                   0xFF, 0x80, 0x90, 0xA0, 0xD0]))
    return bytes(b)


SEEDS = {
    "f32": encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3)),
    "i64": encode_tensor(np.array([-1, 5], np.int64)),
    "bf16": encode_tensor(np.ones(3, np.float32).astype(ml_dtypes.bfloat16)),
    "str": encode_tensor(np.array(["ab", "héllo"], dtype=object)),
    "named": encode_tensors({"x": np.ones((1, 2), np.float32), "ids": np.zeros(2, np.int32)}),
    "request": encode_request({"x": np.ones(2, np.float32)}, ["y"], id="r"),
    "response": encode_response({"y": np.ones(2, np.float16)}, "m"),
}
DECODERS = {"f32": decode_tensor, "i64": decode_tensor, "bf16": decode_tensor,
            "str": decode_tensor, "named": decode_tensors, "request": decode_request,
            "response": decode_response}


def _consistent(value) -> bool:
    """A frame that survived mutation still decodes to well-formed arrays."""
    arrays = value.tensors.values() if hasattr(value, "tensors") else (
        value.values() if isinstance(value, dict) else [value])
    return all(isinstance(a, np.ndarray) and a.size == int(np.prod(a.shape)) for a in arrays)


@pytest.mark.parametrize("seed_name", sorted(SEEDS))
def test_fuzzed_frames_raise_only_wire_format_errors(seed_name):
    """100 random mutations of each seed frame (700 in all): each decodes to a
    consistent value or raises WireFormatError; no other exception escapes."""
    rng = np.random.default_rng(sum(map(ord, seed_name)))
    frame, decode = SEEDS[seed_name], DECODERS[seed_name]
    refused = 0
    for i in range(100):
        mutated = _mutate(rng, frame)
        try:
            value = decode(mutated)
        except WireFormatError:
            refused += 1
            continue
        except Exception as e:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"mutation {i} ({mutated!r:.120}) raised {type(e).__name__}: {e}")
        assert _consistent(value), f"mutation {i} decoded to an inconsistent value"
    assert refused >= 30, f"only {refused} of 100 mutations were refused"


def test_requests_and_responses_roundtrip_and_refuse_bad_fields():
    msg = decode_request(encode_request({"x": np.ones((2, 2), np.float32)}))
    assert msg.outputs is None and msg.tensors["x"].shape == (2, 2)
    resp = decode_response(encode_response({"y": np.arange(3)}, "m", id="7"))
    assert (resp.model_name, resp.id, resp.tensors["y"].tolist()) == ("m", "7", [0, 1, 2])
    bad = [
        ({"v": 1}, "no 'inputs'"),
        ({"v": 1, "inputs": {}, "extra": 1}, "unknown field(s) ['extra']"),
        ({"v": 1, "inputs": {"": msgpack.unpackb(encode_tensor(np.ones(1)))}}, "non-empty"),
        ({"v": 1, "inputs": {}, "outputs": "y"}, "list of output names"),
        ({"v": 1, "inputs": {}, "outputs": ["y", "y"]}, "names an output twice"),
        ({"v": 1, "inputs": {}, "id": 3}, "'id' must be a string"),
        ({"v": 1, "inputs": {"x": {"v": 1}}}, "inputs 'x': tensor frame fields"),
    ]
    for body, says in bad:
        with pytest.raises(WireFormatError) as e:
            decode_request(msgpack.packb(body, use_bin_type=True))
        assert says in str(e.value), (body, str(e.value))
    pairs = msgpack.packb({"v": 1, "inputs": {"x": 1}}, use_bin_type=True)
    # a map with the input name twice: msgpack allows it, the decoder must not
    twice = pairs.replace(b"\x81\xa1x\x01", b"\x82\xa1x\x01\xa1x\x01")
    with pytest.raises(WireFormatError, match="duplicate key 'x'"):
        decode_request(twice)
