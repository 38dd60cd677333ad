"""Wire format: round trips, every validation path of ``decode``, and fuzzing that only ProtocolError escapes.

Pure: no sockets. ``zmq.Frame`` objects are built in memory to check that payload chunks view the frames.
"""

from __future__ import annotations

import math
from itertools import pairwise

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gossip.errors import ProtocolError
from gossip.flat import FlatParams
from gossip.net.wire import (
    DTYPES,
    MAX_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    MAX_INT,
    PROTOCOL_VERSION,
    Header,
    Layout,
    Message,
    decode,
    encode,
    params_header,
)

WORLD = 4
CHUNK = 256  # small, so that every test model travels as several frames
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_layout(*segments: tuple[str, int], chunk_bytes: int = 0) -> Layout:
    """A layout of one flat parameter per (dtype, numel) segment."""
    entries = [(f"p{i}", (numel,), dtype) for i, (dtype, numel) in enumerate(segments)]
    return Layout.describe(entries, [d for d, _ in segments], [n for _, n in segments], chunk_bytes)


def make_chunks(layout: Layout, chunk_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(stop - start, generator=generator).to(DTYPES[layout.dtypes[segment]])
            for segment, start, stop in layout.frame_plan(chunk_bytes)]


TWO_SEGMENTS = make_layout(("float32", 100), ("float64", 37))


def valid_frames(layout: Layout = TWO_SEGMENTS, chunk_bytes: int = CHUNK, **fields) -> list:
    header = params_header("params", 1, layout, chunk_bytes, **fields)
    return encode(header, make_chunks(layout, chunk_bytes))


def with_header(frames: list, drop: tuple[str, ...] = (), **changes) -> list:
    """``frames`` with the header map re-packed after setting ``changes`` and deleting ``drop``."""
    obj = msgpack.unpackb(frames[0])
    obj.update(changes)
    for key in drop:
        del obj[key]
    return [msgpack.packb(obj), *frames[1:]]


def reason_of(frames, layout: Layout = TWO_SEGMENTS, world_size: int = WORLD) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(frames, layout, world_size)
    return info.value.reason


def attempt(frames, layout: Layout = TWO_SEGMENTS) -> Message | None:
    """Decode; a ProtocolError is a fine outcome, anything else propagates and fails the test."""
    try:
        message = decode(frames, layout, WORLD)
    except ProtocolError:
        return None
    assert isinstance(message, Message)
    return message


# --- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_trip_of_a_model_in_each_dtype(dtype):
    torch.manual_seed(0)
    flat = FlatParams(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype), CHUNK)
    header = params_header("params", 2, flat.layout, flat.chunk_bytes, round=3, step=7, samples=96, speed=12.5,
                           weight=0.25)
    snapshot = flat.snapshot()
    assert len(snapshot) > 1  # several frames at this chunk size

    message = decode(encode(header, snapshot), flat.layout, WORLD)

    assert message.header == header
    assert (message.header.round, message.header.step, message.header.samples) == (3, 7, 96)
    assert (message.header.speed, message.header.weight) == (12.5, 0.25)
    assert message.nbytes == flat.layout.total_bytes == flat.numel * dtype.itemsize
    assert len(message.chunks) == len(snapshot)
    for got, sent in zip(message.chunks, snapshot):
        assert got.dtype == dtype and torch.equal(got, sent)


def test_round_trip_of_a_model_with_two_dtypes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5).double())
    flat = FlatParams(model, CHUNK)
    assert flat.layout.dtypes == ("float32", "float64")
    header = params_header("params", 0, flat.layout, flat.chunk_bytes)
    message = decode(encode(header, flat.snapshot()), flat.layout, WORLD)

    assert message.header.segments == (("float32", 220 * 4), ("float64", 105 * 8))
    for segment, dtype in enumerate((torch.float32, torch.float64)):
        parts = [chunk for chunk, (s, _, _) in zip(message.chunks, flat.plan) if s == segment]
        assert all(part.dtype == dtype for part in parts)
        assert torch.equal(torch.cat(parts), flat.segments[segment])


