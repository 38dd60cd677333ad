"""The transport layer (this module and ``security.py`` are the only ones that import ``zmq``): sockets,
queues and timeouts for one peer.

One ROUTER is bound on the peer's endpoint and receives from everyone; one DEALER per destination is
connected lazily and sends. Every socket belongs to the ``LoopThread`` (ZeroMQ sockets are not
thread-safe); the training thread hands over messages with ``post`` and never touches a socket. A post
that finds room in the queue of every destination hands its message over without waiting for the loop
(``_claim_room``: a blocking round trip between the threads per round was measurable in a small model's
round); one that finds a queue full waits for the loop, up to its timeout.

Socket options, deliberately:
- ROUTER_MANDATORY: a ROUTER silently drops what it cannot route; we want an error instead.
- No routing ids of our choosing: our ROUTERs only receive, so ZeroMQ's random ids do; a chosen id could
  be claimed by a second connection and cut the first off. Who sent a message is the CURVE key that
  authenticated its connection (``--secure``), or else only what its header claims.
- SNDHWM = 2 per DEALER: at most two whole messages wait inside libzmq per neighbour (HWM counts whole
  multipart messages); beyond that our own bounded per-neighbour queue decides: sync sends wait (up to
  ``send_timeout``); under gossip-async's latest rule a send replaces the stale queued snapshot, while
  push-sum offers a message only where there is room (``offer``) and never replaces one, which would lose
  its mass.
- RCVHWM = 0 on the ROUTER and on every DEALER: no count of queued messages stops a connection's input.
  libzmq 4.3.5 (the one pyzmq bundles) aborts the process when a connection whose input that limit has
  stopped fails (the sender resets it, or the guard below cuts it): on the ROUTER once we read again and
  the resumed input answers a ZMTP PING still unread in its buffer, on a DEALER (which never reads) at its
  next heartbeat (``Assertion failed: !_io_error (src/stream_engine_base.cpp:310)``). A stranger did the
  first with 2 KB, a neighbour that finished while we were four messages behind it did it in a test run,
  and a process listening at a neighbour's address in its place did the second. What a connection may
  hold is bounded in bytes instead: ``gossip/net/inbound.py`` watches every accepted TCP connection's
  received bytes against what we took from it and cuts one that holds more than ``recv_queue`` + 2 of our
  largest messages (that also covers one message of endless frames, which no libzmq limit bounds), and
  caps the number of connections (``max_connections``; the oldest that never sent a valid message goes).
  A second guard (``outbound``) watches our DEALERs' connections the same way, allowing nothing beyond the
  handshake and the answers to our heartbeats, so a process at a neighbour's address in its place cannot
  make a DEALER, which never reads, hold what it streams.
- MAXMSGSIZE: on the ROUTER the largest frame our model's layout has, plus the header's limit, so a sender
  of an oversized frame is disconnected before it is read; on a DEALER ``MAX_HEADER_BYTES``, as a
  neighbour's ROUTER sends it ZMTP commands only.
- HANDSHAKE_IVL: a connection that has not completed its handshake (CURVE included) within
  ``HANDSHAKE_SECONDS`` is closed, so an unauthenticated one cannot hold a descriptor for long.
- LINGER = 0 everywhere, except that on close the DEALERs linger up to ``shutdown_timeout`` so the final
  round reaches neighbours that are still waiting for it.

Descriptors: ``start`` raises the soft open-file limit to the hard one and holds the descriptors the
guards' duplicates will live in (``gossip/net/inbound.py``); the ROUTER's accept events go to the guard as
libzmq reports them (a reader on the monitor, ``DRAIN_BATCH`` at a time), which cuts a new connection at
once when fewer free descriptors are left than the peer keeps for itself (``reserve_for``: its DEALERs and
their monitors, its files). No ZeroMQ option caps accepted connections or makes room for the process's
own descriptors (``BACKLOG`` bounds only those not yet accepted), so this is done from outside libzmq, as
the byte limit is. A limit too low for the reserve and the connections allowed gives one warning at start.

Liveness: every DEALER sends ZeroMQ heartbeats (HEARTBEAT_IVL 1 s; HEARTBEAT_TIMEOUT ``heartbeat_timeout``),
so a neighbour whose host vanished without closing its connections is disconnected like one whose process
died (the kernel closes a dead process's connections at once). A monitor on each DEALER reports
``on_link(dest, up)``: down on EVENT_DISCONNECTED, up on EVENT_HANDSHAKE_SUCCEEDED (a TCP connect to a
stopped process succeeds in the kernel; only a completed ZMTP handshake shows a live peer). What a
disconnection means (a crash, or a neighbour that finished) is the mailbox's business. ``forget(dest)``
drops a neighbour declared dead: its queue, its socket and its monitor, so nothing waits for it.

Same host (``ipc``): the ROUTER also listens on ``ipc_endpoint`` of the peer's own endpoint, and a DEALER
to a neighbour announced on loopback connects there (``gossip/net/address.py`` says why only loopback);
``routes`` records which transport each destination got. Each such connection gets a send buffer that
holds a small model's whole message (``gossip/net/sendbuffer.py``; ``send_buffers`` records what the
kernel granted).

Emulated latency (``delays``, seconds per destination): each message is held in its outbox until its
post time plus the delay, then sent; messages stay in order and pipelined (a second message does not wait
for the first one's delay). This is latency added by the application in front of the socket, not by the
kernel: TCP itself sees no longer round-trip time.

``zmq.ZMQError`` is translated into ``PeerUnreachable`` here; a message the handler rejects
(``ProtocolError``) is dropped, counted by reason and logged with the sender's name; it never propagates.

One class owns every socket of the process on one event loop (ZeroMQ sockets are not thread-safe); the
inbound guard (``gossip/net/inbound.py``), the loop thread (``gossip/net/loop.py``) and the wiring
(``gossip/connect.py``) are apart.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gossip.alloc import keep_freed_memory
from gossip.errors import PeerTimeout, PeerUnreachable, ProtocolError, TransportError
from gossip.net.address import dials, ipc_endpoint
from gossip.net.inbound import CHECK_SECONDS, DescriptorPool, InboundGuard, free_descriptors, reserve_for
from gossip.net.loop import LoopThread
from gossip.net.security import CurveKeys, secure_dealer, secure_router, start_authenticator
from gossip.net.sendbuffer import enlarge_send_buffer
from gossip.net.wire import MAX_CHUNK_BYTES, MAX_HEADER_BYTES

log = logging.getLogger("gossip.net.transport")
# (authenticated sender rank or None, frames, serial of the inbound connection or None)
Handler = Callable[[int | None, Sequence[Any], int | None], None]
_WARN_FIRST = 5  # warnings per drop reason before we only warn on every 1000th
HANDSHAKE_SECONDS = 5.0
DRAIN_BATCH = 64  # connection events handled per turn of the event loop when they come on their own
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
    """Owns the loop thread and the sockets of peer ``rank``. ``on_link(dest, up)`` hears of every
    connection made or lost to a destination; ``on_failure(exc)`` of a task of ours that died;
    ``on_closed(serial)`` of every inbound connection that closed (the handler is told each message's)."""

    def __init__(self, rank: int, bind: str, endpoints: Sequence[str], handler: Handler,
                 config: TransportConfig = TransportConfig(), *,
                 on_link: Callable[[int, bool], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None,
                 on_closed: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self._on_link = on_link
        self._on_failure = on_failure
        self._heartbeat_ms = int(config.heartbeat_timeout * 1000)
        self.keys = config.keys
        self._authenticator = None
        self.bind_endpoint = bind
        self.endpoints = list(endpoints)
        self._handler = handler
        self._queue_depth = config.queue_depth
        self._shutdown_timeout = config.shutdown_timeout
        self._max_frame = min(config.max_frame_bytes, MAX_CHUNK_BYTES) + MAX_HEADER_BYTES
        # what one connection may hold in libzmq: its queue of complete messages and one being assembled
        largest = max(config.max_message_bytes, MAX_HEADER_BYTES) if config.max_message_bytes else MAX_CHUNK_BYTES
        self.guard = InboundGuard((config.recv_queue + 2) * largest, config.max_connections,
                                  self._heartbeat_seconds(), on_closed)
        # Our DEALERs' connections, watched the same way: a neighbour's ROUTER sends a DEALER nothing but
        # ZMTP commands, so nothing beyond the handshake and the answers to our heartbeats is allowed.
        self.outbound = InboundGuard(0, OUTBOUND_CONNECTIONS, self._heartbeat_seconds())
        self.guard.reserve = reserve_for(len(self.endpoints))  # what a new inbound connection may not eat into
        self._guards: list[asyncio.Task[None]] = []
        self._delays = list(config.delays) or [0.0] * len(self.endpoints)
        self._ipc = config.ipc and zmq.has("ipc")
        self.routes: dict[int, str] = {}  # destination -> "ipc" or "tcp", once connected
        self.send_buffers: dict[int, int] = {}  # destination -> bytes the kernel granted its Unix socket
        self._thread = LoopThread(f"gossip-loop-{rank}")
        self._outboxes: dict[int, _Outbox] = {}
        # messages posted to each destination without waiting, and of those the loop has queued: each
        # counter has one writer (the posting threads under ``_posting``; the loop), so neither needs a lock
        self._posting = threading.Lock()
        self._posted: Counter[int] = Counter()
        self._queued: Counter[int] = Counter()
        self._waiting_puts: set[asyncio.Future[None]] = set()
        self._context: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_events: zmq.Socket | None = None  # the same socket, read without the event loop's help
        self._receiver: asyncio.Task[None] | None = None
        self._router_fd: int | None = None  # watched by the receive task
        self._monitor_fd: int | None = None  # the ROUTER's connection events, watched for the guard
        self.failure: BaseException | None = None  # set when any task of ours dies of a bug
        self._failed: asyncio.Future[None] | None = None  # done once ``failure`` is set (wakes waiting posts)
        self.bytes_sent = self.bytes_received = self.messages_sent = self.messages_received = 0
        self.replaced = 0
        self.dropped: Counter[str] = Counter()

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        keep_freed_memory()
        _raise_descriptor_limit()
        self._thread.start()
        self._thread.run(self._open(), timeout, f"binding {self.bind_endpoint}")

    @property
    def started(self) -> bool:
        """Whether ``start`` ran and ``close`` has not: messages can be posted (even where the bind failed)."""
        return self._context is not None

    async def _open(self) -> None:
        self._hold_descriptors()
        self._context = zmq.asyncio.Context()
        router = self._socket(zmq.ROUTER, "listen")
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.RCVHWM, 0)  # the guard bounds it in bytes (module docstring: why no count)
        router.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
        if self.keys is not None:
            self._authenticator = start_authenticator(self._context, self.keys)
            secure_router(router, self.keys)
        # the monitor before the bind: a connection accepted first would be unknown to the guard
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        own = ipc_endpoint(self.endpoints[self.rank]) if self._ipc and self.rank < len(self.endpoints) else None
        for endpoint, if_taken in ((self.bind_endpoint, "another run may hold it: choose another --base-port"),
                                   (own, "another process here announces the same endpoint, or pass --no-ipc")):
            if endpoint is None:
                continue
            try:
                router.bind(endpoint)
            except zmq.ZMQError as exc:
                router.disable_monitor()
                monitor.close(linger=0)
                router.close(0)
                hint = f"; {if_taken}" if exc.errno == zmq.EADDRINUSE else ""
                raise PeerUnreachable(f"peer {self.rank} cannot listen on {endpoint}: {exc.strerror}{hint}") from exc
        self._router = router
        loop = asyncio.get_running_loop()
        self._monitor = monitor
        self._monitor_events = zmq.Socket.shadow(monitor.underlying)
        # each accept goes to the guard as soon as libzmq reports it (the descriptor headroom is checked
        # there), not only at the guard's next check
        self._monitor_fd = self._monitor_events.FD
        loop.add_reader(self._monitor_fd, self._drain_inbound_events, DRAIN_BATCH)
        self._warn_if_few_descriptors()
        self._guards = [loop.create_task(self._guard_forever())]
        self._receiver = loop.create_task(self._receive_forever(router))
        self._failed = loop.create_future()
        for task in (self._receiver, *self._guards):
            task.add_done_callback(self._note_failure)

    def _hold_descriptors(self) -> None:
        """The descriptors the guards' duplicates will live in (``gossip/net/inbound.py``): one per
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

    def _warn_if_few_descriptors(self) -> None:
        """One warning when the open-file limit leaves fewer free descriptors than this peer keeps for
        itself plus one per inbound connection it allows: then even its neighbours' connections may be cut."""
        free = free_descriptors()
        needed = self.guard.reserve + self.guard.max_connections
        if free is not None and free < needed:
            log.warning("peer %d: only %d descriptors are free (open-file limit %d), fewer than the %d it keeps "
                        "for itself and its %d inbound connections; raise the limit (ulimit -n)", self.rank, free,
                        resource.getrlimit(resource.RLIMIT_NOFILE)[0], self.guard.reserve,
                        self.guard.max_connections)

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
                await asyncio.wait_for(self._drain(), flush_timeout)
        except TimeoutError:
            linger = 0
            log.warning("peer %d: %d queued messages were not sent within %.0f s", self.rank,
                        sum(o.queue.qsize() for o in self._outboxes.values()), flush_timeout)
        for task in (self._receiver, *self._guards):
            if task is not None:
                task.cancel()
        for outbox in self._outboxes.values():
            outbox.close(linger)
        if self._router_fd is not None:
            asyncio.get_running_loop().remove_reader(self._router_fd)
        if self._monitor_fd is not None:
            asyncio.get_running_loop().remove_reader(self._monitor_fd)
            self._monitor_fd = None  # (a batch still scheduled finds it so and returns)
        if self._router is not None:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._router.close(linger=0)
        self.guard.close()
        self.outbound.close()
        for guard in (self.guard, self.outbound):
            if guard.pool is not None:
                guard.pool.close()
                guard.pool = None
        if self._authenticator is not None:
            self._authenticator.stop()
        context, self._context = self._context, None
        await asyncio.get_running_loop().run_in_executor(None, context.term)  # waits out the lingering DEALERs

    async def _drain(self) -> None:
        for outbox in list(self._outboxes.values()):
            await outbox.queue.join()

    # -- sending ---------------------------------------------------------------------------------------
    def post(self, dests: Sequence[int], frames: list[Any], *, latest_only: bool, timeout: float,
             track: bool = False) -> Delivery | None:
        """Queue ``frames`` for every rank in ``dests`` (one hand-over to the loop for all of them).

        ``latest_only`` replaces a queued, unsent message instead of waiting; otherwise wait up to
        ``timeout`` seconds for room in each queue (PeerTimeout naming the peer after that). ``track``
        (not with ``latest_only``): return a ``Delivery`` that tells when ZeroMQ has let go of the frames'
        memory, so the caller may write to it again."""
        self.raise_if_failed()
        if latest_only:
            with self._posting:  # (it puts at most one message more in each queue)
                for dest in dests:
                    self._posted[dest] += 1
            self._thread.call_soon(self._post_latest, dests, frames)
            return None
        delivery = Delivery(len(dests)) if track else None
        if self._claim_room(dests):  # no wait: hand it over without waiting for the loop to take it
            self._thread.call_soon(self._post_claimed, dests, frames, delivery, time.monotonic())
            return delivery
        self._thread.run(self._post_wait(dests, frames, delivery), timeout,
                         f"queueing a message for peer(s) {', '.join(map(str, dests))}")
        return delivery

    def _claim_room(self, dests: Sequence[int]) -> bool:
        """On the posting thread: claim a place in the queue of every destination in ``dests`` if each has one,
        counting the messages posted to it that the loop has not queued yet. Every other put is a post
        counted here or one that finished queueing before its thread's post returned, so with one posting
        thread a claim is never wrong, at worst too cautious; without one the post waits for the loop."""
        with self._posting:
            for dest in dests:
                outbox = self._outboxes.get(dest)  # (a dict read is atomic; a new outbox is made on the loop)
                in_flight = self._posted[dest] - self._queued[dest]
                if outbox is None or outbox.queue.qsize() + in_flight >= self._queue_depth:
                    return False
            for dest in dests:
                self._posted[dest] += 1
            return True

    def _post_claimed(self, dests: Sequence[int], frames: list[Any], delivery: Delivery | None,
                      posted_at: float) -> None:
        for dest in dests:
            item = (posted_at + self._delays[dest], frames, False, delivery)
            try:
                queue = self._outbox(dest).queue  # (forgotten since the claim: connects afresh, as a post would)
            except PeerUnreachable as exc:
                self.dropped["send-error"] += 1
                log.warning("peer %d could not send to peer %d: %s", self.rank, dest, exc)
                _settle(delivery, None)
            else:
                if queue.full():  # (a waiting post of another thread took the place claimed: wait, lose nothing)
                    waiting = asyncio.ensure_future(queue.put(item))
                    self._waiting_puts.add(waiting)
                    waiting.add_done_callback(self._waiting_puts.discard)
                else:
                    queue.put_nowait(item)
            self._queued[dest] += 1

    def offer(self, dests: Sequence[int], frames: list[Any], timeout: float) -> list[int]:
        """Queue ``frames`` for each rank in ``dests`` whose queue is empty (its previous message is already
        with ZeroMQ), never waiting for room; returns the ranks it queued for. Push-sum gossip keeps the
        mass of a message it could not queue, where replacing an unsent message would lose that one's."""
        self.raise_if_failed()
        return self._thread.run(self._offer(dests, frames), timeout, "offering a message to the event loop")

    async def _offer(self, dests: Sequence[int], frames: list[Any]) -> list[int]:
        taken = []
        for dest in dests:
            queue = self._outbox(dest).queue
            if queue.empty():
                queue.put_nowait((time.monotonic() + self._delays[dest], frames, False, None))
                taken.append(dest)
        return taken

    def _post_latest(self, dests: Sequence[int], frames: list[Any]) -> None:
        for dest in dests:
            queue = self._outbox(dest).queue
            kept = []
            while not queue.empty():  # only the newest snapshot is worth sending; other messages stay
                item = queue.get_nowait()
                queue.task_done()
                if item[2]:
                    self.replaced += 1
                else:
                    kept.append(item)
            for item in kept[:queue.maxsize - 1]:  # (a flood of non-replaceable messages cannot fill it)
                queue.put_nowait(item)
            for item in kept[queue.maxsize - 1:]:
                _settle(item[3], None)
            queue.put_nowait((time.monotonic() + self._delays[dest], frames, True, None))
            self._queued[dest] += 1

    async def _post_wait(self, dests: Sequence[int], frames: list[Any], delivery: Delivery | None) -> None:
        queued = 0
        try:
            for dest in dests:
                queue = self._outbox(dest).queue
                item = (time.monotonic() + self._delays[dest], frames, False, delivery)
                if queue.full():  # wait for room, or for a task of ours to die (its queue may never drain)
                    put = asyncio.ensure_future(queue.put(item))
                    await asyncio.wait((put, self._failed), return_when=asyncio.FIRST_COMPLETED)
                    if not put.done():
                        put.cancel()
                        self.raise_if_failed()
                    put.result()
                else:
                    queue.put_nowait(item)
                queued += 1
        finally:
            for _ in range(len(dests) - queued):  # not queued (a timeout): ZeroMQ never saw these frames
                _settle(delivery, None)

    def forget(self, dest: int) -> None:
        """Stop sending to ``dest`` (a neighbour declared dead): drop what is queued for it and close its
        socket at once. A later ``post`` to it connects afresh (a restarted neighbour)."""
        self._thread.call_soon(self._forget, dest)

    def _forget(self, dest: int) -> None:
        outbox = self._outboxes.pop(dest, None)
        if outbox is not None:
            while not outbox.queue.empty():
                _settle(outbox.queue.get_nowait()[3], None)
                outbox.queue.task_done()
            self._unwatch(outbox)
            outbox.close(0)

    def _heartbeat_seconds(self) -> float:
        """Every DEALER's heartbeat interval; the peers of a run share ``heartbeat_timeout``."""
        return max(1, min(1000, self._heartbeat_ms)) / 1000

    def _outbox(self, dest: int) -> _Outbox:
        outbox = self._outboxes.get(dest)
        if outbox is None:
            if not 0 <= dest < len(self.endpoints):
                raise PeerUnreachable(f"no endpoint for peer {dest}")
            socket = self._socket(zmq.DEALER, f"send to peer {dest}")
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 2)
            socket.setsockopt(zmq.RECONNECT_IVL, 100)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, 500)  # a peer that starts late is found within 0.5 s
            socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
            socket.setsockopt(zmq.HEARTBEAT_IVL, int(self._heartbeat_seconds() * 1000))
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms)
            socket.setsockopt(zmq.HEARTBEAT_TTL, self._heartbeat_ms)
            # a neighbour's ROUTER sends us nothing but ZMTP commands (the handshake, answers to our
            # heartbeats); no count limit may stop the input: a process listening at the neighbour's
            # address in its place could then abort libzmq 4.3.5 at our next heartbeat (module docstring)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)
            socket.setsockopt(zmq.RCVHWM, 0)
            if self.keys is not None:
                secure_dealer(socket, self.keys, dest)
            local = ipc_endpoint(self.endpoints[dest]) if self._ipc else None
            address = local or self.endpoints[dest]
            # The monitor goes on before the connect: a handshake completed before it would never be
            # reported, and the mailbox would take a link it never saw up for none (a hello in that
            # neighbour's name would then be believed as a restart).
            # It also names each connection's descriptor: for the outbound guard, and on a Unix socket to
            # enlarge its send buffer.
            monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                | (zmq.EVENT_HANDSHAKE_SUCCEEDED if self._on_link else 0))
            outbox = _Outbox(dest, socket, asyncio.Queue(self._queue_depth), address, monitor)
            try:
                socket.connect(address)
            except zmq.ZMQError as exc:
                outbox.close(0)
                raise PeerUnreachable(f"cannot connect to peer {dest} at {address}: {exc.strerror}") from exc
            self.routes[dest] = "ipc" if local else "tcp"
            loop = asyncio.get_running_loop()
            outbox.task = loop.create_task(self._send_forever(outbox))
            outbox.task.add_done_callback(self._note_failure)
            outbox.watcher = loop.create_task(self._watch_link(outbox))
            outbox.watcher.add_done_callback(self._note_failure)
            self._outboxes[dest] = outbox
        return outbox

    async def _send_forever(self, outbox: _Outbox) -> None:
        while True:
            due, frames, _, delivery = await outbox.queue.get()
            tracker = None
            try:
                while (hold := due - time.monotonic()) > 0:  # (uvloop's timers may fire up to 1 ms early)
                    await asyncio.sleep(hold)
                tracker = await _send(outbox, frames, track=delivery is not None)
                self.messages_sent += 1
                self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            except zmq.ZMQError as exc:  # the message is lost; the receiver's round timeout will say so
                self.dropped["send-error"] += 1
                log.warning("peer %d could not send to peer %d: %s", self.rank, outbox.dest, exc)
            finally:
                _settle(delivery, tracker)  # (cancelled before the send: ZeroMQ never saw the frames)
                outbox.queue.task_done()

    async def _watch_link(self, outbox: _Outbox) -> None:
        while True:
            message = parse_monitor_message(await outbox.monitor.recv_multipart())
            event, fd = message["event"], int(message["value"])
            if event == zmq.EVENT_CONNECTED:
                self._unwatch(outbox)
                # (the event can come after libzmq closed the descriptor and its number went to another
                # connection: only one to the neighbour's address is watched as this one's)
                self.outbound.accepted(fd, lambda sock: dials(sock, outbox.address))
                serial = self.outbound.serial(fd)
                outbox.watched = (fd, serial) if serial is not None else None
                if self.routes.get(outbox.dest) == "ipc":
                    granted = enlarge_send_buffer(fd)
                    if granted is not None:
                        self.send_buffers[outbox.dest] = granted
                continue
            if event == zmq.EVENT_DISCONNECTED:
                self._unwatch(outbox)
            if self._on_link is not None:
                self._on_link(outbox.dest, event == zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def _unwatch(self, outbox: _Outbox) -> None:
        """Stop watching the connection the outbound guard watches for ``outbox`` (if still that one)."""
        if outbox.watched is not None:
            fd, serial = outbox.watched
            if self.outbound.serial(fd) == serial:
                self.outbound.closed(fd)
            outbox.watched = None

    def _socket(self, kind: int, purpose: str) -> zmq.asyncio.Socket:
        try:
            return self._context.socket(kind)
        except zmq.ZMQError as exc:  # EMFILE above all: every descriptor of the process is in use
            raise PeerUnreachable(f"peer {self.rank} cannot open a socket to {purpose}: {exc.strerror} "
                                  "(raise the open-file limit, ulimit -n)") from exc

    # -- receiving -------------------------------------------------------------------------------------
    async def _receive_forever(self, router: zmq.asyncio.Socket) -> None:
        """Take every message as it comes. The ROUTER is read through a plain (synchronous) handle on the
        same socket, and its descriptor watched directly: pyzmq's asyncio socket would cost a future and a
        round of event bookkeeping per message, a large part of a small model's round."""
        ready = zmq.Socket.shadow(router.underlying)
        readable = asyncio.Event()
        self._router_fd = ready.FD
        asyncio.get_running_loop().add_reader(self._router_fd, readable.set)
        while True:
            readable.clear()
            # ZeroMQ's descriptor signals changes, not readiness: reading EVENTS takes the pending ones and
            # re-arms it, so a message that came meanwhile is seen here, not missed until the next. (Asking
            # first also spares a failed read, and its exception, per message.)
            if not ready.get(zmq.EVENTS) & zmq.POLLIN:
                await readable.wait()
                continue
            try:
                message = ready.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # (we are its only reader; should it happen, let the loop run and ask again)
                await asyncio.sleep(0)
                continue
            self._take(message)
            # A ready message does not yield; yield so that a flood of incoming messages cannot starve our
            # own sends.
            await asyncio.sleep(0)

    def _take(self, message: list[zmq.Frame]) -> None:
        """Hand one received message to the handler; count it, or its drop by reason."""
        identity, *frames = message
        nbytes = sum(len(f) for f in frames)
        self.messages_received += 1
        self.bytes_received += nbytes
        valid = False
        fd = identity.get(zmq.SRCFD)
        if self.guard.serial(fd) is None:  # its accept event is queued already (sent before any message)
            self._drain_inbound_events()
        try:
            self._handler(self._authenticated(identity), frames, self.guard.serial(fd))
            valid = True
        except ProtocolError as exc:
            self.dropped[exc.reason] += 1
            count = self.dropped[exc.reason]
            if count <= _WARN_FIRST or count % 1000 == 0:
                log.warning("peer %d dropped a message from %s (%s, %d so far): %s",
                            self.rank, self._sender_name(identity), exc.reason, count, exc)
        self.guard.delivered(fd, nbytes + len(identity), len(frames) + 1, valid)

    def _authenticated(self, identity: zmq.Frame) -> int | None:
        """With CURVE, the rank whose key authenticated the connection (so a peer cannot claim another's
        rank); without, None: nothing but the message's own header says who sent it. A key that is no rank
        of this run never gets past the handshake; should one, its messages are dropped, never believed."""
        if self.keys is None:
            return None
        rank = self.keys.rank_of(identity.get("User-Id") or "")
        if rank is None:
            raise ProtocolError("unknown-key", "a connection authenticated with a key that is no rank of this run")
        return rank

    def _sender_name(self, identity: zmq.Frame) -> str:
        rank = self.keys.rank_of(identity.get("User-Id") or "") if self.keys is not None else None
        return f"peer {rank}" if rank is not None else f"connection {identity.bytes.hex()}"

    def _drain_inbound_events(self, batch: int | None = None) -> None:
        """Hand the ROUTER's queued connection events (accepted, closed) to the guard, in order, without
        waiting. ZeroMQ queues a connection's accept event before any of its messages can be read, so a
        message whose descriptor the guard does not know yet calls this first and then finds its
        connection named: a hello is never judged without knowing which connection it came on. The one
        reader of the monitor, so events are never handled out of order. ``batch``: handle at most that many
        and come back for the rest after the loop's other work (a flood of connections cannot starve it);
        the free descriptors are counted once per batch (``InboundGuard.look``)."""
        if batch is not None and self._monitor_fd is None:  # closed since this was scheduled
            return
        events = self._monitor_events  # (read plainly: no future per read, no exception once empty)
        taken = []
        while (batch is None or len(taken) < batch) and events.get(zmq.EVENTS) & zmq.POLLIN:
            taken.append(parse_monitor_message(events.recv_multipart(zmq.NOBLOCK)))
        if any(event["event"] == zmq.EVENT_ACCEPTED for event in taken):
            self.guard.look()
        try:
            for event in taken:
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self.guard.accepted(int(event["value"]))
                else:
                    self.guard.closed(int(event["value"]))
        finally:
            self.guard.done_looking()
        if batch is not None and len(taken) == batch:
            asyncio.get_running_loop().call_soon(self._drain_inbound_events, batch)

    async def _guard_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            self._drain_inbound_events(DRAIN_BATCH)
            self.guard.check()
            self.outbound.check()

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
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent, "messages_received": self.messages_received,
                "replaced": self.replaced,
                "dropped": {**self.dropped, **{f"cut-{reason}": n for reason, n in self.guard.cut.items()},
                            **{f"cut-outbound-{reason}": n for reason, n in self.outbound.cut.items()}},
                "routes": {str(dest): route for dest, route in sorted(self.routes.items())},
                "send_buffers": {str(dest): size for dest, size in sorted(self.send_buffers.items())}}


