"""Wire format: one ZeroMQ multipart message per exchange, validated before the payload is touched.

Frame 0 is a small msgpack map (the ``Header``); the following frames are the raw bytes of the sender's
flat parameter buffers, cut into chunks of ``chunk_bytes`` (8-16 MiB: libzmq allocates every received
frame anew, and glibc maps and zeroes each block over 32 MiB, which halves the throughput of one big
frame). Payload frames go out with ``copy=False`` and come back as views (``torch.frombuffer`` over the
ZeroMQ frame): no pickling and no copy on either side.

``decode`` checks, in order: header size, msgpack with explicit limits, field types and ranges, protocol
version, kind, sender rank, layout fingerprint, per-segment dtype and byte length, chunk size, frame
count, every frame's length, and finally that the values are finite. Any failure raises ``ProtocolError``
whose ``reason`` names the check, so drops can be counted by kind. Nothing else escapes ``decode``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from gossip.errors import ProtocolError
from gossip.net.limits import MAX_HEADER_BYTES, MAX_PROGRESS_PEERS

PROTOCOL_VERSION = 1
MIN_CHUNK_BYTES = 64
MAX_CHUNK_BYTES = 64 << 20
MAX_INT = 1 << 53  # counters beyond this cannot be real; also keeps floats exact in logs
# kind -> whether it carries the flat buffers as payload. "params": a peer's weights (gossip, and ps-avg
# workers); "grad": a parameter-server worker's gradients; "weights": the server's weights for a worker;
# "bye": a worker or peer that has finished; "end" (asynchronous parameter-server modes): the server's
# answer to a contribution once the run's budget of gradients is spent, with its weights: stop training.
# "bye-ack" (gossip-async push-sum): a peer still training answers a finished neighbour's bye: it sends
# that neighbour nothing more. "welcome": a gossip neighbour
# re-admits a restarted peer, in its round ``round`` at its step ``step``. "delta-f16" and "delta-i8"
# (compressed gossip, ``--compress``): the sender's compressed change of its public copy (see below).
# "abort": the sender stopped on an error and the run cannot go on; ``reason`` says why in one line (its
# own, or the one it was told by the peer that failed first). "up" (gossip-async, before the first step):
# the peers its sender knows to have started, one flag (0 or 1) per peer in ``progress``, its own 1 and
# ``step`` 1 (``gossip/progress.py`` says why the start spreads so).
KINDS: dict[str, bool] = {"hello": False, "params": True, "grad": True, "weights": True, "end": True,
                          "bye": False, "bye-ack": False, "welcome": False, "delta-f16": True, "delta-i8": True,
                          "abort": False, "up": False}
MAX_REASON_CHARS = 240
# Compressed payloads follow the same frame plan as the weights; each row of it becomes, for "float16", one
# frame of float16 values and, for "int8", one frame of int8 values and one of float32 scales, one scale per
# INT8_BLOCK values (value = int8 * scale). A scale is finite, >= 0 and at most MAX_INT8_SCALE, so that no
# decoded value exceeds 2^64 in magnitude (an honest difference of weights is nowhere near it; a replica
# built from such values cannot overflow in any run the round bound allows).
CODEC_KINDS = {"float16": "delta-f16", "int8": "delta-i8"}


def frames_per_row(codec: str) -> int:
    """Payload frames per row of the frame plan: int8 sends values and scales, the others one frame."""
    return 2 if codec == "int8" else 1


INT8_BLOCK = 256
MAX_INT8_SCALE = 2.0 ** 64 / 127
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_INT_FIELDS = ("v", "r", "step", "round", "n")
_FLOAT_FIELDS = ("sp", "st", "w")


@dataclass(frozen=True)
class Layout:
    """What a peer's flat buffers look like: one segment per dtype, plus a fingerprint of the model."""

    dtypes: tuple[str, ...]
    numels: tuple[int, ...]
    fingerprint: str
    # Our frame size; the receiver mixes chunk by chunk along its own frame_plan, so a sender must cut
    # the same way. 0 accepts any size (tools that only inspect messages).
    chunk_bytes: int = 0
    codec: str = "none"  # the compressed kind we take (``CODEC_KINDS``), or "none": none

    @classmethod
    def describe(cls, entries: Sequence[tuple[str, tuple[int, ...], str]], dtypes: Sequence[str],
                 numels: Sequence[int], chunk_bytes: int = 0) -> Layout:
        """Build a layout whose fingerprint hashes every (name, shape, dtype) entry in order."""
        digest = hashlib.sha256(repr(list(entries)).encode()).hexdigest()[:16]
        return cls(tuple(dtypes), tuple(numels), digest, chunk_bytes)

    def nbytes(self, segment: int) -> int:
        return self.numels[segment] * DTYPES[self.dtypes[segment]].itemsize

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(i) for i in range(len(self.dtypes)))

    def frame_plan(self, chunk_bytes: int) -> list[tuple[int, int, int]]:
        """(segment, first element, end element) of every payload frame, in order."""
        plan = []
        for segment, dtype in enumerate(self.dtypes):
            per_frame = max(1, chunk_bytes // DTYPES[dtype].itemsize)
            numel = self.numels[segment]
            plan += [(segment, start, min(start + per_frame, numel)) for start in range(0, numel, per_frame)]
        return plan


@dataclass(frozen=True)
class Header:
    kind: str
    sender: int
    round: int = 0
    step: int = 0
    samples: int = 0
    speed: float = 0.0  # the sender's samples per second (moving average)
    step_seconds: float = 0.0  # the sender's seconds per local step (moving average)
    weight: float = 1.0  # push-sum mass: the sender's weight when it took the snapshot
    fingerprint: str = ""
    segments: tuple[tuple[str, int], ...] = ()  # (dtype, nbytes) per flat segment
    chunk_bytes: int = 0
    # gossip-async: the latest step of every peer that the sender knows of (its own is ``step``), empty elsewhere
    progress: tuple[int, ...] = ()
    reason: str = ""  # "abort" only: why the run stops, printable text of at most MAX_REASON_CHARS
    # a gossip hello: a random number its sender's incarnation drew; a welcome: that of the hello it answers
    nonce: int = 0

    @property
    def version(self) -> int:
        """The ps-* modes' name for ``round``: the server version the message was computed on or carries."""
        return self.round

    def pack(self) -> bytes:
        return msgpack.packb({
            "v": PROTOCOL_VERSION, "k": self.kind, "r": self.sender, "round": self.round, "step": self.step,
            "n": self.samples, "sp": float(self.speed), "st": float(self.step_seconds), "w": float(self.weight),
            "fp": self.fingerprint, "seg": [list(s) for s in self.segments], "ch": self.chunk_bytes,
            "pg": list(self.progress), **({"why": self.reason} if self.reason else {}),
            **({"nc": self.nonce} if self.nonce else {}),
        })


@dataclass
class Message:
    """A validated message; ``chunks`` are tensors viewing the received frames, one per ``frame_plan`` row."""

    header: Header
    chunks: list[torch.Tensor]
    nbytes: int


def encode(header: Header, chunks: Sequence[torch.Tensor] = ()) -> list[Any]:
    """Frames for ``send_multipart(copy=False)``: the packed header, then each chunk's bytes, uncopied."""
    return [header.pack(), *(_byte_view(chunk) for chunk in chunks)]


def abort_header(sender: int, reason: str) -> Header:
    """An "abort" with ``reason`` made fit for the wire: ASCII, one line, at most MAX_REASON_CHARS."""
    text = "".join(c if c.isprintable() else " " for c in reason.encode("ascii", "replace").decode())
    text = " ".join(text.split())
    text = text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."
    return Header(kind="abort", sender=sender, reason=text or "no reason given")


def up_header(sender: int, started: Iterable[int], world_size: int) -> Header:
    """An "up": the flags of the peers in ``started`` (our own among them)."""
    flags = [0] * world_size
    for peer in started:
        flags[peer] = 1
    flags[sender] = 1
    return Header(kind="up", sender=sender, step=1, progress=tuple(flags))


def params_header(kind: str, sender: int, layout: Layout, chunk_bytes: int, **fields: Any) -> Header:
    segments = tuple((dtype, layout.nbytes(i)) for i, dtype in enumerate(layout.dtypes))
    return Header(kind=kind, sender=sender, fingerprint=layout.fingerprint, segments=segments,
                  chunk_bytes=chunk_bytes, **fields)


def decode(frames: Sequence[Any], layout: Layout, world_size: int) -> Message:
    """Validate ``frames`` (bytes or zmq.Frame) against our layout; raise ProtocolError on any defect."""
    if not frames:
        raise ProtocolError("empty", "empty message")
    header = _decode_header(_bytes_of(frames[0]), world_size)
    payload = frames[1:]
    if not KINDS[header.kind]:
        if payload:
            raise ProtocolError("frames", f"a {header.kind} message carries no payload, got {len(payload)} frames")
        return Message(header, [], 0)
    codec = _check_codec(header, layout)
    per_row = frames_per_row(codec)
    if len(payload) % per_row:
        raise ProtocolError("frames", f"{len(payload)} payload frames, not {per_row} per row of the frame plan")
    plan = _check_layout(header, layout, len(payload) // per_row)
    chunks = []
    for row, (segment, start, stop) in enumerate(plan):
        dtypes = {"none": (DTYPES[layout.dtypes[segment]],), "float16": (torch.float16,),
                  "int8": (torch.int8, torch.float32)}[codec]
        for part, dtype in enumerate(dtypes):
            count = -(-(stop - start) // INT8_BLOCK) if part else stop - start
            buffer = _buffer_of(payload[row * per_row + part])
            if len(buffer) != count * dtype.itemsize:
                raise ProtocolError("length", f"frame of {len(buffer)} bytes where {count * dtype.itemsize} belong")
            chunks.append(torch.frombuffer(buffer, dtype=dtype))
    if codec == "int8":
        _check_scales(chunks[1::2], header.sender)
        return Message(header, chunks, layout.total_bytes)
    for chunk in chunks:
        # One read-only pass: NaN or Inf anywhere makes the sum non-finite. So does a sum of large finite
        # values that overflows (a float16 sum past 65504); only then is the exact element-wise check worth
        # its temporary. (Summing float16 with dtype=float32 would convert the whole chunk into a new
        # buffer first: measured, it fragmented the loop thread's heap by 3-4 models over a run.)
        if not math.isfinite(float(chunk.sum())) and not bool(torch.isfinite(chunk).all()):
            raise ProtocolError("non-finite", f"payload from peer {header.sender} holds NaN or Inf")
    return Message(header, chunks, layout.total_bytes)


def _check_codec(header: Header, layout: Layout) -> str:
    """The codec of a payload message: "none" for the weights, else the one the kind names, which must be ours."""
    if header.kind not in CODEC_KINDS.values():
        return "none"
    codec = next(name for name, kind in CODEC_KINDS.items() if kind == header.kind)
    if codec != layout.codec:
        ours = f"--compress {layout.codec}" if layout.codec != "none" else "no compression"
        raise ProtocolError("codec", f"peer {header.sender} sends {codec}-compressed differences, we run with "
                                     f"{ours}; every peer must use the same --compress")
    return codec


def _check_scales(scales: Sequence[torch.Tensor], sender: int) -> None:
    """int8 scales: finite, >= 0 and at most MAX_INT8_SCALE (NaN fails every comparison)."""
    for chunk in scales:
        if chunk.numel() and not (bool((chunk >= 0).all()) and float(chunk.max()) <= MAX_INT8_SCALE):
            raise ProtocolError("scale", f"int8 scales from peer {sender} are negative, too large or not finite")


def _decode_header(raw: bytes, world_size: int) -> Header:
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("header", f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                              max_str_len=256, max_bin_len=256, max_array_len=MAX_PROGRESS_PEERS, max_map_len=32)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError("header", f"undecodable header: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError("header", f"header is a {type(obj).__name__}, not a map")
    for key in _INT_FIELDS:
        value = obj.get(key)
        if type(value) is not int or not 0 <= value < MAX_INT:
            raise ProtocolError("field", f"header field {key!r} is {value!r}, not a counter")
    for key in _FLOAT_FIELDS:
        value = obj.get(key)
        if type(value) is not float or not math.isfinite(value) or value < 0:
            raise ProtocolError("field", f"header field {key!r} is {value!r}, not a finite number >= 0")
    if obj["v"] != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {obj['v']}, we speak {PROTOCOL_VERSION}")
    kind = obj.get("k")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError("kind", f"unknown message kind {kind!r}")
    if obj["r"] >= world_size:
        raise ProtocolError("sender", f"sender rank {obj['r']} outside 0..{world_size - 1}")
    fingerprint, segments, chunk_bytes = obj.get("fp"), obj.get("seg"), obj.get("ch")
    if not isinstance(fingerprint, str) or type(chunk_bytes) is not int or not isinstance(segments, (list, tuple)):
        raise ProtocolError("field", "header fields 'fp', 'seg' or 'ch' are missing or mistyped")
    if not all(isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[0], str) and type(s[1]) is int
               for s in segments):
        raise ProtocolError("field", "header field 'seg' is not a list of (dtype, nbytes) pairs")
    progress = obj.get("pg", [])
    if not isinstance(progress, (list, tuple)) or not all(type(v) is int and 0 <= v < MAX_INT for v in progress):
        raise ProtocolError("field", "header field 'pg' is not a list of step counts")
    if progress and (len(progress) != world_size or progress[obj["r"]] != obj["step"]):
        raise ProtocolError("progress", f"peer {obj['r']} reports the steps of {len(progress)} peers, its own as "
                                        f"{progress[obj['r']] if obj['r'] < len(progress) else None} in a message "
                                        f"of its step {obj['step']}; the run has {world_size} peers")
    if kind == "up" and (len(progress) != world_size or obj["step"] != 1 or max(progress) > 1):
        raise ProtocolError("up", f"an up from peer {obj['r']} must flag each of the {world_size} peers 0 or 1, "
                                  "its own 1 with step 1")
    reason = obj.get("why", "")
    if not (isinstance(reason, str) and len(reason) <= MAX_REASON_CHARS and reason.isprintable()):
        raise ProtocolError("field", "header field 'why' is not a line of printable text")
    if bool(reason) != (kind == "abort"):
        raise ProtocolError("field", f"a {kind} message {'carries' if reason else 'lacks'} a reason")
    nonce = obj.get("nc", 0)
    if type(nonce) is not int or not 0 <= nonce < MAX_INT:
        raise ProtocolError("field", f"header field 'nc' is {nonce!r}, not a number below 2^53")
    return Header(kind=kind, sender=obj["r"], round=obj["round"], step=obj["step"], samples=obj["n"],
                  speed=obj["sp"], step_seconds=obj["st"], weight=obj["w"], fingerprint=fingerprint,
                  segments=tuple((s[0], s[1]) for s in segments), chunk_bytes=chunk_bytes,
                  progress=tuple(progress), reason=reason, nonce=nonce)


def _check_layout(header: Header, layout: Layout, frame_count: int) -> list[tuple[int, int, int]]:
    if header.fingerprint != layout.fingerprint:
        raise ProtocolError("fingerprint", f"peer {header.sender} has model layout {header.fingerprint}, "
                                           f"ours is {layout.fingerprint}; every peer must build the same model",
                            sender=header.sender, layout=header.fingerprint)
    for dtype, _ in header.segments:
        if dtype not in DTYPES:
            raise ProtocolError("dtype", f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    expected = tuple((dtype, layout.nbytes(i)) for i, dtype in enumerate(layout.dtypes))
    if header.segments != expected:
        raise ProtocolError("layout", f"segments {header.segments} differ from ours {expected}")
    if not MIN_CHUNK_BYTES <= header.chunk_bytes <= MAX_CHUNK_BYTES or header.chunk_bytes % 64:
        raise ProtocolError("chunk", f"chunk size {header.chunk_bytes} is not a multiple of 64 in "
                                     f"{MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}")
    if layout.chunk_bytes and header.chunk_bytes != layout.chunk_bytes:
        raise ProtocolError("chunk", f"peer {header.sender} cuts its payload into {header.chunk_bytes}-byte frames, "
                                     f"we into {layout.chunk_bytes}; every peer must use the same --chunk-mb")
    plan = layout.frame_plan(header.chunk_bytes)
    if frame_count != len(plan):
        raise ProtocolError("frames", f"{frame_count} payload frames where the layout needs {len(plan)}")
    return plan


def _byte_view(chunk: torch.Tensor) -> memoryview:
    return memoryview(chunk.view(torch.uint8).numpy())


def _buffer_of(frame: Any) -> memoryview:
    # A zmq.Frame's buffer is writable and viewed in place; plain bytes (tests, tools) are copied once
    # because torch refuses to view read-only memory without a warning.
    return frame.buffer if hasattr(frame, "buffer") else memoryview(bytearray(frame))


def _bytes_of(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)
