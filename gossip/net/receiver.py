"""The receiving side of a transport: one ROUTER, bound on the peer's endpoint (and, with ``ipc``, on the
Unix socket of its own announced endpoint), takes every message from everyone and hands it to the handler.

ROUTER options, deliberately:
- ROUTER_MANDATORY: a ROUTER silently drops what it cannot route; we want an error instead.
- No routing ids of our choosing: our ROUTERs only receive, so ZeroMQ's random ids do; a chosen id could
  be claimed by a second connection and cut the first off. Who sent a message is the CURVE key that
  authenticated its connection (``--secure``), or else only what its header claims.
- RCVHWM = 0: no count of queued messages stops a connection's input (``gossip/net/transport.py`` says
  why); the inbound guard (``gossip/net/guard.py``) bounds what each connection may hold in bytes, and caps
  the number of connections.
- MAXMSGSIZE: the largest frame our model's layout has, plus the header's limit, so a sender of an
  oversized frame is disconnected before it is read.
- HANDSHAKE_IVL: a connection that has not completed its handshake (CURVE included) within
  ``HANDSHAKE_SECONDS`` is closed, so an unauthenticated one cannot hold a descriptor for long.
- LINGER = 0.

Connections: a monitor on the ROUTER, attached before the bind, reports every accepted and closed
connection; the events go to the inbound guard as libzmq reports them (a reader on the monitor,
``DRAIN_BATCH`` at a time), and the guard cuts a new connection at once when fewer free descriptors are
left than the peer keeps for itself (``reserve_for``). No ZeroMQ option caps accepted connections or makes
room for the process's own descriptors (``BACKLOG`` bounds only those not yet accepted), so this is done
from outside libzmq, as the byte limit is. Each message is handed over with the serial of the connection
it came on, which the guard names (``SRCFD``).

A message the handler rejects (``ProtocolError``) is dropped, counted by reason and logged with the
sender's name; it never propagates.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gossip.errors import PeerUnreachable, ProtocolError
from gossip.net.guard import ConnectionGuard, free_descriptors
from gossip.net.security import CurveKeys, secure_router, start_authenticator
from gossip.net.sockets import open_socket

log = logging.getLogger("gossip.net.receiver")
# (authenticated sender rank or None, frames, serial of the inbound connection or None)
Handler = Callable[[int | None, Sequence[Any], int | None], None]
_WARN_FIRST = 5  # warnings per drop reason before we only warn on every 1000th
HANDSHAKE_SECONDS = 5.0
DRAIN_BATCH = 64  # connection events handled per turn of the event loop when they come on their own


class Receiver:
    """Owns the ROUTER and its monitor, the ZAP authenticator (``keys``), the receive task, and what the
    inbound guard (``guard``, the transport's) hears of accepted connections: their accept and close events
    and the bytes taken from each. Counts the messages and bytes it received and the messages it dropped."""

    def __init__(self, rank: int, bind: str, handler: Handler, *, local: str | None, keys: CurveKeys | None,
                 max_frame: int, guard: ConnectionGuard) -> None:
        self.rank = rank
        self.bind_endpoint = bind
        self.local_endpoint = local  # the Unix socket it also listens on, or None
        self.guard = guard
        self.messages_received = self.bytes_received = 0
        self.dropped: Counter[str] = Counter()  # reason -> messages the handler rejected
        self._handler = handler
        self._keys = keys
        self._max_frame = max_frame
        self._authenticator = None
        self._router: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_events: zmq.Socket | None = None  # the same socket, read without the event loop's help
        self._task: asyncio.Task[None] | None = None
        self._router_fd: int | None = None  # watched by the receive task
        self._monitor_fd: int | None = None  # the ROUTER's connection events, watched for the guard

    def open(self, context: zmq.asyncio.Context, supervise: Callable[[asyncio.Task[None]], None]) -> None:
        """Bind, and start the receive task (supervised by ``supervise``); PeerUnreachable when a bind fails."""
        router = open_socket(context, zmq.ROUTER, self.rank, "listen")
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.RCVHWM, 0)  # the guard bounds it in bytes (module docstring: why no count)
        router.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
        if self._keys is not None:
            self._authenticator = start_authenticator(context, self._keys)
            secure_router(router, self._keys)
        # the monitor before the bind: a connection accepted first would be unknown to the guard
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        for endpoint, if_taken in ((self.bind_endpoint, "another run may hold it: choose another --base-port"),
                                   (self.local_endpoint,
                                    "another process here announces the same endpoint, or pass --no-ipc")):
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
        loop.add_reader(self._monitor_fd, self.drain_events, DRAIN_BATCH)
        self._warn_if_few_descriptors()
        self._task = loop.create_task(self._receive_forever(router))
        self._task.add_done_callback(supervise)

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
        serial = self.guard.serial(fd)
        if serial is None:  # its accept event is queued already (sent before any message)
            self.drain_events()
            serial = self.guard.serial(fd)
        try:
            self._handler(self._authenticated(identity), frames, serial)
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
        if self._keys is None:
            return None
        rank = self._keys.rank_of(identity.get("User-Id") or "")
        if rank is None:
            raise ProtocolError("unknown-key", "a connection authenticated with a key that is no rank of this run")
        return rank

    def _sender_name(self, identity: zmq.Frame) -> str:
        rank = self._keys.rank_of(identity.get("User-Id") or "") if self._keys is not None else None
        return f"peer {rank}" if rank is not None else f"connection {identity.bytes.hex()}"

    def drain_events(self, batch: int | None = None) -> None:
        """Hand the ROUTER's queued connection events (accepted, closed) to the guard, in order, without
        waiting. ZeroMQ queues a connection's accept event before any of its messages can be read, so a
        message whose descriptor the guard does not know yet calls this first and then finds its
        connection named: a hello is never judged without knowing which connection it came on. The one
        reader of the monitor, so events are never handled out of order. ``batch``: handle at most that many
        and come back for the rest after the loop's other work (a flood of connections cannot starve it);
        the free descriptors are counted once per batch (``ConnectionGuard.look``)."""
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
            asyncio.get_running_loop().call_soon(self.drain_events, batch)

    def close(self) -> None:
        """Stop receiving, close the ROUTER and its monitor, stop the authenticator (on the loop)."""
        if self._task is not None:
            self._task.cancel()
        loop = asyncio.get_running_loop()
        if self._router_fd is not None:
            loop.remove_reader(self._router_fd)
        if self._monitor_fd is not None:
            loop.remove_reader(self._monitor_fd)
            self._monitor_fd = None  # (a batch still scheduled finds it so and returns)
        if self._router is not None:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
            self._router.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
