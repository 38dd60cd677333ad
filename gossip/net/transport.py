"""The transport of one peer: what the rest of the library sees of the network (``Transport``), composed of
a receiver, one outbox per destination, two connection guards and the loop thread that owns every socket.

- ``gossip/net/receiver.py``: one ROUTER, bound on the peer's endpoint, receives from everyone and hands
  each message to the handler (``Mailbox.deliver``);
- ``gossip/net/sender.py`` and ``gossip/net/outbox.py``: one DEALER per destination, connected on the first
  message to it, behind a bounded queue; the three ways a message enters the queues (waiting for room,
  replacing the unsent snapshot, offered only where a queue is empty), liveness (ZeroMQ heartbeats,
  HEARTBEAT_TTL ``heartbeat_timeout``), link monitors and emulated latency (added in front of the socket,
  not by the kernel);
- ``gossip/net/guard.py``: the byte, connection and descriptor limits, over the accepted connections
  (``guard``) and over our DEALERs' own (``outbound``);
- ``gossip/net/loop.py``: the event-loop thread. ZeroMQ sockets are not thread-safe: every socket belongs to
  the loop, and the training thread hands messages over with ``post`` and ``offer`` and never touches one.

Why no socket has a receive high-water mark (RCVHWM = 0 on the ROUTER and on every DEALER): libzmq 4.3.5
(the one pyzmq bundles) aborts the process when a connection whose input that limit has stopped fails (the
sender resets it, or a guard cuts it): on the ROUTER once we read again and the resumed input answers a
ZMTP PING still unread in its buffer, on a DEALER (which never reads) at its next heartbeat (``Assertion
failed: !_io_error (src/stream_engine_base.cpp:310)``). A stranger did the first with 2 KB, a neighbour
that finished while we were four messages behind it did it in a test run, and a process listening at a
neighbour's address in its place did the second. What a connection may hold is bounded in bytes instead:
the inbound guard watches every accepted TCP connection's received bytes against what we took from it and
cuts one that holds more than ``recv_queue`` + 2 of our largest messages (that also covers one message of
endless frames, which no libzmq limit bounds), and caps the number of connections (``max_connections``;
the oldest that never sent a valid message goes); the outbound guard allows our DEALERs' connections
nothing beyond the handshake and the answers to our heartbeats.

Descriptors: ``start`` raises the soft open-file limit to the hard one and holds the descriptors the
guards' duplicates will live in (``gossip/net/guard.py``); a limit too low for the peer's own reserve and
the connections allowed gives one warning at start.

Supervision: every task on the loop (receive, one send task and one link watcher per destination, the
guards' check) is supervised: the first that dies of a bug sets ``failure``, wakes a ``post`` waiting for
room, and calls ``on_failure``, after which the mailbox's waits raise ``TransportError`` with the reason.

``zmq.ZMQError`` is translated into ``PeerUnreachable``; a message the handler rejects (``ProtocolError``)
is dropped and counted by reason, never raised. The wiring (``gossip/connect.py``) is apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from gossip.alloc import keep_freed_memory
from gossip.errors import PeerTimeout, PeerUnreachable, TransportError
from gossip.net.address import ipc_endpoint
from gossip.net.guard import CHECK_SECONDS, ConnectionGuard, DescriptorPool, raise_descriptor_limit, reserve_for
from gossip.net.loop import LoopThread
from gossip.net.outbox import Delivery, heartbeat_interval
from gossip.net.receiver import DRAIN_BATCH, Handler, Receiver
from gossip.net.security import CurveKeys
from gossip.net.sender import Sender
from gossip.net.wire import MAX_CHUNK_BYTES, MAX_HEADER_BYTES

__all__ = ["Delivery", "Handler", "Transport", "TransportConfig"]
log = logging.getLogger("gossip.net.transport")
OUTBOUND_CONNECTIONS = 1 << 16  # (never reached: one connection per DEALER; the guard's cap is for inbound ones)


@dataclass(frozen=True)
class TransportConfig:
    """How a transport behaves; ``gossip/connect.py`` derives one from the run's configuration."""

    queue_depth: int = 8  # messages queued per neighbour before a waiting post waits
    shutdown_timeout: float = 10.0  # what close() may spend delivering what is queued
    recv_queue: int = 256  # our largest messages one connection may hold in libzmq beyond one being assembled
    keys: CurveKeys | None = None  # CurveZMQ on every socket when set (gossip/net/security.py)
    delays: tuple[float, ...] = ()  # emulated one-way latency per destination, seconds
    heartbeat_timeout: float = 3.0  # a neighbour silent this long is disconnected (also ZeroMQ's TTL)
    ipc: bool = False  # reach neighbours announced on loopback over a Unix socket
    max_frame_bytes: int = MAX_CHUNK_BYTES  # the largest payload frame the protocol allows
    max_message_bytes: int = 0  # the largest message (0: unknown, a frame's worth)
    max_connections: int = 64  # accepted connections at most (the inbound guard)


