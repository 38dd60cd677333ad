"""One destination's side of sending: its DEALER, the queue in front of it, the task that sends, the watch on
its connection, emulated latency, and the ``Delivery`` that tells a posting thread when ZeroMQ has let go of
a message's memory. Which messages enter the queue, and how, is ``gossip/net/sender.py``'s business.

DEALER options, deliberately:
- SNDHWM = 2: at most two whole messages wait inside libzmq per destination (HWM counts whole multipart
  messages); beyond that the outbox's own bounded queue decides.
- RCVHWM = 0 and MAXMSGSIZE ``MAX_HEADER_BYTES``: a neighbour's ROUTER sends a DEALER nothing but ZMTP
  commands (the handshake, answers to our heartbeats), and no count of queued messages may stop a
  connection's input (``gossip/net/transport.py`` says why). What a DEALER's connection may hold is bounded
  in bytes instead, by the outbound guard (``gossip/net/guard.py``): nothing beyond the handshake and the
  answers to our heartbeats, so a process at a neighbour's address in its place cannot make a DEALER, which
  never reads, hold what it streams.
- HEARTBEAT_IVL 1 s (less when ``heartbeat_timeout`` is shorter), HEARTBEAT_TIMEOUT and HEARTBEAT_TTL
  ``heartbeat_timeout``: a neighbour whose host vanished without closing its connections is disconnected
  like one whose process died (the kernel closes a dead process's connections at once).
- RECONNECT_IVL 100 ms, at most 500 ms: a peer that starts late is found within 0.5 s.
- LINGER = 0, except that on close the DEALERs linger up to ``shutdown_timeout`` so the final round reaches
  neighbours that are still waiting for it.

Links: a monitor on each DEALER, attached before its connect, reports ``on_link(dest, up)``: down on
EVENT_DISCONNECTED, up on EVENT_HANDSHAKE_SUCCEEDED (a TCP connect to a stopped process succeeds in the
kernel; only a completed ZMTP handshake shows a live peer). What a disconnection means (a crash, or a
neighbour that finished) is the mailbox's business. The same monitor names each connection's descriptor
(EVENT_CONNECTED): for the outbound guard, and on a Unix socket to give it a send buffer that holds a small
model's whole message (``gossip/net/sendbuffer.py``).

Emulated latency (``delay``, seconds): each message is held in its outbox until its post time plus the
delay, then sent; messages stay in order and pipelined (a second message does not wait for the first one's
delay). This is latency added by the application in front of the socket, not by the kernel: TCP itself sees
no longer round-trip time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gossip.errors import PeerUnreachable
from gossip.net.address import dials
from gossip.net.guard import ConnectionGuard
from gossip.net.security import CurveKeys, secure_dealer
from gossip.net.sendbuffer import enlarge_send_buffer
from gossip.net.sockets import open_socket
from gossip.net.wire import MAX_HEADER_BYTES

log = logging.getLogger("gossip.net.outbox")
# A queued message: (its post time, its frames, whether a newer snapshot may replace it, its Delivery or None)
Item = tuple[float, list[Any], bool, "Delivery | None"]


@dataclass
class SendStats:
    """What the outboxes of one transport sent, replaced and dropped, and how each destination is reached."""

    messages_sent: int = 0
    bytes_sent: int = 0
    replaced: int = 0  # unsent snapshots a newer one replaced (``latest_only``)
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> messages lost
    routes: dict[int, str] = field(default_factory=dict)  # destination -> "ipc" or "tcp", once connected
    send_buffers: dict[int, int] = field(default_factory=dict)  # destination -> bytes granted its Unix socket


class Outbox:
    """Owns one destination's DEALER and its monitor, the bounded queue of messages waiting for it, the task
    that sends them (each once its emulated latency has passed) and the task that watches its connection
    (links up and down, the connection's descriptor for the outbound guard, a Unix socket's send buffer).
    ``open`` connects and starts both tasks, ``close`` cancels them and closes the sockets."""

    def __init__(self, dest: int, socket: zmq.asyncio.Socket, address: str, *, local: bool, delay: float,
                 depth: int, rank: int, stats: SendStats, guard: ConnectionGuard,
                 on_link: Callable[[int, bool], None] | None) -> None:
        self.dest = dest
        self.socket = socket
        self.ready = zmq.Socket.shadow(socket.underlying)  # the same socket, for sends that need no wait
        self.address = address  # what it connects to
        self.local = local  # over a Unix socket
        self.delay = delay
        self.queue: asyncio.Queue[Item] = asyncio.Queue(depth)
        self.watched: tuple[int, int] | None = None  # (descriptor, serial) of its connection in the guard
        self.task: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self._rank = rank
        self._stats = stats
        self._guard = guard
        self._on_link = on_link
        # The monitor goes on before the connect: a handshake completed before it would never be reported,
        # and the mailbox would take a link it never saw up for none (a hello in that neighbour's name
        # would then be believed as a restart).
        self.monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                 | (zmq.EVENT_HANDSHAKE_SUCCEEDED if on_link else 0))

    def open(self, supervise: Callable[[asyncio.Task[None]], None]) -> None:
        """Connect, and start the send and watch tasks (each supervised: ``supervise`` hears of its end)."""
        try:
            self.socket.connect(self.address)
        except zmq.ZMQError as exc:
            self.close(0)
            raise PeerUnreachable(f"cannot connect to peer {self.dest} at {self.address}: {exc.strerror}") from exc
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self._send_forever())
        self.task.add_done_callback(supervise)
        self.watcher = loop.create_task(self._watch_link())
        self.watcher.add_done_callback(supervise)

    async def _send_forever(self) -> None:
        queue, delay, stats = self.queue, self.delay, self._stats
        while True:
            posted, frames, _, delivery = await queue.get()
            tracker = None
            try:
                while (hold := posted + delay - time.monotonic()) > 0:  # (uvloop's timers may fire up to 1 ms early)
                    await asyncio.sleep(hold)
                tracker = await _send(self, frames, track=delivery is not None)
                stats.messages_sent += 1
                stats.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            except zmq.ZMQError as exc:  # the message is lost; the receiver's round timeout will say so
                stats.dropped["send-error"] += 1
                log.warning("peer %d could not send to peer %d: %s", self._rank, self.dest, exc)
            finally:
                settle(delivery, tracker)  # (cancelled before the send: ZeroMQ never saw the frames)
                queue.task_done()

    async def _watch_link(self) -> None:
        while True:
            message = parse_monitor_message(await self.monitor.recv_multipart())
            event, fd = message["event"], int(message["value"])
            if event == zmq.EVENT_CONNECTED:
                self._unwatch()
                # (the event can come after libzmq closed the descriptor and its number went to another
                # connection: only one to the neighbour's address is watched as this one's)
                self._guard.accepted(fd, lambda sock: dials(sock, self.address))
                serial = self._guard.serial(fd)
                self.watched = (fd, serial) if serial is not None else None
                if self.local:
                    granted = enlarge_send_buffer(fd)
                    if granted is not None:
                        self._stats.send_buffers[self.dest] = granted
                continue
            if event == zmq.EVENT_DISCONNECTED:
                self._unwatch()
            if self._on_link is not None:
                self._on_link(self.dest, event == zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def _unwatch(self) -> None:
        """Stop watching the connection the guard watches for this outbox (if still that one)."""
        if self.watched is not None:
            fd, serial = self.watched
            if self._guard.serial(fd) == serial:
                self._guard.closed(fd)
            self.watched = None

    def abandon(self) -> None:
        """Drop what is queued (each delivery settled unsent), stop watching the connection, close at once."""
        while not self.queue.empty():
            settle(self.queue.get_nowait()[3], None)
            self.queue.task_done()
        self._unwatch()
        self.close(0)

    def close(self, linger: int) -> None:
        for task in (self.task, self.watcher):
            if task is not None:
                task.cancel()
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=linger)


def open_dealer(context: zmq.asyncio.Context, rank: int, dest: int, heartbeat_timeout_ms: int,
                keys: CurveKeys | None) -> zmq.asyncio.Socket:
    """A DEALER to ``dest`` with the options above, not yet connected."""
    socket = open_socket(context, zmq.DEALER, rank, f"send to peer {dest}")
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 2)
    socket.setsockopt(zmq.RECONNECT_IVL, 100)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, 500)  # a peer that starts late is found within 0.5 s
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval(heartbeat_timeout_ms) * 1000))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
    socket.setsockopt(zmq.HEARTBEAT_TTL, heartbeat_timeout_ms)
    # a neighbour's ROUTER sends us nothing but ZMTP commands (the handshake, answers to our heartbeats); no
    # count limit may stop the input: a process listening at the neighbour's address in its place could then
    # abort libzmq 4.3.5 at our next heartbeat (``gossip/net/transport.py``)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)
    socket.setsockopt(zmq.RCVHWM, 0)
    if keys is not None:
        secure_dealer(socket, keys, dest)
    return socket


def heartbeat_interval(heartbeat_timeout_ms: int) -> float:
    """Every DEALER's heartbeat interval, in seconds; the peers of a run share ``heartbeat_timeout``."""
    return max(1, min(1000, heartbeat_timeout_ms)) / 1000


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


def settle(delivery: Delivery | None, tracker: zmq.MessageTracker | None) -> None:
    """Count one destination of ``delivery`` (if any) as done: sent under ``tracker``, or never sent (None)."""
    if delivery is not None:
        delivery.settle(tracker)


async def _send(outbox: Outbox, frames: list[Any], track: bool) -> zmq.MessageTracker | None:
    """Hand ``frames`` to ZeroMQ: at once when it has room (without a future per call), else once it has."""
    try:
        return outbox.ready.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
    except zmq.Again:
        return await outbox.socket.send_multipart(frames, copy=False, track=track)
