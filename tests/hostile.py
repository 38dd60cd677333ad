"""A hostile client: fires malformed, lying and replayed messages at a running peer's ROUTER.

Used by tests/test_hostile.py (and runnable by hand: ``python -m tests.hostile tcp://127.0.0.1:47000``).
Every kind below must be dropped by the peer's validation and counted under the reason named here.
"""

from __future__ import annotations

import argparse
import fcntl
import math
import random
import socket
import struct
import termios
import time
from collections import Counter
from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import torch
import zmq

from gossip.flat import FlatParams
from gossip.net.wire import DTYPES, Header, Layout, encode, params_header
from gossip.tasks import TaskContext, build_task


def _valid(layout: Layout, sender: int, round: int, fill: float = 0.0, chunk_bytes: int = 8 << 20) -> list:
    header = params_header("params", sender, layout, chunk_bytes, round=round, step=round)
    chunks = [torch.full((stop - start,), fill, dtype=DTYPES[layout.dtypes[seg]])
              for seg, start, stop in layout.frame_plan(chunk_bytes)]
    return encode(header, chunks)


def _with_header(frames: list, **changes) -> list:
    fields = msgpack.unpackb(frames[0])
    fields.update(changes)
    return [msgpack.packb(fields), *frames[1:]]


def kinds(layout: Layout, world_size: int, rng: random.Random) -> dict[str, Callable[[], list]]:
    """Message factories by the drop reason the victim must count for them."""
    def lying_lengths() -> list:
        frames = _valid(layout, 1, 0)
        segments = [[dtype, nbytes + 8] for dtype, nbytes in msgpack.unpackb(frames[0])["seg"]]
        return _with_header(frames, seg=segments)

    def short_frame() -> list:
        frames = _valid(layout, 1, 0)
        return [frames[0], bytes(frames[1])[:-4], *frames[2:]]

    def wrong_dtype(name: str) -> Callable[[], list]:
        return lambda: _with_header(_valid(layout, 1, 0), seg=[[name, n] for _, n in msgpack.unpackb(
            _valid(layout, 1, 0)[0])["seg"]])

    return {
        "header": lambda: [rng.randbytes(rng.randrange(1, 300))],
        "frames": lambda: _valid(layout, 1, 0)[:1],  # a truncated multipart message: the payload is missing
        "fingerprint": lambda: _with_header(_valid(layout, 1, 0), fp="0123456789abcdef"),
        "layout": lying_lengths,
        "length": short_frame,
        "dtype": wrong_dtype("int32"),
        "non-finite": lambda: _valid(layout, 1, 0, fill=rng.choice([math.nan, math.inf, -math.inf])),
        "sender": lambda: _with_header(_valid(layout, 1, 0), r=world_size + rng.randrange(1, 100)),
        "kind": lambda: _with_header(_valid(layout, 1, 0), k="gimme"),
        "version": lambda: _with_header(_valid(layout, 1, 0), v=99),
        # a replay of peer 1's round 0, long after it ended, over a connection that is not peer 1's
        "connection": lambda: _valid(layout, 1, 0),
    }


def forged(layout: Layout, kind: str, sender: int, fill: float = 0.0, **fields) -> list:
    """A well-formed message of ``kind`` in ``sender``'s name (a params or grad message carries ``fill``)."""
    if kind in ("params", "grad"):
        return _with_header(_valid(layout, sender, 0, fill=fill), k=kind, **fields)
    return [msgpack.packb({**msgpack.unpackb(Header(kind=kind, sender=sender).pack()), **fields})]


