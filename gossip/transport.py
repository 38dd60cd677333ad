"""The only module that imports ``zmq``: sockets, queues and timeouts for one peer.

One ROUTER is bound on the peer's endpoint and receives from everyone; one DEALER per destination is
connected lazily and sends. Every socket belongs to the ``LoopThread`` (ZeroMQ sockets are not
thread-safe); the training thread hands over messages with ``post`` and never touches a socket.

Socket options, deliberately:
- ROUTER_MANDATORY: a ROUTER silently drops what it cannot route; we want an error instead.
- ROUTER_HANDOVER: a restarted peer reconnecting under its old identity takes over the old connection.
- SNDHWM = 2 per DEALER: at most two whole messages wait inside libzmq per neighbour (HWM counts whole
  multipart messages); beyond that our own bounded per-neighbour queue decides: sync sends wait (up to
  ``send_timeout``), async sends replace the stale queued snapshot.
- RCVHWM bounds what a flood can park in libzmq; MAXMSGSIZE disconnects a sender of an oversized frame.
- LINGER = 0 everywhere, except that on close the DEALERs linger up to ``shutdown_timeout`` so the final
  round reaches neighbours that are still waiting for it.

``zmq.ZMQError`` is translated into ``PeerUnreachable`` here; a message the handler rejects
(``ProtocolError``) is dropped, counted by reason and logged with the sender's name; it never propagates.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from gossip.alloc import keep_freed_memory
from gossip.errors import PeerTimeout, PeerUnreachable, ProtocolError, TransportError
from gossip.loop import LoopThread
from gossip.wire import MAX_CHUNK_BYTES

log = logging.getLogger("gossip.transport")
Handler = Callable[[bytes, Sequence[Any]], None]  # (sender's routing id, frames after it)
_WARN_FIRST = 5  # warnings per drop reason before we only warn on every 1000th


class Transport:
    """Owns the loop thread and the sockets of peer ``rank``."""

    def __init__(self, rank: int, bind: str, endpoints: Sequence[str], handler: Handler, *,
                 queue_depth: int = 8, shutdown_timeout: float = 10.0, recv_queue: int = 256) -> None:
        self.rank = rank
        self.bind_endpoint = bind
        self.endpoints = list(endpoints)
        self._handler = handler
        self._queue_depth = queue_depth
        self._shutdown_timeout = shutdown_timeout
        self._recv_queue = recv_queue
        self._thread = LoopThread(f"gossip-loop-{rank}")
        self._outboxes: dict[int, _Outbox] = {}
        self._context: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None  # set when the receive task dies of a bug
        self.bytes_sent = self.bytes_received = self.messages_sent = self.messages_received = 0
        self.replaced = 0
        self.dropped: Counter[str] = Counter()

    # -- life cycle ------------------------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        keep_freed_memory()
        self._thread.start()
        self._thread.run(self._open(), timeout, f"binding {self.bind_endpoint}")

    async def _open(self) -> None:
        self._context = zmq.asyncio.Context()
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.setsockopt(zmq.RCVHWM, self._recv_queue)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_CHUNK_BYTES + 4096)
        try:
            router.bind(self.bind_endpoint)
        except zmq.ZMQError as exc:
            router.close(0)
            hint = "; another run may hold it: choose another --base-port" if exc.errno == zmq.EADDRINUSE else ""
            raise PeerUnreachable(f"peer {self.rank} cannot listen on {self.bind_endpoint}: {exc.strerror}{hint}") from exc
        self._router = router
        self._receiver = asyncio.get_running_loop().create_task(self._receive_forever(router))
        self._receiver.add_done_callback(self._note_failure)

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
        except asyncio.TimeoutError:
            linger = 0
            log.warning("peer %d: %d queued messages were not sent within %.0f s", self.rank,
                        sum(o.queue.qsize() for o in self._outboxes.values()), flush_timeout)
        if self._receiver is not None:
            self._receiver.cancel()
        for outbox in self._outboxes.values():
            outbox.task.cancel()
            outbox.socket.close(linger=linger)
        if self._router is not None:
            self._router.close(linger=0)
        context, self._context = self._context, None
        await asyncio.get_running_loop().run_in_executor(None, context.term)  # waits out the lingering DEALERs

    async def _drain(self) -> None:
        for outbox in list(self._outboxes.values()):
            await outbox.queue.join()

    # -- sending ---------------------------------------------------------------------------------------
    def post(self, dests: Sequence[int], frames: list[Any], *, latest_only: bool, timeout: float) -> None:
        """Queue ``frames`` for every rank in ``dests`` (one hand-over to the loop for all of them).

        ``latest_only`` replaces a queued, unsent message instead of waiting; otherwise wait up to
        ``timeout`` seconds for room in each queue (PeerTimeout naming the peer after that)."""
        self.raise_if_failed()
        if latest_only:
            self._thread.call_soon(self._post_latest, dests, frames)
        else:
            self._thread.run(self._post_wait(dests, frames), timeout,
                             f"queueing a message for peer(s) {', '.join(map(str, dests))}")

    def _post_latest(self, dests: Sequence[int], frames: list[Any]) -> None:
        for dest in dests:
            queue = self._outbox(dest).queue
            while not queue.empty():  # only the newest snapshot is worth sending
                queue.get_nowait()
                queue.task_done()
                self.replaced += 1
            queue.put_nowait(frames)

    async def _post_wait(self, dests: Sequence[int], frames: list[Any]) -> None:
        for dest in dests:
            await self._outbox(dest).queue.put(frames)

    def forget(self, dest: int) -> None:
        """Stop sending to ``dest`` (a neighbour given up as lost): drop what is queued for it and close its
        socket at once, so that nothing waits for it, not even close()."""
        self._thread.call_soon(self._forget, dest)

    def _forget(self, dest: int) -> None:
        outbox = self._outboxes.pop(dest, None)
        if outbox is None:
            return
        outbox.task.cancel()
        while not outbox.queue.empty():
            outbox.queue.get_nowait()
            outbox.queue.task_done()
        outbox.socket.close(linger=0)

    def _outbox(self, dest: int) -> _Outbox:
        outbox = self._outboxes.get(dest)
        if outbox is None:
            if not 0 <= dest < len(self.endpoints):
                raise PeerUnreachable(f"no endpoint for peer {dest}")
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, 2)
            socket.setsockopt(zmq.ROUTING_ID, str(self.rank).encode())
            socket.setsockopt(zmq.RECONNECT_IVL, 100)
            socket.setsockopt(zmq.RECONNECT_IVL_MAX, 500)  # a peer that starts late is found within 0.5 s
            socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
            try:
                socket.connect(self.endpoints[dest])
            except zmq.ZMQError as exc:
                socket.close(0)
                raise PeerUnreachable(f"cannot connect to peer {dest} at {self.endpoints[dest]}: {exc.strerror}") from exc
            outbox = _Outbox(dest, socket, asyncio.Queue(self._queue_depth))
            outbox.task = asyncio.get_running_loop().create_task(self._send_forever(outbox))
            self._outboxes[dest] = outbox
        return outbox

    async def _send_forever(self, outbox: _Outbox) -> None:
        while True:
            frames = await outbox.queue.get()
            try:
                await outbox.socket.send_multipart(frames, copy=False)
                self.messages_sent += 1
                self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            except zmq.ZMQError as exc:  # the message is lost; the receiver's round timeout will say so
                self.dropped["send-error"] += 1
                log.warning("peer %d could not send to peer %d: %s", self.rank, outbox.dest, exc)
            finally:
                outbox.queue.task_done()

    # -- receiving -------------------------------------------------------------------------------------
    async def _receive_forever(self, router: zmq.asyncio.Socket) -> None:
        while True:
            identity, *frames = await router.recv_multipart(copy=False)
            self.messages_received += 1
            self.bytes_received += sum(len(f) for f in frames)
            try:
                self._handler(identity.bytes, frames)
            except ProtocolError as exc:
                self.dropped[exc.reason] += 1
                count = self.dropped[exc.reason]
                if count <= _WARN_FIRST or count % 1000 == 0:
                    log.warning("peer %d dropped a message from %s (%s, %d so far): %s",
                                self.rank, sender_name(identity.bytes), exc.reason, count, exc)
            # A ready message makes ``await recv`` return without yielding; yield so that a flood of
            # incoming messages cannot starve our own sends.
            await asyncio.sleep(0)

    def _note_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()
            log.error("peer %d: the receive loop died: %r", self.rank, self.failure)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TransportError(f"peer {self.rank}'s receive loop failed: {self.failure!r}") from self.failure

    def statistics(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent, "messages_received": self.messages_received,
                "replaced": self.replaced, "dropped": dict(self.dropped)}


class _Outbox:
    def __init__(self, dest: int, socket: zmq.asyncio.Socket, queue: asyncio.Queue[list[Any]]) -> None:
        self.dest = dest
        self.socket = socket
        self.queue = queue
        self.task: asyncio.Task[None] | None = None


def sender_name(identity: bytes) -> str:
    text = identity.decode("ascii", "replace")
    return f"peer {text}" if text.isdigit() and len(text) < 8 else f"unknown sender {identity[:16]!r}"
