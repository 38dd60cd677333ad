"""What a connection may cost a peer: a cap on the bytes each may park inside libzmq, in either direction
(the connections our ROUTER accepted, and our DEALERs' own), on the number of accepted ones, and on the
descriptors they may take from the peer's own files and sockets.

libzmq assembles a whole multipart message before the application sees any of it, and its limits do not
bound that: ``MAXMSGSIZE`` applies to one frame and the receive high-water mark counts complete messages
(and is off on our sockets: a connection stopped by it can abort libzmq 4.3.5, ``gossip/net/transport.py``).
A sender that streams frame after frame of one endless message, or message after message faster than we
take them, therefore grows the receiver's memory without limit. No socket option closes that gap, so this
module watches each connection from outside libzmq:

- the kernel counts the bytes it received on each TCP connection (``TCP_INFO``'s ``tcpi_bytes_received``);
- the receiver (``gossip/net/receiver.py``) credits every complete message it takes from a connection
  (ZeroMQ tells which descriptor a message came through);
- the difference, less what still waits in the kernel's receive queue (``FIONREAD``; the kernel bounds
  that by the socket's receive buffer), is what libzmq holds for that connection: complete messages in
  its queue and the message being assembled. A sender that waits for us, as the protocol has it (every
  mode but gossip-async's latest rule), stays below ``(queue + 2)`` messages of the largest size the
  protocol allows; a connection beyond that is cut (``shutdown`` of the socket: libzmq sees the end of the
  stream and frees what it held), and its sender's DEALER reconnects.

The watch runs every ``CHECK_SECONDS`` on the event loop, so what one connection can hold is the limit
plus what arrives in one interval. The limit is in wire bytes; in memory it is up to 32 times that for a
message of empty frames (``memory_bound``), which is why the slack beyond the protocol's own messages is
kept to the handshake and the heartbeats actually sent. Unix-socket connections (same-host peers,
abstract sockets, which have no file permissions) have no byte counters: one from a process of another
user is cut at once (the kernel names the connecting process's user, ``SO_PEERCRED``); the same user can
read our keys anyway.

A second guard watches the transport's DEALERs' connections (``gossip/net/outbox.py``), with a limit of no
messages at all: a neighbour's ROUTER sends a DEALER ZMTP commands only, so anything more comes from a
process listening at the neighbour's address in its place. libzmq's monitor names such a connection's
descriptor after the fact, when the number may already belong to another connection, so ``accepted``
checks a duplicate first.

A cap on connections bounds descriptors: beyond ``max_connections`` the oldest connection that never
delivered a valid message is cut (a live neighbour's first message is its hello, so it is never the one).

Descriptor headroom. libzmq accepts in its own thread, as fast as connections come, and every accepted
connection takes a descriptor of the process, which the peer's own files and sockets (its DEALERs, its
event log, a checkpoint) need too. The guard needed one more to watch or cut a connection (``os.dup``):
when a burst had taken them all before it looked, it could not duplicate those connections, so it never
cut them, and they stayed until libzmq's handshake timeout (5 s) while every open of the peer failed.
The rule now: the peer keeps ``reserve`` descriptors free for itself, and

- the guard's duplicates live in descriptors held from the start (``DescriptorPool``, one per connection
  it may watch, and one more): a duplicate is ``dup2`` onto a held number and goes back by ``dup2`` of
  /dev/null, so watching and cutting never need a free descriptor, however full the table;
- the receiver hands the guard each accepted connection as soon as libzmq reports it (not at the next
  check), and ``accepted`` cuts it at once when the process's free descriptors (the soft RLIMIT_NOFILE
  less those open, counted once per batch of accepts: ``look``) are fewer than ``reserve``
  (``reserve_for``: ``DESCRIPTORS_PER_NEIGHBOUR`` per destination for its DEALERs and their monitors, and
  ``OWN_DESCRIPTORS`` for its files).

No rule can stop libzmq from accepting between two looks of the event loop: a burst that arrives while
the loop is busy can still fill the table, until the loop looks and cuts (``tests/test_descriptors.py``
measures how long that takes).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import resource
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger("gossip.net.guard")
CHECK_SECONDS = 0.02
DESCRIPTORS_PER_NEIGHBOUR = 4  # a DEALER's socket, its monitor (two inproc sockets), its connection
OWN_DESCRIPTORS = 32  # a peer's files and everything else it opens: its event log, checkpoints, a model saved
_WARN_FIRST = 5  # warnings of connections cut for descriptors before only every 1000th
_TCP_INFO_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in Linux's struct tcp_info
_TCP_INFO_SIZE = 136
SLACK_BYTES = 64 << 10  # the ZMTP greeting and handshake (CurveZMQ's included) take under 1 KiB
FRAME_OVERHEAD = 64  # ZMTP frame header and CurveZMQ box per frame, at most
HEARTBEAT_BYTES = 64  # one ZMTP PING as a neighbour's DEALER sends it (in a CurveZMQ box: about 45 bytes)
# What libzmq keeps per frame of a message being assembled, whatever the frame's size: one 64-byte msg_t.
# A frame of 0 bytes costs its sender 2 bytes on the wire, so a stream of tiny frames makes a connection
# hold up to MSG_T_BYTES / 2 times its byte count in memory before the guard cuts it.
MSG_T_BYTES = 64


@dataclass
class Connection:
    fd: int
    serial: int  # names the connection for good (a descriptor number is reused)
    opened: float
    socket: socket.socket | None  # a duplicate of libzmq's descriptor; None once cut or not ours to watch
    tcp: bool
    delivered: int = 0  # bytes of complete messages we took from it
    valid: bool = False  # it delivered a message that passed validation


@dataclass
class ConnectionGuard:
    """Owns the watch over one side's connections (the accepted ones, or our DEALERs'): a duplicate of each
    connection's descriptor, its bytes taken, its serial, and the cuts by reason. ``max_bytes``: what one
    connection may hold inside libzmq beyond what we took from it, besides the handshake and the heartbeats
    its sender sends every ``heartbeat_seconds``."""

    max_bytes: int
    max_connections: int
    heartbeat_seconds: float = 1.0
    on_closed: Callable[[int], None] | None = None  # told the serial of every connection that closed
    pool: DescriptorPool | None = None  # held descriptors for the duplicates (None: ``os.dup``)
    reserve: int = 0  # free descriptors a new connection may not eat into (0: no check)
    connections: dict[int, Connection] = field(default_factory=dict)
    cut: dict[str, int] = field(default_factory=dict)  # reason -> connections cut
    # descriptors that delivered a valid message before their accept was reported (two event streams)
    _early: set[int] = field(default_factory=set)
    _free: int | None = None  # free descriptors as ``look`` counted them (None: count at each accept)
    _serials: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def accepted(self, fd: int, belongs: Callable[[socket.socket], bool] | None = None) -> None:
        """Watch the connection on descriptor ``fd`` (as libzmq's monitor names it: the number may have
        been reused since, so ``belongs``, when given, checks on a duplicate that it is the connection meant)."""
        self.closed(fd)  # a descriptor number is reused once its previous connection is gone
        dup = self._duplicate(fd)
        if dup is None:  # gone already
            return
        try:
            ours = belongs is None or belongs(dup)
        except OSError:  # not connected any more
            ours = False
        if not ours:
            self._release(dup)
            return
        tcp = dup.family in (socket.AF_INET, socket.AF_INET6)
        self.connections[fd] = Connection(fd, next(self._serials), time.monotonic(), dup, tcp,
                                          valid=fd in self._early)
        self._early.discard(fd)
        if not tcp and _peer_uid(dup) not in (None, os.getuid()):
            self._cut(self.connections[fd], "foreign-user")
            return
        if len(self.connections) > self.max_connections:
            unproven = [c for c in self.connections.values() if not c.valid and c.socket is not None]
            victim = min(unproven, key=lambda c: c.opened) if unproven else self.connections[fd]
            self._cut(victim, "connections")
        free = (self._free if self._free is not None else free_descriptors()) if self.reserve else None
        if free is not None and free < self.reserve and self.connections[fd].socket is not None:
            self._cut(self.connections[fd], "descriptors")
            count = self.cut["descriptors"]
            if count <= _WARN_FIRST or count % 1000 == 0:
                log.warning("cut an inbound connection at once (%d so far): %d descriptors are free and %d are kept "
                            "for this peer's own files and sockets; a burst of connections, or too low a limit "
                            "(ulimit -n)", count, free, self.reserve)

    def look(self) -> None:
        """Count the free descriptors once for the accepts reported together: libzmq took their
        descriptors before it reported them, so the count holds for each (``done_looking`` ends it)."""
        self._free = free_descriptors() if self.reserve else None

    def done_looking(self) -> None:
        self._free = None

    def closed(self, fd: int) -> None:
        connection = self.connections.pop(fd, None)
        if connection is None:
            return
        if connection.socket is not None:
            self._release(connection.socket)
        if self.on_closed is not None:
            self.on_closed(connection.serial)

    def serial(self, fd: int | None) -> int | None:
        """The serial of the connection on descriptor ``fd``; None before its accept was reported."""
        connection = self.connections.get(fd) if fd is not None else None
        return connection.serial if connection is not None else None

    def delivered(self, fd: int, nbytes: int, frames: int, valid: bool) -> None:
        connection = self.connections.get(fd)
        if connection is not None:
            connection.delivered += nbytes + frames * FRAME_OVERHEAD
            connection.valid |= valid
        elif valid and len(self._early) < self.max_connections:
            self._early.add(fd)

    def check(self) -> None:
        """Cut every TCP connection that holds more inside libzmq than the protocol allows."""
        now = time.monotonic()
        for connection in list(self.connections.values()):
            if not connection.tcp or connection.socket is None:
                continue
            received = _bytes_received(connection.socket)
            if received is None:
                continue
            received -= _bytes_unread(connection.socket)  # still in the kernel's queue: not libzmq's memory
            if received - connection.delivered > self.allowed(now - connection.opened):
                self._cut(connection, "oversized")

    def allowed(self, age: float) -> float:
        """Bytes a connection ``age`` seconds old may have sent beyond the messages we took from it."""
        return self.max_bytes + SLACK_BYTES + HEARTBEAT_BYTES * (1 + age / self.heartbeat_seconds)

    def memory_bound(self, age: float) -> float:
        """What one connection can make libzmq hold before it is cut (less what arrives within one check):
        a tiny-frame stream turns each 2 wire bytes into a 64-byte msg_t."""
        return self.allowed(age) * MSG_T_BYTES / 2

    def close(self) -> None:
        for fd in list(self.connections):
            self.closed(fd)

    def _cut(self, connection: Connection, reason: str) -> None:
        self.cut[reason] = self.cut.get(reason, 0) + 1
        if connection.socket is not None:
            try:
                connection.socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._release(connection.socket)
            connection.socket = None

    def _duplicate(self, fd: int) -> socket.socket | None:
        """A socket on a duplicate of ``fd``: in a held descriptor when the pool has one, else a new one."""
        try:
            taken = self.pool.take(fd) if self.pool is not None else None
            return taken if taken is not None else socket.socket(fileno=os.dup(fd))
        except OSError:  # gone already, not a socket, or (without a held one) no descriptor free
            return None

    def _release(self, sock: socket.socket) -> None:
        if self.pool is None or not self.pool.give_back(sock):
            sock.close()


class DescriptorPool:
    """Descriptors held from the start for the guard's duplicates of connections. ``take`` makes a held
    descriptor a duplicate of another (``dup2``, which needs no free descriptor), ``give_back`` makes it
    /dev/null again; a burst that takes every free descriptor of the process takes none of these."""

    def __init__(self, size: int) -> None:
        self._null = os.open(os.devnull, os.O_RDONLY)
        self._free: list[int] = []
        self._held: set[int] = set()
        try:
            for _ in range(size):
                self._free.append(os.dup(self._null))
        except OSError:
            self.close()
            raise
        self._held.update(self._free)

    def take(self, fd: int) -> socket.socket | None:
        """A socket on a held descriptor that duplicates ``fd``; None when none is free (``OSError``
        when ``fd`` is closed or no socket)."""
        if not self._free:
            return None
        held = self._free.pop()
        try:
            os.dup2(fd, held)
            return socket.socket(fileno=held)
        except OSError:
            os.dup2(self._null, held)
            self._free.append(held)
            raise

    def give_back(self, sock: socket.socket) -> bool:
        """Make ``sock``'s descriptor a held one again, if it is one (then ``sock`` is detached)."""
        if sock.fileno() not in self._held:
            return False
        held = sock.detach()
        os.dup2(self._null, held)
        self._free.append(held)
        return True

    @property
    def free(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Close the held descriptors not in use (give every socket back first) and /dev/null."""
        for held in self._free:
            os.close(held)
        self._held.difference_update(self._free)
        self._free.clear()
        os.close(self._null)


def reserve_for(neighbours: int) -> int:
    """The descriptors a peer with ``neighbours`` destinations keeps free for itself."""
    return DESCRIPTORS_PER_NEIGHBOUR * neighbours + OWN_DESCRIPTORS


def raise_descriptor_limit() -> None:
    """Every connection costs a descriptor, and the guards hold one per connection they may watch: use the
    hard limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ValueError, OSError):  # not allowed: the soft limit stays
        pass


def free_descriptors() -> int | None:
    """Descriptors this process may still open: the soft RLIMIT_NOFILE less those open (Linux's
    /proc/self/fd; None where there is none to count). With none free even the count fails: 0."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except FileNotFoundError:
        return None
    except OSError:  # EMFILE: not one free
        return 0
    return max(0, soft - used)


def _bytes_received(sock: socket.socket) -> int | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except (OSError, AttributeError):  # not Linux, or not TCP
        return None
    if len(info) < _TCP_INFO_SIZE:  # a kernel older than 4.1 does not count them
        return None
    return struct.unpack_from("Q", info, _TCP_INFO_BYTES_RECEIVED)[0]


def _bytes_unread(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock`` that libzmq has not read yet (bounded by the receive buffer)."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def _peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (Linux), else None."""
    try:
        return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    except (OSError, AttributeError):
        return None