class Stranger:
    """Plain ZeroMQ clients aimed at one endpoint: bounded in count, closed with ``close``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket] = []

    def connect(self, reconnect_ms: int = 100) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, reconnect_ms)  # (a quick one is first at a restarted peer's port)
        sock.connect(self.endpoint)
        self.sockets.append(sock)
        return sock

    def send(self, *messages: list) -> None:
        sock = self.sockets[0] if self.sockets else self.connect()
        for frames in messages:
            sock.send_multipart(frames)

    def endless_message(self, frame_bytes: int, frames: int, timeout: float = 30) -> bool:
        """One multipart message of ``frames`` frames of ``frame_bytes`` (all views of one buffer); True
        once the victim has cut the connection (within ``timeout`` seconds)."""
        sock = self.connect()
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            payload = memoryview(bytearray(frame_bytes))
            sock.send_multipart([payload] * frames, copy=False)
            return bool(monitor.poll(timeout * 1000))
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def idle(self, count: int, timeout: float = 30) -> bool:
        """Open ``count`` connections that send nothing; True once the victim has cut one of them (within
        ``timeout`` seconds). They stay open (reconnecting when cut) until ``close``."""
        monitors = [self.connect().get_monitor_socket(zmq.EVENT_DISCONNECTED) for _ in range(count)]
        poller = zmq.Poller()
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        try:
            return bool(poller.poll(timeout * 1000))
        finally:
            for sock, monitor in zip(self.sockets[-count:], monitors):
                sock.disable_monitor()
                monitor.close(linger=0)

    def flood_ping_reset(self, messages: int, rounds: int = 5) -> int:
        """Speak ZMTP by hand over a plain TCP socket, ``rounds`` times: complete the (unauthenticated)
        handshake, send ``messages`` empty messages with a PING command among them in one burst, and close
        with a reset. libzmq 4.3.5 (pyzmq's bundled one) aborts the whole process on this when the
        burst fills the receiving connection's queue (its high-water mark): the queue stops the
        connection's input with the PING still unread, the reset marks the connection failed, and when
        the application then reads, the stopped input resumes, meets the PING, and answers it on the
        failed connection (``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``). Returns
        how many rounds found the victim listening."""
        host, port = self.endpoint.removeprefix("tcp://").rsplit(":", 1)
        for done in range(rounds):
            try:
                sock = socket.create_connection((host, int(port)), timeout=10)
            except ConnectionRefusedError:  # the victim is gone
                return done
            with sock:
                if _zmtp_greet(sock):
                    sock.sendall(_zmtp_ready(b"DEALER") + _zmtp_burst(messages))
                    _wait_acknowledged(sock)
                _reset_on_close(sock)
        return rounds

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


# ZMTP 3.1 by hand (rfc.zeromq.org/spec/37): greeting with the NULL mechanism, READY, frames, PING
_ZMTP_GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + bytes(32)


def _zmtp_frame(body: bytes, command: bool = False) -> bytes:
    flags = 0x04 if command else 0x00
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body  # a long frame


def _zmtp_ping() -> bytes:
    return _zmtp_frame(b"\x04PING" + struct.pack(">H", 0), command=True)


def _zmtp_ready(socket_type: bytes) -> bytes:
    return _zmtp_frame(b"\x05READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", len(socket_type))
                       + socket_type, command=True)


def _zmtp_greet(sock: socket.socket) -> bool:
    """Exchange greetings; False if the other side closed first."""
    sock.sendall(_ZMTP_GREETING)
    greeting = b""
    while len(greeting) < len(_ZMTP_GREETING):
        more = sock.recv(len(_ZMTP_GREETING) - len(greeting))
        if not more:
            return False
        greeting += more
    return True


def _zmtp_burst(messages: int) -> bytes:
    """``messages`` empty messages with a PING command in the middle, to be sent in one write."""
    half = messages // 2
    return _zmtp_frame(b"") * half + _zmtp_ping() + _zmtp_frame(b"") * (messages - half)


def _wait_acknowledged(sock: socket.socket, timeout: float = 10) -> None:
    """Wait until the other side's kernel has acknowledged every byte sent (the send queue, ``TIOCOUTQ``, is
    empty), so that a reset that follows comes after the data instead of discarding it unsent."""
    def unacknowledged() -> int:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0]

    deadline = time.monotonic() + timeout
    while unacknowledged() and time.monotonic() < deadline:
        time.sleep(0.005)


def _reset_on_close(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def impostor_flood(listener: socket.socket, messages: int, timeout: float = 20) -> None:
    """Stand in for a neighbour: take the next connection on ``listener`` (a peer's DEALER coming to what
    it believes is its neighbour's ROUTER), complete the unauthenticated handshake as a ROUTER, send it
    ``messages`` empty messages with a PING among them, and close with a reset. A DEALER never reads, so
    with a receive high-water mark its input stops, the reset fails the connection, and libzmq 4.3.5's next
    heartbeat on it aborts the process (``Assertion failed: !_io_error``)."""
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(timeout)
        if _zmtp_greet(conn):
            conn.sendall(_zmtp_ready(b"ROUTER") + _zmtp_burst(messages))
            _wait_acknowledged(conn)
        _reset_on_close(conn)


def impostor_stream(listener: socket.socket, limit: int, timeout: float = 2) -> int:
    """Stand in for a neighbour as ``impostor_flood`` does, but stream 1,000-byte messages to the DEALER
    (below its 4 KiB frame limit) until ``limit`` bytes are sent, or the connection is cut or takes
    nothing for ``timeout`` seconds; the bytes sent."""
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    sent = 0
    with conn:
        conn.settimeout(timeout)
        if not _zmtp_greet(conn):
            return sent
        conn.sendall(_zmtp_ready(b"ROUTER"))
        burst = _zmtp_frame(bytes(1000)) * 1024  # ~1 MB a write
        try:
            while sent < limit:
                conn.sendall(burst)
                sent += len(burst)
        except OSError:  # cut (the DEALER's side shut the connection down), or nothing read any more
            pass
    return sent


def victim_layout(task: str = "digits", world_size: int = 4) -> Layout:
    return FlatParams(build_task(task, TaskContext(0, world_size, 0)).model, 8 << 20).layout


def attack(endpoint: str, layout: Layout, world_size: int, count: int, seed: int = 0,
           proof: list | None = None, proof_every: int = 0) -> Counter[str]:
    """Send ``count`` hostile messages, cycling through every kind; returns how many of each were sent.
    With ``proof``, that acceptable message goes before every ``proof_every`` of them (counted as "proof")."""
    rng = random.Random(seed)
    factories = kinds(layout, world_size, rng)
    sent: Counter[str] = Counter()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 1000)
    dealer.connect(endpoint)
    try:
        for index, reason in enumerate(_cycle(list(factories), count, np.random.default_rng(seed))):
            if proof is not None and index % proof_every == 0:
                dealer.send_multipart(proof)
                sent["proof"] += 1
            dealer.send_multipart(factories[reason]())
            sent[reason] += 1
    finally:
        dealer.close(linger=2000)
        context.term()
    return sent


def _cycle(names: list[str], count: int, rng: np.random.Generator) -> Iterator[str]:
    for index in rng.permutation(count):
        yield names[index % len(names)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("endpoint")
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=4)
    args = parser.parse_args()
    print(dict(attack(args.endpoint, victim_layout(world_size=args.nodes), args.nodes, args.count)))


if __name__ == "__main__":
    main()
