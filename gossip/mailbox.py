"""Where the event loop leaves validated messages for the training thread.

``deliver`` runs on the loop thread (it is the transport's handler): it decodes and validates, checks that
the sender is who its connection says and that it is expected, and files the message. The training
thread waits on a condition variable for what it needs. Memory stays bounded: a sync mailbox keeps at
most one message per sender for a window of rounds, an async one only the latest message per sender.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gossip.errors import PeerTimeout, ProtocolError
from gossip.wire import Layout, Message, decode

Expects = Callable[[int, int], bool]  # (sender, round) -> is sender one of our in-neighbours then


@dataclass
class Received:
    message: Message
    arrival_step: int  # our own local step count when it arrived, for staleness
    arrival_time: float


class Mailbox:
    """Shared part: decoding, sender checks, hellos, and the condition the training thread waits on.

    ``world_size`` counts every rank that may send (workers and the server in the parameter-server modes);
    ``accepts`` names the message kinds this mailbox files; any other kind is dropped.
    """

    accepts: frozenset[str] = frozenset({"hello", "params"})

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.expects = expects
        self.local_step = 0  # written by the training thread, read at arrival
        self._cond = threading.Condition()
        self._hellos: set[int] = set()

    def deliver(self, identity: bytes, frames: Sequence[Any]) -> None:
        message = decode(frames, self.layout, self.world_size)
        sender = message.header.sender
        if identity != str(sender).encode():
            raise ProtocolError("sender-mismatch", f"connection {identity[:16]!r} claims to be peer {sender}")
        if sender == self.rank:
            raise ProtocolError("sender", f"a message claims to come from ourselves (peer {sender})")
        if message.header.kind not in self.accepts:
            raise ProtocolError("kind", f"a {message.header.kind} message from peer {sender} has no place here")
        with self._cond:
            if message.header.kind == "hello":
                self._hellos.add(sender)
            self._file(message)
            self._cond.notify_all()

    def _file(self, message: Message) -> None:
        """File a validated message other than a hello (called with the lock held)."""
        raise NotImplementedError

    def wait_hellos(self, senders: Iterable[int], timeout: float) -> None:
        missing = self._wait(lambda: set(senders) - self._hellos, timeout)
        if missing:
            raise PeerTimeout(f"peer {self.rank} heard nothing from peer(s) {_ranks(missing)} within {timeout:g} s "
                              f"of starting (--startup-timeout); are they running, on the same --base-port?")

    def _wait(self, missing: Callable[[], set[int]], timeout: float) -> set[int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (left := missing()) and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(min(remaining, 0.5))
            return left


class RoundMailbox(Mailbox):
    """Synchronous gossip: one message per (round, sender), for rounds in [current, current + window]."""

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, window: int) -> None:
        super().__init__(rank, world_size, layout, expects)
        self.window = window
        self.current = 0
        self._rounds: dict[int, dict[int, Message]] = {}

    def _file(self, message: Message) -> None:
        header = message.header
        if header.kind == "hello":
            return
        if header.round < self.current:
            raise ProtocolError("stale-round", f"round {header.round} from peer {header.sender} is over "
                                               f"(we are in round {self.current})")
        if header.round > self.current + self.window:
            raise ProtocolError("future-round", f"round {header.round} from peer {header.sender} is more than "
                                                f"{self.window} rounds ahead of ours ({self.current})")
        if not self.expects(header.sender, header.round):
            raise ProtocolError("not-neighbour", f"peer {header.sender} is not our neighbour in round {header.round}")
        inbox = self._rounds.setdefault(header.round, {})
        if header.sender in inbox:
            raise ProtocolError("duplicate", f"second message for round {header.round} from peer {header.sender}")
        inbox[header.sender] = message

    def wait_round(self, round: int, senders: Sequence[int], timeout: float) -> dict[int, Message]:
        """The round's messages from ``senders``, waiting up to ``timeout`` seconds for all of them; after
        that, whatever arrived (the caller decides what a missing sender means)."""
        self._wait(lambda: set(senders) - self._rounds.get(round, {}).keys(), timeout)
        return self.take_round(round)

    def take_round(self, round: int) -> dict[int, Message]:
        """Remove and return what arrived for ``round``; later rounds stay; earlier ones are refused."""
        with self._cond:
            self.current = round + 1
            for old in [r for r in self._rounds if r <= round]:
                if old != round:
                    del self._rounds[old]
            return self._rounds.pop(round, {})


class LatestMailbox(Mailbox):
    """Asynchronous gossip: the newest message from each sender, replaced on arrival of a newer one."""

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        super().__init__(rank, world_size, layout, expects)
        self._latest: dict[int, Received] = {}

    def _file(self, message: Message) -> None:
        header = message.header
        if header.kind == "hello":
            return
        held = self._latest.get(header.sender)
        if held is not None and header.step <= held.message.header.step:
            raise ProtocolError("replay", f"step {header.step} from peer {header.sender} is not newer than "
                                          f"the step {held.message.header.step} we hold")
        if not self.expects(header.sender, header.round):
            raise ProtocolError("not-neighbour", f"peer {header.sender} is not our neighbour in its round {header.round}")
        self._latest[header.sender] = Received(message, self.local_step, time.monotonic())

    def latest(self) -> dict[int, Received]:
        with self._cond:
            return dict(self._latest)

    def forget(self, sender: int) -> None:
        with self._cond:
            self._latest.pop(sender, None)


class QueueMailbox(Mailbox):
    """The parameter server's: every message (hellos included) in arrival order, for one consumer."""

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, capacity: int,
                 contribution: str) -> None:
        super().__init__(rank, world_size, layout, expects)
        self.accepts = frozenset({"hello", "bye", contribution})  # "grad", or "params" in ps-avg
        self.capacity = capacity
        self._queue: deque[Message] = deque()

    def _file(self, message: Message) -> None:
        if not self.expects(message.header.sender, message.header.round):
            raise ProtocolError("sender", f"peer {message.header.sender} is not a worker of this server")
        if len(self._queue) >= self.capacity:  # a worker waits for its reply, so only a flood gets here
            raise ProtocolError("flood", f"{len(self._queue)} messages already wait; dropped one from "
                                         f"peer {message.header.sender}")
        self._queue.append(message)

    def get(self, timeout: float) -> Message | None:
        """The next message, or None when none arrived within ``timeout`` seconds."""
        self._wait(lambda: set() if self._queue else {-1}, timeout)
        with self._cond:
            return self._queue.popleft() if self._queue else None


class ReplyMailbox(Mailbox):
    """A parameter-server worker's: the newest weights the server sent."""

    accepts = frozenset({"hello", "weights"})

    def __init__(self, rank: int, world_size: int, layout: Layout, server: int) -> None:
        super().__init__(rank, world_size, layout, lambda sender, round: sender == server)
        self.server = server
        self._weights: Message | None = None

    def _file(self, message: Message) -> None:
        if message.header.sender != self.server:
            raise ProtocolError("sender", f"peer {message.header.sender} is not our server")
        if message.header.kind == "weights":
            self._weights = message

    def wait_weights(self, timeout: float) -> Message:
        """Take the newest weights, waiting up to ``timeout`` seconds for the server's next reply."""
        missing = self._wait(lambda: set() if self._weights is not None else {self.server}, timeout)
        if missing:
            raise PeerTimeout(f"worker {self.rank} waited {timeout:g} s for the parameter server's weights "
                              "(--round-timeout); is the server running?")
        with self._cond:
            message, self._weights = self._weights, None
            return message


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