class Delivery:
    """One tracked ``post``, seen from the thread that posted it: ``wait`` returns True once ZeroMQ holds
    none of the frames any more (sent to every destination, or dropped), so their memory may change."""

    def __init__(self, count: int) -> None:
        self._cond = threading.Condition()
        self._unsettled = count  # destinations whose send has not been attempted yet
        self._trackers: list[zmq.MessageTracker] = []

    def settle(self, tracker: zmq.MessageTracker | None) -> None:
        with self._cond:
            if tracker is not None:
                self._trackers.append(tracker)
            self._unsettled -= 1
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._unsettled <= 0, timeout):
                return False
            trackers = list(self._trackers)
        try:
            for tracker in trackers:
                tracker.wait(max(0.0, deadline - time.monotonic()))
        except zmq.NotDone:
            return False
        return True


async def _send(outbox: _Outbox, frames: list[Any], track: bool) -> zmq.MessageTracker | None:
    """Hand ``frames`` to ZeroMQ: at once when it has room (without a future per call), else once it has."""
    try:
        return outbox.ready.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
    except zmq.Again:
        return await outbox.socket.send_multipart(frames, copy=False, track=track)


def _settle(delivery: Delivery | None, tracker: zmq.MessageTracker | None) -> None:
    if delivery is not None:
        delivery.settle(tracker)


class _Outbox:
    def __init__(self, dest: int, socket: zmq.asyncio.Socket,
                 queue: asyncio.Queue[tuple[float, list[Any], bool, Delivery | None]], address: str,
                 monitor: zmq.asyncio.Socket) -> None:
        self.dest = dest
        self.socket = socket
        self.address = address  # what it connects to
        self.watched: tuple[int, int] | None = None  # (descriptor, serial) of its connection in the outbound guard
        self.ready = zmq.Socket.shadow(socket.underlying)  # the same socket, for sends that need no wait
        self.queue = queue
        self.task: asyncio.Task[None] | None = None
        self.monitor = monitor  # its connection events (attached before the connect)
        self.watcher: asyncio.Task[None] | None = None

    def close(self, linger: int) -> None:
        for task in (self.task, self.watcher):
            if task is not None:
                task.cancel()
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=linger)



def _raise_descriptor_limit() -> None:
    """Every connection costs a descriptor, and the guards hold one per connection they may watch
    (``gossip/net/inbound.py``): use the hard limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ValueError, OSError):  # not allowed: the soft limit stays
        pass

