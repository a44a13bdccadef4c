"""The stage ring's frames (actors/generation/channel.py, inbox.py) with continuous
batching's fields and a group's spec: a step frame's joins and spec, a group's close or
halt and a token frame's acknowledgements round-trip, and a malformed one is refused with
WireFormatError naming the field (the receiving stage, or the driver, then drops that
connection only: tests/ray/test_genai_ray.py)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from actors.generation.channel import (
    _HEADER,
    decode_frame,
    decode_step,
    encode_close,
    encode_halt,
    encode_join,
    encode_step,
)
from actors.generation.group import GroupSpec, Job, Join
from actors.generation.inbox import decode_column, encode_column
from actors.transport.wire import WireFormatError, tensor_to_list


def _job() -> Job:
    join = Join(1, "req-1", np.array([5, 6, 7], dtype=np.int64), 9, epoch=2, at=14, ok=True,
                seed=123)
    return Job(14, np.array([[3], [4]], dtype=np.int64), [(14, 15)], joins=[join])


def test_a_step_frame_carries_its_joins_and_their_prefill_values():
    hidden = {"h": np.ones((1, 2, 4), np.float32)}
    frame = encode_step("g", 2, _job(), [{"h": np.zeros((2, 1, 4), np.float32)}, hidden])
    gid, epoch, job, carried = decode_step(frame[_HEADER.size:])
    assert (gid, epoch, job.at, job.pieces) == ("g", 2, 14, [(14, 15)])
    [j] = job.joins
    assert (j.row, j.key, j.prompt.tolist(), j.max_new, j.epoch, j.at, j.ok, j.seed) == \
        (1, "req-1", [5, 6, 7], 9, 2, 14, True, 123)
    assert len(carried) == 2 and carried[1]["h"].shape == (1, 2, 4)


def test_a_first_step_frame_carries_its_group_spec():
    spec = GroupSpec(2, 40, 0, np.array([0, 3], np.int64), {"max_length": 40, "top_p": 0.9,
                                                             "do_sample": True, "min_length": None},
                     (2, 7), ("node", "\0inbox"), batched=True, row_seeds=((5, 12), (9, 14)),
                     row_stops=(20, -1))
    job = Job(0, np.array([[3], [4]], dtype=np.int64), [(0, 1)], spec=spec, rows=1)
    _, _, got, _ = decode_step(encode_step("g", 1, job, [{}])[_HEADER.size:])
    assert got.spec.start.tolist() == [0, 3]
    assert (got.spec.batch, got.spec.capacity, got.spec.pad, got.spec.search, got.spec.eos,
            got.spec.inbox, got.spec.batched, got.spec.row_seeds, got.spec.row_stops,
            got.rows) == \
        (2, 40, 0, spec.search, (2, 7), ("node", "\0inbox"), True, ((5, 12), (9, 14)),
         (20, -1), 1)
    plain = decode_step(encode_step("g", 2, _job(), [{}, {}])[_HEADER.size:])[2]
    assert plain.spec is None and plain.rows is None


def _step_body(joins, spec=None, rows=None) -> bytes:
    ids = tensor_to_list(np.array([[3]], dtype=np.int64))
    return msgpack.packb(["g", 1, 5, ids, [[5, 6]], None, None, None, None, [{}], False, joins,
                          spec, rows], use_bin_type=True)


def _spec_fields(**change) -> list:
    fields = {"batch": 1, "capacity": 9, "pad": 0, "start": tensor_to_list(np.zeros(1, np.int64)),
              "search": {"max_length": 9}, "eos": [2], "inbox": None, "batched": False,
              "row_seeds": None, "row_stops": None}
    fields.update(change)
    return list(fields.values())


@pytest.mark.parametrize("spec, words", [
    ([1, 9, 0], "a group spec is"),
    (_spec_fields(search={"max_length": [9]}), "search options are a map"),
    (_spec_fields(eos="2"), "eos, inbox or batched"),
    (_spec_fields(inbox=["node"]), "eos, inbox or batched"),
    (_spec_fields(start=tensor_to_list(np.zeros(1, np.float32))), "start must be int64"),
    (_spec_fields(capacity=9.5), "spec capacity"),
    (_spec_fields(row_seeds=[[1]]), "spec row seed"),
    (_spec_fields(row_stops=[3, 4]), "row_stops must be a list of ints, one a row"),
    (_spec_fields(row_stops=[3.5]), "spec row stop"),
])
def test_a_malformed_group_spec_is_refused_naming_it(spec, words):
    with pytest.raises(WireFormatError, match=words):
        decode_step(_step_body([], spec))


@pytest.mark.parametrize("joins, words", [
    ("x", "joins of the wrong type"),
    ([[1, "k", tensor_to_list(np.array([5], np.int64)), 3, 0, 5, True]], "a join is"),
    ([[1, 2, tensor_to_list(np.array([5], np.int64)), 3, 0, 5, True, -1]], "a join is"),
    ([[1, "k", tensor_to_list(np.array([5.0], np.float32)), 3, 0, 5, True, -1]],
     "prompt must be int64"),
    ([[1, "k", tensor_to_list(np.array([5], np.int64)), 3.5, 0, 5, True, -1]], "join max_new"),
    ([[1, "k", tensor_to_list(np.array([5], np.int64)), 3, 0, 5, True, "7"]], "join seed"),
])
def test_a_malformed_join_is_refused_naming_it(joins, words):
    with pytest.raises(WireFormatError, match=words):
        decode_step(_step_body(joins))


def test_a_step_frame_with_rows_not_an_int_is_refused():
    with pytest.raises(WireFormatError, match="rows must be an int"):
        decode_step(_step_body([], rows="2"))


def test_a_join_frame_from_the_driver_round_trips_and_a_bad_one_is_refused():
    join = Join(2, "req-9", np.array([4, 5], dtype=np.int64), 7, epoch=3, seed=11)
    kind, (gid, got) = decode_frame(encode_join("g", join)[_HEADER.size:])
    assert (kind, gid, got.row, got.key, got.prompt.tolist(), got.max_new, got.epoch,
            got.seed) == ("join", "g", 2, "req-9", [4, 5], 7, 3, 11)
    assert decode_frame(encode_step("g", 2, _job(), [{}, {}])[_HEADER.size:])[0] == "step"
    with pytest.raises(WireFormatError, match="a join is"):
        decode_frame(msgpack.packb(["join", "g", [2, "k"]], use_bin_type=True))
    with pytest.raises(WireFormatError, match="group id must be a string"):
        decode_frame(msgpack.packb(["join", 5, []], use_bin_type=True))
    with pytest.raises(WireFormatError, match="a step frame is a list of 14"):
        decode_frame(msgpack.packb(["leave", "g", []], use_bin_type=True))


def test_a_close_frame_round_trips_and_a_bad_one_is_refused():
    # the driver's (closed for good: no epoch) and the last stage's (the epoch it ended)
    assert decode_frame(encode_close("g", None, 1)[_HEADER.size:]) == ("close", ("g", None, 1))
    assert decode_frame(encode_close("g", 7, 0)[_HEADER.size:]) == ("close", ("g", 7, 0))
    for bad in (["close", 5, None, 1], ["close", "g", 1.5, 1], ["close", "g", None, "1"],
                ["close", "g", True, 1]):
        with pytest.raises(WireFormatError, match="close frame"):
            decode_frame(msgpack.packb(bad, use_bin_type=True))


def test_a_halt_frame_round_trips_and_a_bad_one_is_refused():
    assert decode_frame(encode_halt("g", 4, 1)[_HEADER.size:]) == ("halt", ("g", 4, 1))
    for bad in (["halt", 5, 4, 1], ["halt", "g", None, 1], ["halt", "g", 4, 1.0],
                ["halt", "g", True, 1]):
        with pytest.raises(WireFormatError, match="halt frame"):
            decode_frame(msgpack.packb(bad, use_bin_type=True))


def test_carried_maps_must_match_the_pieces_and_joins():
    ids = tensor_to_list(np.array([[3]], dtype=np.int64))
    body = msgpack.packb(["g", 1, 5, ids, [[5, 6]], None, None, None, None, [{}, {}, {}], False,
                          [], None, None], use_bin_type=True)
    with pytest.raises(WireFormatError, match="3 carried maps for 1 pieces and 0 joins"):
        decode_step(body)


def test_a_token_frame_carries_the_acks_of_its_column():
    frame = encode_column(3, 15, np.array([[7], [8]], np.int64), False,
                          [(15, "req-1", 1, True), (15, "req-2", 0, False)])
    epoch, at, ids, done, acks = decode_column(frame[_HEADER.size:])
    assert (epoch, at, ids.tolist(), done) == (3, 15, [[7], [8]], False)
    assert acks == [(15, "req-1", 1, True), (15, "req-2", 0, False)]
    bad = msgpack.packb([3, 15, tensor_to_list(np.array([[7]], np.int64)), False, [[15, "k", 1]]],
                        use_bin_type=True)
    with pytest.raises(WireFormatError, match="an ack is"):
        decode_column(bad)