def test_frame_plan_covers_every_element_once_in_order():
    layout = make_layout(("float32", 1000), ("float16", 333), ("float64", 65))
    plan = layout.frame_plan(CHUNK)
    for segment, dtype in enumerate(layout.dtypes):
        rows = [(start, stop) for s, start, stop in plan if s == segment]
        assert rows[0][0] == 0 and rows[-1][1] == layout.numels[segment]
        assert all(prev_stop == start for (_, prev_stop), (start, _) in pairwise(rows))
        assert all(0 < (stop - start) * DTYPES[dtype].itemsize <= CHUNK for start, stop in rows)
    assert [s for s, _, _ in plan] == sorted(s for s, _, _ in plan)  # segments in order, each contiguous
    assert len(plan) == math.ceil(4000 / CHUNK) + math.ceil(666 / CHUNK) + math.ceil(520 / CHUNK)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(list(DTYPES)), st.integers(1, 2000)), min_size=1, max_size=3),
       st.integers(1, 64))
def test_frame_plan_property(segments, sixty_fours):
    layout = make_layout(*segments)
    chunk_bytes = 64 * sixty_fours
    covered = {segment: [] for segment in range(len(segments))}
    for segment, start, stop in layout.frame_plan(chunk_bytes):
        assert (stop - start) * DTYPES[layout.dtypes[segment]].itemsize <= chunk_bytes
        covered[segment].extend(range(start, stop))
    assert all(covered[s] == list(range(numel)) for s, (_, numel) in enumerate(segments))


def test_a_message_decodes_with_a_chunk_size_at_the_limits():
    for chunk_bytes in (64, MAX_CHUNK_BYTES):
        assert attempt(valid_frames(chunk_bytes=chunk_bytes)) is not None


# --- hello -----------------------------------------------------------------------------------------


def test_hello_decodes_without_payload():
    message = decode(encode(Header("hello", 3, step=5)), TWO_SEGMENTS, WORLD)
    assert message.header.kind == "hello" and message.header.sender == 3 and message.header.step == 5
    assert message.chunks == [] and message.nbytes == 0


def test_hello_with_payload_frames_is_rejected():
    assert reason_of([Header("hello", 3).pack(), b"\0" * 64]) == "frames"


# --- validation, in the order decode checks ---------------------------------------------------------


def test_empty_message():
    assert reason_of([]) == "empty"


def test_oversized_header_is_rejected_before_decoding():
    big = msgpack.packb({"pad": b"x" * 200, **{f"k{i}": "y" * 200 for i in range(20)}})
    assert len(big) > MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match="exceeds") as info:
        decode([big], TWO_SEGMENTS, WORLD)
    assert info.value.reason == "header"


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", b"\x82\xa1", b"not msgpack at all \xff\xfe",
    msgpack.packb({"v": 1}) + msgpack.packb(1),  # trailing data
    msgpack.packb({1: 2}),  # non-string key
    msgpack.packb({"s": "x" * 300}),  # string over the explicit limit
    msgpack.packb({f"k{i}": i for i in range(40)}),  # map over the explicit limit
    b"\x91" * 2000 + b"\xc0",  # nesting deeper than msgpack's stack
], ids=["nothing", "reserved-byte", "truncated", "garbage", "trailing", "int-key", "long-str", "big-map", "deep"])
def test_undecodable_header(raw):
    assert reason_of([raw]) == "header"


@pytest.mark.parametrize("obj", [[1, 2], 7, "params", None, b"\x00"])
def test_header_that_is_not_a_map(obj):
    with pytest.raises(ProtocolError, match="not a map") as info:
        decode([msgpack.packb(obj)], TWO_SEGMENTS, WORLD)
    assert info.value.reason == "header"


@pytest.mark.parametrize("key", ["v", "r", "step", "round", "n", "sp", "st", "w", "fp", "seg", "ch"])
def test_missing_field(key):
    assert reason_of(with_header(valid_frames(), drop=(key,))) == "field"


def test_missing_kind():
    assert reason_of(with_header(valid_frames(), drop=("k",))) == "kind"


@pytest.mark.parametrize("key,value", [
    ("r", True), ("step", False), ("round", 1.0), ("n", "5"), ("v", None),  # not ints
    ("step", -1), ("n", -(2**40)), ("r", -1),  # negative counters
    ("step", MAX_INT), ("round", 2**64 - 1),  # beyond what a counter can be
    ("sp", math.nan), ("sp", math.inf), ("w", -math.inf), ("sp", -0.5), ("w", 1), ("sp", True), ("w", "1.0"),
    ("fp", 123), ("fp", None), ("ch", "256"), ("ch", 256.0), ("ch", True), ("seg", "float32"), ("seg", None),
    ("seg", [["float32"]]), ("seg", [[1, 400]]), ("seg", [["float32", 400.0]]), ("seg", [["float32", True]]),
    ("seg", ["float32", 400]),
])
def test_mistyped_or_out_of_range_field(key, value):
    assert reason_of(with_header(valid_frames(), **{key: value})) == "field"


