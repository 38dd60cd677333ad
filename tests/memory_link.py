"""Averagers of one process joined without sockets: ``MemoryNetwork`` and its ``MemoryLink``s, which
implement ``gossip/link.py``'s ``Link`` as the ZeroMQ transport does, where averaging logic depends on it.

``network.connect(rank)`` is the ``connect`` argument of an averager (or of the parameter server, with
``server=True``). What a post hands over is copied at once (the frames ``encode`` made, as ZeroMQ would
read them), queued per destination (at most ``queue_depth`` messages, as the transport's outboxes), and
delivered on the posting thread into the destination's mailbox with ``mailbox.deliver(None, frames,
connection)``: in order per pair of peers, one connection serial per pair until it closes. So the network
is instant unless a test holds a peer's inbound messages (``hold``, ``release``): then its queues fill,
``offer`` takes only the destinations whose queue is empty, a ``post`` waits for room up to its timeout
(``PeerTimeout``), a ``latest_only`` post replaces an unsent ``latest_only`` message, and ``forget`` drops
what waits. Like the transport, a link tells its mailbox of its connections (``mailbox.link``: up when the
first message to a listening peer goes, down when that peer closes), tells the receiving mailbox of
connections that closed (``connection_closed``: the sender closed or forgot it), counts a message the
mailbox refuses (``ProtocolError``) in ``statistics()["dropped"]`` by reason, and fails the receiving
mailbox (``mailbox.fail``) on any other error of its handler. A link that closes first delivers what can
still be (up to ``flush_timeout``, while its destinations are held or not started); messages to a peer
that closed are dropped.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from gossip.errors import PeerTimeout, ProtocolError, TransportError
from gossip.link import Connect
from gossip.mailbox import Mailbox


class Frame:
    """One received frame, as a ``zmq.Frame`` looks to ``gossip/net/wire.py decode``: a writable buffer."""

    def __init__(self, frame: Any) -> None:
        self.buffer = memoryview(bytearray(memoryview(frame).cast("B")))

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()

    def __len__(self) -> int:
        return len(self.buffer)


class Sent:
    """A tracked post: its frames were copied when posted, so the sender's memory is free at once."""

    def wait(self, timeout: float) -> bool:
        return True


class MemoryNetwork:
    """The peers of one process; every operation runs under one lock, so deliveries are in order."""

    def __init__(self, queue_depth: int = 8) -> None:
        self.queue_depth = queue_depth
        self._cond = threading.Condition(threading.RLock())
        self._listening: dict[int, MemoryLink] = {}  # rank -> its started link
        self._closed: set[int] = set()  # ranks whose link closed (until a new one starts)
        self._held: set[int] = set()  # ranks whose inbound messages wait (``hold``)
        self._closing: list[MemoryLink] = []  # links delivering their last messages from ``close``
        self._serials = 0

    def connect(self, rank: int, server: bool = False) -> Connect:
        """The ``connect(mailbox)`` of ``rank``'s averager (the parameter server's: ``server``, which
        watches no links, as ``gossip/connect.py`` builds it)."""
        return lambda mailbox: MemoryLink(self, rank, mailbox, watch_links=not server)

    def hold(self, rank: int) -> None:
        """Messages to ``rank`` wait in their senders' queues until ``release``."""
        with self._cond:
            self._held.add(rank)

    def release(self, rank: int) -> None:
        with self._cond:
            self._held.discard(rank)
            self._flush()

    # -- under the lock ----------------------------------------------------------------------------------
    def _serial(self) -> int:
        self._serials += 1
        return self._serials

    def _deliverable(self, dest: int) -> bool:
        return dest in self._listening and dest not in self._held

    def _flush(self) -> None:
        """Deliver every queued message whose destination listens and is not held."""
        for link in list(self._listening.values()) + self._closing:
            for dest, queue in link.queues.items():
                while queue and self._deliverable(dest):
                    frames, _ = queue.popleft()
                    link._hand_over(self._listening[dest], frames)
        self._cond.notify_all()