class Transport:
    """Peer ``rank``'s network: owns the loop thread, the ZeroMQ context, the receiver, the sender (its
    outboxes), the two connection guards and the supervision of every task on the loop. ``on_link(dest, up)``
    hears of every connection made or lost to a destination; ``on_failure(exc)`` of a task of ours that
    died; ``on_closed(serial)`` of every inbound connection that closed (the handler is told each message's)."""

    def __init__(self, rank: int, bind: str, endpoints: Sequence[str], handler: Handler,
                 config: TransportConfig = TransportConfig(), *,
                 on_link: Callable[[int, bool], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_closed: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self.bind_endpoint = bind
        self.endpoints = list(endpoints)
        self._on_failure = on_failure
        self._shutdown_timeout = config.shutdown_timeout
        heartbeat_ms = int(config.heartbeat_timeout * 1000)
        # what one connection may hold in libzmq: its queue of complete messages and one being assembled
        largest = max(config.max_message_bytes, MAX_HEADER_BYTES) if config.max_message_bytes else MAX_CHUNK_BYTES
        self.guard = ConnectionGuard((config.recv_queue + 2) * largest, config.max_connections,
                                     heartbeat_interval(heartbeat_ms), on_closed)
        self.guard.reserve = reserve_for(len(self.endpoints))  # what a new inbound connection may not eat into
        # Our DEALERs' connections, watched the same way: a neighbour's ROUTER sends a DEALER nothing but
        # ZMTP commands, so nothing beyond the handshake and the answers to our heartbeats is allowed.
        self.outbound = ConnectionGuard(0, OUTBOUND_CONNECTIONS, heartbeat_interval(heartbeat_ms))
        ipc = config.ipc and zmq.has("ipc")
        local = ipc_endpoint(self.endpoints[rank]) if ipc and rank < len(self.endpoints) else None
        self._receiver = Receiver(rank, bind, handler, local=local, keys=config.keys, guard=self.guard,
                                  max_frame=min(config.max_frame_bytes, MAX_CHUNK_BYTES) + MAX_HEADER_BYTES)
        self._sender = Sender(rank, self.endpoints, depth=config.queue_depth, delays=config.delays,
                              heartbeat_timeout_ms=heartbeat_ms, keys=config.keys, ipc=ipc, guard=self.outbound,
                              on_link=on_link)
        self.routes = self._sender.stats.routes  # destination -> "ipc" or "tcp", once connected
        self.send_buffers = self._sender.stats.send_buffers  # destination -> bytes granted its Unix socket
        self._thread = LoopThread(f"gossip-loop-{rank}")
        self._context: zmq.asyncio.Context | None = None
        self._checks: asyncio.Task[None] | None = None  # the guards' periodic check
        self.failure: BaseException | None = None  # set when any task of ours dies of a bug
        self._failed: asyncio.Future[None] | None = None  # done once ``failure`` is set (wakes waiting posts)

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        keep_freed_memory()
        raise_descriptor_limit()
        self._thread.start()
        self._thread.run(self._open(), timeout, f"binding {self.bind_endpoint}")

    @property
    def started(self) -> bool:
        """Whether ``start`` ran and ``close`` has not: messages can be posted (even where the bind failed)."""
        return self._context is not None

    async def _open(self) -> None:
        self._hold_descriptors()
        self._context = zmq.asyncio.Context()
        loop = asyncio.get_running_loop()
        self._failed = loop.create_future()
        self._sender.open(self._context, self._note_failure)
        self._receiver.open(self._context, self._note_failure)
        self._checks = loop.create_task(self._check_forever())
        self._checks.add_done_callback(self._note_failure)

    def _hold_descriptors(self) -> None:
        """The descriptors the guards' duplicates will live in (``gossip/net/guard.py``): one per
        connection the inbound guard may watch and one more, one per destination and one more."""
        try:
            self.guard.pool = DescriptorPool(self.guard.max_connections + 1)
            self.outbound.pool = DescriptorPool(len(self.endpoints) + 1)
        except OSError as exc:
            if self.guard.pool is not None:
                self.guard.pool.close()
                self.guard.pool = None
            raise PeerUnreachable(f"peer {self.rank} cannot hold the descriptors its connections need: "
                                  f"{exc.strerror} (raise the open-file limit, ulimit -n)") from exc

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            self._receiver.drain_events(DRAIN_BATCH)
            self.guard.check()
            self.outbound.check()

    def close(self, flush_timeout: float | None = None) -> None:
        """Close every socket and stop the loop. First deliver what is queued for up to ``flush_timeout``
        seconds (default ``shutdown_timeout``; 0 drops it, after an error or a signal)."""
        flush_timeout = self._shutdown_timeout if flush_timeout is None else flush_timeout
        if self._context is None:
            self._thread.stop(self._shutdown_timeout)
            return
        try:
            self._thread.run(self._close(flush_timeout), flush_timeout + 5, "closing the sockets")
        except PeerTimeout:
            log.warning("peer %d: sockets did not close within %.0f s", self.rank, flush_timeout + 5)
        self._thread.stop(self._shutdown_timeout)

    async def _close(self, flush_timeout: float) -> None:
        linger = int(flush_timeout * 1000)
        try:
            if flush_timeout > 0:
                await asyncio.wait_for(self._sender.drain(), flush_timeout)
        except TimeoutError:
            linger = 0
            log.warning("peer %d: %d queued messages were not sent within %.0f s", self.rank,
                        self._sender.queued(), flush_timeout)
        if self._checks is not None:
            self._checks.cancel()
        self._sender.close(linger)
        self._receiver.close()
        for guard in (self.guard, self.outbound):
            guard.close()
            if guard.pool is not None:
                guard.pool.close()
                guard.pool = None
        context, self._context = self._context, None
        await asyncio.get_running_loop().run_in_executor(None, context.term)  # waits out the lingering DEALERs

    # -- sending ---------------------------------------------------------------------------------------
    def post(self, dests: Sequence[int], frames: list[Any], *, latest_only: bool, timeout: float,
             track: bool = False) -> Delivery | None:
        """Queue ``frames`` for every rank in ``dests`` (one hand-over to the loop for all of them).

        ``latest_only`` replaces a queued, unsent message instead of waiting; otherwise wait up to
        ``timeout`` seconds for room in each queue (PeerTimeout naming the peer after that). ``track``
        (not with ``latest_only``): return a ``Delivery`` that tells when ZeroMQ has let go of the frames'
        memory, so the caller may write to it again."""
        self.raise_if_failed()
        sender = self._sender
        if latest_only:
            sender.claim(dests, room=False)
            self._thread.call_soon(sender.put_latest, dests, frames)
            return None
        delivery = Delivery(len(dests)) if track else None
        if sender.claim(dests, room=True):  # no wait: hand it over without waiting for the loop to take it
            self._thread.call_soon(sender.put_claimed, dests, frames, delivery, time.monotonic())
            return delivery
        if not self._thread.run(sender.put_waiting(dests, frames, delivery, self._failed), timeout,
                                f"queueing a message for peer(s) {', '.join(map(str, dests))}"):
            self.raise_if_failed()  # a task of ours died while this post waited for room
        return delivery

    def offer(self, dests: Sequence[int], frames: list[Any], timeout: float) -> list[int]:
        """Queue ``frames`` for each rank in ``dests`` whose queue is empty (its previous message is already
        with ZeroMQ), never waiting for room; returns the ranks it queued for. Push-sum gossip keeps the
        mass of a message it could not queue, where replacing an unsent message would lose that one's."""
        self.raise_if_failed()
        return self._thread.run(self._sender.offer(dests, frames), timeout, "offering a message to the event loop")

    def forget(self, dest: int) -> None:
        """Stop sending to ``dest`` (a neighbour declared dead): drop what is queued for it and close its
        socket at once. A later ``post`` to it connects afresh (a restarted neighbour)."""
        self._thread.call_soon(self._sender.forget, dest)

    # -- supervision and statistics --------------------------------------------------------------------
    def _note_failure(self, task: asyncio.Task[None]) -> None:
        """Every task of ours is supervised: the first that dies of a bug fails the transport, wakes a post
        waiting for room, and tells the owner (``on_failure``), whose waits then raise with the reason."""
        if task.cancelled() or task.exception() is None or self.failure is not None:
            return
        self.failure = task.exception()
        log.error("peer %d: a transport task died: %r", self.rank, self.failure)
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(None)
        if self._on_failure is not None:
            self._on_failure(self.failure)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TransportError(f"peer {self.rank}'s transport failed: {self.failure!r}") from self.failure

    def statistics(self) -> dict[str, Any]:
        sent, received = self._sender.stats, self._receiver
        return {"bytes_sent": sent.bytes_sent, "bytes_received": received.bytes_received,
                "messages_sent": sent.messages_sent, "messages_received": received.messages_received,
                "replaced": sent.replaced,
                "dropped": {**(sent.dropped + received.dropped),
                            **{f"cut-{reason}": n for reason, n in self.guard.cut.items()},
                            **{f"cut-outbound-{reason}": n for reason, n in self.outbound.cut.items()}},
                "routes": {str(dest): route for dest, route in sorted(self.routes.items())},
                "send_buffers": {str(dest): size for dest, size in sorted(self.send_buffers.items())}}