def test_largest_counter_is_accepted():
    message = attempt(with_header(valid_frames(), step=MAX_INT - 1, n=MAX_INT - 1))
    assert message is not None and message.header.step == MAX_INT - 1


def test_wrong_protocol_version():
    assert reason_of(with_header(valid_frames(), v=PROTOCOL_VERSION + 1)) == "version"


@pytest.mark.parametrize("kind", ["goodbye", "", "HELLO", 5, None, ["params"]])
def test_unknown_kind(kind):
    assert reason_of(with_header(valid_frames(), k=kind)) == "kind"


def test_sender_out_of_range():
    assert reason_of(with_header(valid_frames(), r=WORLD)) == "sender"
    assert reason_of(with_header(valid_frames(), r=1), world_size=1) == "sender"
    assert decode(with_header(valid_frames(), r=0), TWO_SEGMENTS, 1).header.sender == 0
    assert attempt(with_header(valid_frames(), r=WORLD - 1)) is not None


def test_wrong_fingerprint():
    other = Layout.describe([("q0", (100,), "float32"), ("p1", (37,), "float64")], ["float32", "float64"], [100, 37])
    assert reason_of(valid_frames(layout=other)) == "fingerprint"


def test_fingerprint_is_checked_before_the_payload_is_touched():
    frames = with_header(valid_frames(), fp="0" * 16)
    frames[1] = np.full(64, np.nan, np.float32).tobytes()
    assert reason_of(frames) == "fingerprint"


def test_disallowed_dtype():
    layout = make_layout(("float32", 100))
    assert reason_of(with_header(valid_frames(layout), seg=[["int8", 400]]), layout) == "dtype"
    assert reason_of(with_header(valid_frames(layout), seg=[["complex64", 800]]), layout) == "dtype"


@pytest.mark.parametrize("seg", [
    [["float32", 404], ["float64", 296]],  # a lying length
    [["float32", 400]],  # a segment missing
    [["float32", 400], ["float64", 296], ["float32", 4]],  # one too many
    [["float64", 296], ["float32", 400]],  # swapped
    [["float32", 400], ["float32", 296]],  # right lengths, wrong dtype
])
def test_segments_that_differ_from_ours(seg):
    assert reason_of(with_header(valid_frames(), seg=seg)) == "layout"


@pytest.mark.parametrize("chunk_bytes", [0, 32, 100, 256 + 8, -256, MAX_CHUNK_BYTES + 64, 2**40])
def test_bad_chunk_size(chunk_bytes):
    assert reason_of(with_header(valid_frames(), ch=chunk_bytes)) == "chunk"


def test_chunk_size_other_than_ours_is_rejected():
    # The receiver mixes chunk by chunk along its own plan; a sender cutting otherwise cannot be mixed.
    ours = make_layout(("float32", 100), ("float64", 37), chunk_bytes=512)
    theirs = make_layout(("float32", 100), ("float64", 37))
    assert ours.fingerprint == theirs.fingerprint
    with pytest.raises(ProtocolError, match="--chunk-mb") as info:
        decode(valid_frames(theirs, chunk_bytes=CHUNK), ours, WORLD)
    assert info.value.reason == "chunk"
    assert attempt(valid_frames(theirs, chunk_bytes=512), ours) is not None


def test_truncated_and_extended_multipart():
    frames = valid_frames()
    assert reason_of(frames[:-1]) == "frames"
    assert reason_of(frames[:1]) == "frames"
    assert reason_of([*frames, b"\0" * 8]) == "frames"


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(list(DTYPES)), st.integers(1, 300)), min_size=1, max_size=3),
       st.integers(1, 8), st.data())
def test_truncating_a_multi_frame_message_anywhere_is_a_frames_error(segments, sixty_fours, data):
    layout = make_layout(*segments)
    chunk_bytes = 64 * sixty_fours
    frames = valid_frames(layout, chunk_bytes)
    keep = data.draw(st.integers(0, len(frames) - 2), label="payload frames kept")
    assert reason_of(frames[:1 + keep], layout) == "frames"