class MemoryLink:
    """One peer's ``Link`` in a ``MemoryNetwork``."""

    def __init__(self, network: MemoryNetwork, rank: int, mailbox: Mailbox, watch_links: bool = True) -> None:
        self.network = network
        self.rank = rank
        self.mailbox = mailbox
        self.watch_links = watch_links
        self.queues: dict[int, deque[tuple[list[Frame], bool]]] = {}  # dest -> (frames, latest_only) waiting
        self.connections: dict[int, int] = {}  # dest -> serial of our connection to it
        self._started = False
        self.failure: BaseException | None = None
        self.bytes_sent = self.bytes_received = self.messages_sent = self.messages_received = 0
        self.replaced = 0
        self.dropped: Counter[str] = Counter()

    @property
    def started(self) -> bool:
        return self._started

    def start(self) -> None:
        with self.network._cond:
            self.network._listening[self.rank] = self
            self.network._closed.discard(self.rank)
            self._started = True
            self.network._flush()

    def post(self, dests: Sequence[int], frames: list[Any], *, latest_only: bool, timeout: float,
             track: bool = False) -> Sent | None:
        self.raise_if_failed()
        copied = [Frame(frame) for frame in frames]
        sent = Sent() if track else None
        network = self.network
        with network._cond:
            for dest in dests:
                queue = self.queues.setdefault(dest, deque())
                if latest_only:
                    kept = [item for item in queue if not item[1]]
                    self.replaced += len(queue) - len(kept)
                    queue.clear()
                    queue.extend(kept[:network.queue_depth - 1])
                elif not network._cond.wait_for(lambda q=queue: len(q) < network.queue_depth, timeout):
                    raise PeerTimeout(f"peer {self.rank}: no room within {timeout:g} s queueing a message for "
                                      f"peer {dest}")
                queue.append((copied, latest_only))
            network._flush()
        return sent

    def offer(self, dests: Sequence[int], frames: list[Any], timeout: float) -> list[int]:
        self.raise_if_failed()
        copied = [Frame(frame) for frame in frames]
        with self.network._cond:
            taken = []
            for dest in dests:
                queue = self.queues.setdefault(dest, deque())
                if not queue:
                    queue.append((copied, False))
                    taken.append(dest)
            self.network._flush()
        return taken

    def forget(self, dest: int) -> None:
        with self.network._cond:
            self.queues.pop(dest, None)
            serial = self.connections.pop(dest, None)
            receiver = self.network._listening.get(dest)
            if serial is not None and receiver is not None:
                receiver.mailbox.connection_closed(serial)
            self.network._cond.notify_all()

    def close(self, flush_timeout: float | None = None) -> None:
        network = self.network
        with network._cond:
            if not self._started:
                return
            del network._listening[self.rank]
            network._closed.add(self.rank)
            self._started = False
            network._closing.append(self)
            try:
                network._flush()
                deadline = time.monotonic() + (flush_timeout or 0.0)
                while self._undelivered() and (left := deadline - time.monotonic()) > 0:
                    network._cond.wait(left)
                    network._flush()
            finally:
                network._closing.remove(self)
            self.queues.clear()
            for dest, serial in self.connections.items():  # our connections end at their receivers
                receiver = network._listening.get(dest)
                if receiver is not None:
                    receiver.mailbox.connection_closed(serial)
            self.connections.clear()
            for other in network._listening.values():  # and theirs to us drop
                if other.connections.pop(self.rank, None) is not None and other.watch_links:
                    other.mailbox.link(self.rank, False)
            network._cond.notify_all()

    def _undelivered(self) -> bool:
        """Messages of ours that may still be delivered: to a peer held, or not started and not closed."""
        return any(queue and dest not in self.network._closed for dest, queue in self.queues.items())

    def _hand_over(self, receiver: MemoryLink, frames: list[Frame]) -> None:
        """Deliver one message to ``receiver`` (lock held), connecting first as ZeroMQ would."""
        serial = self.connections.get(receiver.rank)
        if serial is None:
            serial = self.connections[receiver.rank] = self.network._serial()
            if self.watch_links and self._started:
                self.mailbox.link(receiver.rank, True)
        size = sum(len(frame) for frame in frames)
        self.messages_sent += 1
        self.bytes_sent += size
        receiver.messages_received += 1
        receiver.bytes_received += size
        if receiver.failure is not None:
            return
        try:
            receiver.mailbox.deliver(None, frames, serial)
        except ProtocolError as exc:
            receiver.dropped[exc.reason] += 1
        except Exception as exc:  # noqa: BLE001 - the transport's receive task would die of it: the same here
            receiver.failure = exc
            receiver.mailbox.fail(exc)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TransportError(f"peer {self.rank}'s link failed: {self.failure!r}") from self.failure

    def statistics(self) -> dict[str, Any]:
        """The keys of the transport's ``statistics``."""
        with self.network._cond:
            return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                    "messages_sent": self.messages_sent, "messages_received": self.messages_received,
                    "replaced": self.replaced, "dropped": dict(self.dropped),
                    "routes": {str(dest): "memory" for dest in sorted(self.connections)}, "send_buffers": {}}
