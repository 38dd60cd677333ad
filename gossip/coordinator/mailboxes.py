"""The parameter server's mailbox (a queue with a share per worker) and its workers' (the server's
latest reply). Each is a ``Mailbox`` (filing and waits) with its ``Liveness`` for connections and second
hellos (a hello forged over another connection is neither queued nor answered); neither hears stops nor
rejoins (``gossip/stops.py``, ``gossip/rejoin.py``: the gossip mailboxes')."""

from __future__ import annotations

from collections import deque

from gossip.errors import PeerTimeout, ProtocolError
from gossip.mailbox import Expects, Mailbox, impostors
from gossip.net.wire import Layout, Message

PER_WORKER = 4  # messages of one worker the parameter server's queue holds: a hello, a contribution, a bye


class QueueMailbox(Mailbox):
    """The parameter server's: every message (hellos included) in arrival order, for one consumer."""

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, capacity: int,
                 contribution: str) -> None:
        super().__init__(rank, world_size, layout, expects)
        self.accepts = frozenset({"hello", "bye", contribution})  # "grad", or "params" in ps-avg
        self.capacity = capacity
        self._queue: deque[Message] = deque()

    def _file(self, message: Message) -> None:
        sender = message.header.sender
        if not self.expects(sender, message.header.version):
            raise ProtocolError("sender", f"peer {sender} is not a worker of this server")
        # A worker waits for its reply, so only a flood gets here; each sender has its own share, so one
        # flooding worker cannot crowd out the others' messages.
        waiting = sum(1 for queued in self._queue if queued.header.sender == sender)
        if waiting >= PER_WORKER or len(self._queue) >= self.capacity:
            raise ProtocolError("flood", f"{waiting} messages from peer {sender} already wait "
                                         f"({len(self._queue)} in all); dropped its next")
        self._queue.append(message)

    def get(self, timeout: float) -> Message | None:
        """The next message, or None when none arrived within ``timeout`` seconds."""
        self._wait(lambda: set() if self._queue else {-1}, timeout)
        with self._cond:
            return self._queue.popleft() if self._queue else None


class ReplyMailbox(Mailbox):
    """A parameter-server worker's: the newest weights the server sent (as "weights", as "end" when the run
    is over, or in compressed ps-avg as the compressed change of its public weights), and whether it
    acknowledged a hello (it is alive and still has our contribution) since we last looked."""

    accepts = frozenset({"hello", "weights", "end"})

    def __init__(self, rank: int, world_size: int, layout: Layout, server: int) -> None:
        super().__init__(rank, world_size, layout, lambda sender, round: sender == server)
        self.server = server
        self.expected_step = 0  # the step of our last request: older answers are stale
        self._weights: Message | None = None
        self._acknowledged = False

    def expect(self, step: int) -> None:
        """We are about to ask again at ``step``: forget what answered earlier requests."""
        with self._cond:
            self.expected_step = step
            self._weights, self._acknowledged = None, False

    def _file(self, message: Message) -> None:
        if message.header.sender != self.server:
            raise ProtocolError("sender", f"peer {message.header.sender} is not our server")
        if message.header.step < self.expected_step:
            raise ProtocolError("stale-reply", f"an answer to our step {message.header.step}; we are at step "
                                               f"{self.expected_step}")
        if message.header.kind != "hello":  # "end": the last weights, the run is over; or compressed weights
            self._weights = message
        else:
            self._acknowledged = True

    def wait_weights(self, timeout: float, accept_ack: bool = False) -> Message | None:
        """Take the newest weights, waiting up to ``timeout`` seconds for the server's next reply. With
        ``accept_ack``, an acknowledged hello also ends the wait, returning None."""
        def missing() -> set[int]:
            return set() if self._weights is not None or (accept_ack and self._acknowledged) else {self.server}

        if self._wait(missing, timeout):
            raise PeerTimeout(f"worker {self.rank} waited {timeout:g} s for the parameter server's weights "
                              f"(--round-timeout); is the server running?{impostors(self.liveness.foreign, {self.server})}")
        with self._cond:
            message, self._weights = self._weights, None
            self._acknowledged = False
            return message
