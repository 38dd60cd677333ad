"""Every outbox of one process, and the three ways a message enters them, one for each kind of algorithm:

- queued, waiting for room (synchronous and compressed gossip, the parameter-server modes, hellos, welcomes
  and byes): a post that finds room in the queue of every destination hands its message over without
  waiting for the loop (``claim``, then ``put_claimed``: a blocking round trip between the threads per round
  was measurable in a small model's round); one that finds a queue full waits for the loop, up to its
  timeout (``put_waiting``);
- replacing (gossip-async's latest rule, and an abort notice: ``put_latest``): a newer snapshot replaces the
  unsent one, and messages that may not be replaced stay;
- offered (push-sum, ``offer``): queued only where the destination's queue is empty, never replacing a
  message, which would lose its mass.

Outboxes are opened on the first message to their destination (a DEALER, over the Unix socket to a
neighbour announced on loopback when ``ipc`` is on: ``gossip/net/address.py`` says why only loopback) and
closed when it is forgotten (``forget``: a neighbour declared dead; a later message connects afresh).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import zmq.asyncio

from gossip.errors import PeerUnreachable
from gossip.net.address import ipc_endpoint
from gossip.net.guard import ConnectionGuard
from gossip.net.outbox import Delivery, Outbox, SendStats, open_dealer, settle
from gossip.net.security import CurveKeys

log = logging.getLogger("gossip.net.sender")


class Sender:
    """Owns the outboxes by destination (opened on first use, on the loop), the counts that let a posting
    thread claim room in their queues without the loop, and the ``SendStats`` they share. ``claim`` runs on
    a posting thread; every other method on the loop."""

    def __init__(self, rank: int, endpoints: Sequence[str], *, depth: int, delays: Sequence[float],
                 heartbeat_timeout_ms: int, keys: CurveKeys | None, ipc: bool, guard: ConnectionGuard,
                 on_link: Callable[[int, bool], None] | None) -> None:
        self.rank = rank
        self.endpoints = list(endpoints)
        self.stats = SendStats()
        self._depth = depth  # messages queued per destination before a waiting post waits
        self._delays = list(delays) or [0.0] * len(self.endpoints)
        self._heartbeat_ms = heartbeat_timeout_ms
        self._keys = keys
        self._ipc = ipc
        self._guard = guard  # the outbound guard, over every outbox's connection
        self._on_link = on_link
        self._context: zmq.asyncio.Context | None = None
        self._supervise: Callable[[asyncio.Task[None]], None] = lambda task: None
        self._outboxes: dict[int, Outbox] = {}
        # messages posted to each destination without waiting, and of those the loop has queued: each
        # counter has one writer (the posting threads under ``_posting``; the loop), so neither needs a lock
        self._posting = threading.Lock()
        self._posted: Counter[int] = Counter()
        self._queued: Counter[int] = Counter()
        self._waiting_puts: set[asyncio.Future[None]] = set()

    def open(self, context: zmq.asyncio.Context, supervise: Callable[[asyncio.Task[None]], None]) -> None:
        """Open outboxes in ``context`` from now on, their tasks supervised by ``supervise``."""
        self._context = context
        self._supervise = supervise

    def claim(self, dests: Sequence[int], room: bool) -> bool:
        """On the posting thread: count one message more posted to each of ``dests``. With ``room``, only if
        each has a place in its queue, counting the messages posted to it that the loop has not queued yet.
        Every other put is a post counted here or one that finished queueing before its thread's post
        returned, so with one posting thread a claim is never wrong, at worst too cautious; without one the
        post waits for the loop. Without ``room`` (a replacing post) it always counts: such a post adds at
        most one message to each queue."""
        with self._posting:
            if room:
                for dest in dests:
                    outbox = self._outboxes.get(dest)  # (a dict read is atomic; a new outbox is made on the loop)
                    in_flight = self._posted[dest] - self._queued[dest]
                    if outbox is None or outbox.queue.qsize() + in_flight >= self._depth:
                        return False
            for dest in dests:
                self._posted[dest] += 1
            return True

    def put_claimed(self, dests: Sequence[int], frames: list[Any], delivery: Delivery | None,
                    posted_at: float) -> None:
        item = (posted_at, frames, False, delivery)
        for dest in dests:
            try:
                queue = self._outbox(dest).queue  # (forgotten since the claim: connects afresh, as a post would)
            except PeerUnreachable as exc:
                self.stats.dropped["send-error"] += 1
                log.warning("peer %d could not send to peer %d: %s", self.rank, dest, exc)
                settle(delivery, None)
            else:
                if queue.full():  # (a waiting post of another thread took the place claimed: wait, lose nothing)
                    waiting = asyncio.ensure_future(queue.put(item))
                    self._waiting_puts.add(waiting)
                    waiting.add_done_callback(self._waiting_puts.discard)
                else:
                    queue.put_nowait(item)
            self._queued[dest] += 1

    def put_latest(self, dests: Sequence[int], frames: list[Any]) -> None:
        latest = (time.monotonic(), frames, True, None)
        for dest in dests:
            queue = self._outbox(dest).queue
            kept = []
            while not queue.empty():  # only the newest snapshot is worth sending; other messages stay
                item = queue.get_nowait()
                queue.task_done()
                if item[2]:
                    self.stats.replaced += 1
                else:
                    kept.append(item)
            for item in kept[:queue.maxsize - 1]:  # (a flood of non-replaceable messages cannot fill it)
                queue.put_nowait(item)
            for item in kept[queue.maxsize - 1:]:
                settle(item[3], None)
            queue.put_nowait(latest)
            self._queued[dest] += 1

    async def put_waiting(self, dests: Sequence[int], frames: list[Any], delivery: Delivery | None,
                          failed: asyncio.Future[None]) -> bool:
        """Queue ``frames`` for each of ``dests`` in turn, waiting for room; False when ``failed`` (a task
        of the transport died, so a queue may never drain) came first and the rest was not queued."""
        queued = 0
        item = (time.monotonic(), frames, False, delivery)
        try:
            for dest in dests:
                queue = self._outbox(dest).queue
                if queue.full():  # wait for room, or for a task of ours to die (its queue may never drain)
                    put = asyncio.ensure_future(queue.put(item))
                    await asyncio.wait((put, failed), return_when=asyncio.FIRST_COMPLETED)
                    if not put.done():
                        put.cancel()
                        return False
                    put.result()
                else:
                    queue.put_nowait(item)
                queued += 1
            return True
        finally:
            for _ in range(len(dests) - queued):  # not queued (a timeout): ZeroMQ never saw these frames
                settle(delivery, None)

    async def offer(self, dests: Sequence[int], frames: list[Any]) -> list[int]:
        """Queue ``frames`` for each of ``dests`` whose queue is empty; the ranks it queued for."""
        taken = []
        for dest in dests:
            queue = self._outbox(dest).queue
            if queue.empty():
                queue.put_nowait((time.monotonic(), frames, False, None))
                taken.append(dest)
        return taken

    def forget(self, dest: int) -> None:
        """Drop what is queued for ``dest`` and close its outbox at once."""
        outbox = self._outboxes.pop(dest, None)
        if outbox is not None:
            outbox.abandon()

    async def drain(self) -> None:
        """Wait until every outbox has handed what it holds to ZeroMQ."""
        for outbox in list(self._outboxes.values()):
            await outbox.queue.join()

    def queued(self) -> int:
        return sum(outbox.queue.qsize() for outbox in self._outboxes.values())

    def close(self, linger: int) -> None:
        for outbox in self._outboxes.values():
            outbox.close(linger)

    def _outbox(self, dest: int) -> Outbox:
        outbox = self._outboxes.get(dest)
        if outbox is None:
            if not 0 <= dest < len(self.endpoints):
                raise PeerUnreachable(f"no endpoint for peer {dest}")
            socket = open_dealer(self._context, self.rank, dest, self._heartbeat_ms, self._keys)
            local = ipc_endpoint(self.endpoints[dest]) if self._ipc else None
            outbox = Outbox(dest, socket, local or self.endpoints[dest], local=local is not None,
                            delay=self._delays[dest], depth=self._depth, rank=self.rank, stats=self.stats,
                            guard=self._guard, on_link=self._on_link)
            outbox.open(self._supervise)
            self.stats.routes[dest] = "ipc" if local else "tcp"
            self._outboxes[dest] = outbox
        return outbox