@pytest.mark.parametrize("frame,delta", [(1, -4), (1, 4), (-1, -8), (-1, 1)])
def test_frame_with_the_wrong_length(frame, delta):
    frames = [bytes(f) for f in valid_frames()]
    frames[frame] = frames[frame][:delta] if delta < 0 else frames[frame] + b"\0" * delta
    assert reason_of(frames) == "length"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_payload(dtype, bad):
    layout = make_layout((dtype, 300))
    chunks = make_chunks(layout, CHUNK)
    chunks[-1][-1] = bad
    frames = encode(params_header("params", 1, layout, CHUNK), chunks)
    assert reason_of(frames, layout) == "non-finite"


def test_float16_values_whose_float16_sum_would_overflow_are_accepted():
    layout = make_layout(("float16", 1000))
    chunks = [torch.full((stop - start,), 60000.0, dtype=torch.float16) for _, start, stop in layout.frame_plan(4096)]
    assert not torch.isfinite(chunks[0].sum())  # the float16 sum overflows ...
    message = decode(encode(params_header("params", 1, layout, 4096), chunks), layout, WORLD)
    assert torch.equal(message.chunks[0], chunks[0])  # ... but every value is finite


@pytest.mark.parametrize("dtype,value", [("float32", 3e38), ("bfloat16", 3e38), ("float64", 1.5e308)])
def test_large_finite_values_whose_sum_overflows_are_accepted(dtype, value):
    layout = make_layout((dtype, 64))
    chunks = [torch.full((stop - start,), value, dtype=DTYPES[dtype]) for _, start, stop in layout.frame_plan(CHUNK)]
    message = attempt(encode(params_header("params", 1, layout, CHUNK), chunks), layout)
    assert message is not None and all(torch.equal(a, b) for a, b in zip(message.chunks, chunks))


# --- zero copy -------------------------------------------------------------------------------------


def test_chunks_view_zmq_frames_without_copying():
    frames = [zmq.Frame(bytes(f)) for f in valid_frames()]
    message = decode(frames, TWO_SEGMENTS, WORLD)
    for chunk, frame in zip(message.chunks, frames[1:]):
        start = np.frombuffer(frame.buffer, np.uint8).ctypes.data
        assert start <= chunk.data_ptr() < start + len(frame.buffer)
    first = message.chunks[0].clone()
    frames[1].buffer[:4] = np.float32(1234.5).tobytes()  # writing the frame is seen through the chunk
    assert message.chunks[0][0] == 1234.5 and torch.equal(message.chunks[0][1:], first[1:])


# --- fuzzing: nothing but ProtocolError escapes -------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=20) | st.binary(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
_keys = st.sampled_from(["v", "k", "r", "round", "step", "n", "sp", "st", "w", "fp", "seg", "ch"]) | st.text(max_size=6)
# Values near the valid ones, so that mutations also reach the later checks.
_plausible = (st.integers(-2, 6) | st.sampled_from([MAX_INT - 1, MAX_INT, 64, 128, 256, 320, 512, 4096])
              | st.sampled_from(["hello", "params", TWO_SEGMENTS.fingerprint, "float32", "float64", "int8"])
              | st.floats(allow_nan=True) | st.lists(st.tuples(st.sampled_from([*DTYPES, "int8"]),
                                                                 st.sampled_from([0, 296, 400, 404])), max_size=3))


@FUZZ
@given(st.binary(max_size=MAX_HEADER_BYTES + 16), st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_bytes_raise_only_protocol_error(header, payload):
    attempt([header])
    attempt([header, *payload])


@settings(FUZZ, max_examples=80)  # generating nested maps is the slow part
@given(st.dictionaries(_keys, _values, max_size=14))
def test_arbitrary_maps_raise_only_protocol_error(obj):
    raw = msgpack.packb(obj)
    attempt([raw])
    attempt([raw, *valid_frames()[1:]])


@FUZZ
@given(st.sampled_from(["v", "k", "r", "round", "step", "n", "sp", "st", "w", "fp", "seg", "ch"]), _plausible | _values,
       st.booleans())
def test_a_valid_message_with_one_field_mutated_decodes_or_raises_protocol_error(key, value, delete):
    frames = valid_frames()
    message = attempt(with_header(frames, drop=(key,)) if delete else with_header(frames, **{key: value}))
    if message is not None:  # accepted: then it must still be the message that was sent
        sent = decode(frames, TWO_SEGMENTS, WORLD)
        assert all(torch.equal(a, b) for a, b in zip(message.chunks, sent.chunks))
