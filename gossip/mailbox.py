"""Where the event loop leaves validated messages for the training thread.

``deliver`` runs on the loop thread (it is the transport's handler): it decodes and validates, checks that
the sender is who its connection says and that it is expected, and files the message. The training
thread waits on a condition variable for what it needs. Memory stays bounded: a sync mailbox keeps at
most one message per sender for a window of rounds, a push-sum one one merged message per sender, an
async one only the latest message per sender. Every mailbox notes the speed each sender reports.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossip.errors import PeerTimeout, ProtocolError, TransportError
from gossip.wire import Header, Layout, Message, decode

CONFIRM_SECONDS = 1.0  # a second hello waits this long for the drop of our link that proves a restart
PER_WORKER = 4  # messages of one worker the parameter server's queue holds: a hello, a contribution, a bye
Expects = Callable[[int, int], bool]  # (sender, round) -> is sender one of our in-neighbours then
Share = Callable[[int, int], float]  # (sender, round) -> W[us, sender] in that round: our share of its mass


@dataclass
class Received:
    message: Message
    arrival_step: int  # our own local step count when it arrived, for staleness
    arrival_time: float
    final_step: int | None = None  # our local step when its sender said it was its last (a "bye")

    def staleness(self, local_step: int) -> int:
        """Our own local steps since it arrived, which stop counting once its sender has finished: the
        sender's model will never be newer than this snapshot, so it grows no staler."""
        return (local_step if self.final_step is None else self.final_step) - self.arrival_step


class Mailbox:
    """Shared part: decoding, sender checks, hellos, and the condition the training thread waits on.

    ``world_size`` counts every rank that may send (workers and the server in the parameter-server modes);
    ``accepts`` names the message kinds this mailbox files; any other kind is dropped.
    """

    accepts: frozenset[str] = frozenset({"hello", "params", "welcome"})

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.expects = expects
        # What no honest header exceeds (0: unbounded); the averager sets them from its config.
        self.max_rounds = self.max_steps = 0
        self.max_weight = 0.0
        self.rejoining = False  # welcomes are taken only while we rejoin
        self.local_step = 0  # written by the training thread, read at arrival
        self._cond = threading.Condition()
        self._heard: set[int] = set()  # senders we have had any message from
        self.reported: dict[int, Header] = {}  # sender -> the header of its latest message (speed, pace)
        # Liveness (gossip modes): see ``link``, ``dead`` and ``take_restarted``.
        self.peer_timeout = 3.0
        self.clock = time.monotonic  # liveness's clock (a test advances its own instead of sleeping)
        self.failure: BaseException | None = None  # the transport's, once one of its tasks died
        self._down_since: dict[int, float] = {}  # neighbour -> when our connection to it dropped
        self._restarted: set[int] = set()  # said hello a second time: a new incarnation, not yet re-admitted
        self._unconfirmed: dict[int, float] = {}  # said hello again while our link to it was up: since when
        self._drops: Counter[int] = Counter()  # neighbour -> times our connection to it dropped
        self._drops_at_hello: dict[int, int] = {}  # neighbour -> _drops when we last believed its hello
        self._declared: set[int] = set()  # declared dead and not re-admitted since
        self._up: set[int] = set()  # neighbours we have completed a handshake with at least once
        self._finished: set[int] = set()  # said bye (gossip-async): disconnected, but not dead
        self.first: dict[int, Header] = {}  # each sender's first non-hello message header (for rejoining)
        self.keep_first = False  # rejoining without a checkpoint: also keep each sender's first model
        self._first_models: dict[int, list[torch.Tensor]] = {}

    def deliver(self, authenticated: int | None, frames: Sequence[Any]) -> None:
        """The transport's handler: ``authenticated`` is the sender's rank proven by its CURVE key, or None."""
        message = decode(frames, self.layout, self.world_size)
        sender = message.header.sender
        if authenticated is not None and authenticated != sender:
            raise ProtocolError("sender-mismatch", f"peer {authenticated} claims to be peer {sender}")
        if sender == self.rank:
            raise ProtocolError("sender", f"a message claims to come from ourselves (peer {sender})")
        if message.header.kind not in self.accepts:
            raise ProtocolError("kind", f"a {message.header.kind} message from peer {sender} has no place here")
        self._check_claims(message.header)
        kind = message.header.kind
        with self._cond:
            if kind == "welcome":  # we restarted, and ``sender`` takes us back in its round
                if not self.rejoining:
                    raise ProtocolError("welcome", f"a welcome from peer {sender}, but we are not rejoining")
                self.first.setdefault(sender, message.header)
            else:
                self._file(message)
            # only what was filed counts: a rejected message neither greets nor reports a pace
            if kind == "hello" and (sender in self._heard or sender in self._declared):
                self._hello_again(sender)
            elif kind == "hello":
                self._drops_at_hello[sender] = self._drops[sender]
            elif kind not in ("bye", "bye-ack", "welcome"):
                self.reported[sender] = message.header
                if self.keep_first and sender in self.first and message.chunks:
                    self._first_models.setdefault(sender, [c.clone() for c in message.chunks])
            self._heard.add(sender)
            self._cond.notify_all()

    def _check_claims(self, header: Header) -> None:
        """Bound every number a header carries by what the run allows, before anything changes."""
        sender = header.sender
        if self.max_weight and header.weight > self.max_weight:
            raise ProtocolError("weight", f"peer {sender} claims push-sum weight {header.weight:g}; the whole "
                                          f"network holds {self.max_weight:g}")
        if self.max_rounds and header.round > self.max_rounds + 1:
            raise ProtocolError("horizon", f"peer {sender} names round {header.round}; the run has "
                                           f"{self.max_rounds}")
        if self.max_steps and header.step > self.max_steps:
            raise ProtocolError("horizon", f"peer {sender} names step {header.step}; the run has {self.max_steps}")

    def _hello_again(self, sender: int) -> None:
        """A second hello (lock held). A new incarnation is a new process, and the old one's connections
        closed when it ended: believed when our link to ``sender`` dropped since its last hello (or it was
        declared dead, or we never had a link to it). Otherwise it is held for ``CONFIRM_SECONDS``, in case
        the drop is reported just after the hello, and forgotten after: a hello forged in a live
        neighbour's name does not make us stop waiting for it."""
        if sender in self._declared or sender not in self._up or \
                self._drops[sender] > self._drops_at_hello.get(sender, 0):
            self._believe_restart(sender)
        else:
            self._unconfirmed[sender] = self.clock()

    def _believe_restart(self, sender: int) -> None:
        self._unconfirmed.pop(sender, None)
        self._drops_at_hello[sender] = self._drops[sender]
        self._restarted.add(sender)
        self._restart(sender)

    def _restart(self, sender: int) -> None:
        """Forget per-sender state that a new incarnation of ``sender`` starts over (lock held)."""

    # -- liveness --------------------------------------------------------------------------------------
    def link(self, peer: int, up: bool) -> None:
        """The transport's monitor: our connection to ``peer`` dropped (``up`` False) or was (re)made."""
        with self._cond:
            if up:
                self._down_since.pop(peer, None)
                self._up.add(peer)
            else:
                self._down_since.setdefault(peer, self.clock())
                self._drops[peer] += 1
                if self.clock() - self._unconfirmed.pop(peer, -CONFIRM_SECONDS) < CONFIRM_SECONDS:
                    self._believe_restart(peer)
            self._cond.notify_all()

    def _dead(self) -> set[int]:
        """Neighbours not to wait for (lock held): disconnected for ``peer_timeout`` seconds, declared dead,
        or replaced by a new incarnation that is not re-admitted yet. A finished neighbour is not dead."""
        now = self.clock()
        lost = {j for j, since in self._down_since.items()
                if now - since >= self.peer_timeout and j not in self._finished}
        return lost | self._declared | self._restarted

    def dead(self) -> set[int]:
        with self._cond:
            return self._dead()

    def declare_dead(self, peers: Iterable[int]) -> None:
        with self._cond:
            self._declared.update(peers)

    def take_restarted(self) -> set[int]:
        """Neighbours that came back since we last asked; they count as alive again from now on."""
        with self._cond:
            back, self._restarted = self._restarted, set()
            for peer in back:
                self._declared.discard(peer)
                self._down_since.pop(peer, None)
            return back

    def take_first_models(self) -> dict[int, list[torch.Tensor]]:
        with self._cond:
            models, self._first_models, self.keep_first = self._first_models, {}, False
            return models

    def wait_first(self, senders: Iterable[int], timeout: float) -> dict[int, Header]:
        """Rejoining: wait up to ``timeout`` for the welcome of each of ``senders``, or for it to be dead; a
        sender we could not even connect to within ``peer_timeout`` has finished or died: no wait for it.
        The welcomes that came."""
        senders = set(senders)
        began = time.monotonic()

        def missing() -> set[int]:
            unreachable = set() if time.monotonic() - began < self.peer_timeout else senders - self._up
            waiting = senders - self.first.keys() - self._dead() - unreachable
            if self.keep_first:  # and, to pull, the model each welcome is followed by
                waiting |= {j for j in self.first.keys() & senders if j not in self._first_models}
            return waiting

        self._wait(missing, timeout)
        with self._cond:
            return {j: self.first[j] for j in senders if j in self.first}

    def _file(self, message: Message) -> None:
        """File a validated message, hellos included (called with the lock held)."""
        raise NotImplementedError

    def reported_pace(self, sender: int) -> float | None:
        """Busy seconds per round that ``sender`` last reported: seconds per step times steps per round."""
        header = self.reported.get(sender)
        if header is None or not header.step_seconds:
            return None
        return header.step_seconds * header.step / (header.round + 1)

    def wait_hellos(self, senders: Iterable[int], timeout: float) -> None:
        missing = self._wait(lambda: set(senders) - self._heard, timeout)
        if missing:
            raise PeerTimeout(f"peer {self.rank} heard nothing from peer(s) {_ranks(missing)} within {timeout:g} s "
                              f"of starting (--startup-timeout); are they running, on the same --base-port?")

    def fail(self, exc: BaseException) -> None:
        """The transport died (its ``on_failure``): every wait raises with the reason instead of timing out."""
        with self._cond:
            self.failure = exc
            self._cond.notify_all()

    def _block(self, timeout: float) -> None:
        """``_cond.wait`` (lock held), raising ``TransportError`` once the transport has failed."""
        self._raise_if_failed()
        self._cond.wait(timeout)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TransportError(f"peer {self.rank}'s transport failed: {self.failure!r}") from self.failure

    def _wait(self, missing: Callable[[], set[int]], timeout: float) -> set[int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (left := missing()) and (remaining := deadline - time.monotonic()) > 0:
                self._block(min(remaining, 0.5))
            return left


class RoundMailbox(Mailbox):
    """Synchronous gossip: one message per (round, sender), for rounds in [current, current + window]."""

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, window: int) -> None:
        super().__init__(rank, world_size, layout, expects)
        self.window = window
        self.current = 0
        self.anchored = True  # False while rejoining: the rounds the neighbours are in are not known yet
        self._rounds: dict[int, dict[int, Message]] = {}

    def _file(self, message: Message) -> None:
        header = message.header
        if header.kind == "hello":
            return
        if not self.anchored:  # rejoining: keep only what a sender sent after its welcome, from its round on
            welcome = self.first.get(header.sender)
            if welcome is None or header.round < welcome.round:
                raise ProtocolError("before-rejoin", f"round {header.round} from peer {header.sender} was "
                                                     f"meant for our previous incarnation")
            if header.round > welcome.round + self.window:
                raise ProtocolError("future-round", f"round {header.round} from peer {header.sender} is far "
                                                    f"beyond the round {welcome.round} it re-admitted us in")
        elif header.round < self.current:
            raise ProtocolError("stale-round", f"round {header.round} from peer {header.sender} is over "
                                               f"(we are in round {self.current})")
        elif header.round > self.current + self.window:
            raise ProtocolError("future-round", f"round {header.round} from peer {header.sender} is more than "
                                                f"{self.window} rounds ahead of ours ({self.current})")
        if not self.expects(header.sender, header.round):
            raise ProtocolError("not-neighbour", f"peer {header.sender} is not our neighbour in round {header.round}")
        inbox = self._rounds.setdefault(header.round, {})
        if header.sender in inbox:
            raise ProtocolError("duplicate", f"second message for round {header.round} from peer {header.sender}")
        inbox[header.sender] = message

    def anchor(self, round: int) -> None:
        """Rejoining: from now on we are in ``round``; what arrived for earlier rounds is dropped."""
        with self._cond:
            self.current, self.anchored = round, True
            for old in [r for r in self._rounds if r < round]:
                del self._rounds[old]

    def wait_round(self, round: int, senders: Sequence[int], timeout: float) -> dict[int, Message]:
        """The round's messages from ``senders`` (not waiting for dead ones); PeerTimeout naming the
        missing ones after ``timeout``."""
        missing = self._wait(lambda: set(senders) - self._rounds.get(round, {}).keys() - self._dead(), timeout)
        if missing:
            raise PeerTimeout(f"peer {self.rank} waited {timeout:g} s for round {round} from peer(s) "
                              f"{_ranks(missing)} (--round-timeout); did they stop or fall behind?")
        return self.take_round(round)

    def take_round(self, round: int) -> dict[int, Message]:
        """Remove and return what arrived for ``round``; later rounds stay; earlier ones are refused."""
        with self._cond:
            self.current = round + 1
            for old in [r for r in self._rounds if r <= round]:
                if old != round:
                    del self._rounds[old]
            return self._rounds.pop(round, {})


@dataclass
class Mass:
    """Push-sum mass from one sender that is not mixed in yet: ``mass`` times the model ``chunks``."""

    mass: float
    chunks: list[torch.Tensor]


class MassMailbox(Mailbox):
    """Push-sum gossip (deadline mode): whatever a sender pushed to us and we have not mixed yet, from any
    round, merged on arrival into one mass per sender, so memory stays one model per sender however far
    ahead or behind it runs. Merging keeps the sum: m1 z1 + m2 z2 = (m1 + m2) lerp(z1, z2, m2 / (m1 + m2)).
    """

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, share: Share) -> None:
        super().__init__(rank, world_size, layout, expects)
        self.share = share
        self.latest_round: dict[int, int] = {}
        self.received: Counter[int] = Counter()
        self.unreliable: set[int] = set()  # restarted senders: how many messages they send us is unknown
        self._pending: dict[int, Mass] = {}
        self._arrivals: list[tuple[int, int, float]] = []  # (sender, round, monotonic time), not yet read

    def _restart(self, sender: int) -> None:
        self.latest_round.pop(sender, None)  # its new incarnation counts rounds from where it rejoins
        self.unreliable.add(sender)

    def _file(self, message: Message) -> None:
        if message.header.kind == "hello":
            return
        sender, round = message.header.sender, message.header.round
        if round <= self.latest_round.get(sender, -1):
            raise ProtocolError("replay", f"round {round} from peer {sender} is not newer than the round "
                                          f"{self.latest_round[sender]} it already sent")
        if not self.expects(sender, round):
            raise ProtocolError("not-neighbour", f"peer {sender} is not our neighbour in round {round}")
        self.latest_round[sender] = round
        self.received[sender] += 1
        self._arrivals.append((sender, round, time.monotonic()))
        mass = self.share(sender, round) * message.header.weight
        held = self._pending.get(sender)
        if held is None:
            self._pending[sender] = Mass(mass, message.chunks)
        elif mass > 0:
            held.mass += mass
            for mine, theirs in zip(held.chunks, message.chunks, strict=True):
                mine.lerp_(theirs, mass / held.mass)

    def wait_for(self, round: int, deadlines: dict[int, float]) -> set[int]:
        """Wait until each sender's ``round`` message is in or its deadline (``time.monotonic()``) passed;
        returns the senders that missed."""
        with self._cond:
            while True:
                late = {j for j in deadlines if self.latest_round.get(j, -1) < round}
                if late <= self._dead():
                    return late
                now = time.monotonic()
                open_deadlines = [deadlines[j] for j in late if deadlines[j] > now]
                if not open_deadlines:
                    return late
                self._block(min(open_deadlines) - now)

    def wait_counts(self, expected: dict[int, int], idle_timeout: float) -> None:
        """Wait until ``expected[j]`` messages came from each j (see ``_wait_progress``)."""
        self._wait_progress(lambda: {j for j, count in expected.items()
                                     if self.received[j] < count and j not in self._dead() | self.unreliable},
                            idle_timeout)

    def _wait_progress(self, missing: Callable[[], set[int]], idle_timeout: float) -> None:
        """Wait until ``missing()`` is empty; PeerTimeout when none of the missing senders delivered anything
        for ``idle_timeout`` seconds (a slow peer still making progress is waited for, a stopped one is not)."""
        with self._cond:
            progress, last_change = None, time.monotonic()
            while left := missing():
                now = time.monotonic()
                seen = (sum(self.received[j] for j in left), len(self._finished))
                if seen != progress:
                    progress, last_change = seen, now
                elif now - last_change >= idle_timeout:
                    raise PeerTimeout(f"peer {self.rank} heard nothing from peer(s) {_ranks(left)} for "
                                      f"{idle_timeout:g} s while waiting for their last messages (--round-timeout)")
                self._block(min(0.5, idle_timeout - (now - last_change)))

    def take_all(self) -> dict[int, Mass]:
        with self._cond:
            pending, self._pending = self._pending, {}
            return pending

    def take_arrivals(self) -> list[tuple[int, int, float]]:
        with self._cond:
            arrivals, self._arrivals = self._arrivals, []
            return arrivals


class PushSumMailbox(MassMailbox):
    """Asynchronous push-sum gossip: a ``MassMailbox`` whose senders say "bye" when they finish, with
    ``round`` one past the last round they sent us (0: none); a neighbour still training answers with
    "bye-ack", counted the same way. A finished peer drains: it waits until every in-neighbour's bye (or
    bye-ack) is in and that neighbour's last message with it, so every message is mixed exactly once and no
    mass is lost at the end. A sender that said bye and then disconnected is finished, not dead.

    A bye is its sender's last word on its connection (until a hello: a new incarnation). So a message
    that follows one shows that someone else said it: the bye is forgotten (``forged_byes``) and the
    message filed, and no genuine mass is ever refused for a bye a stranger sent. A second bye replaces the
    first when its count is exactly what arrived (its sender's messages come in order, so a genuine bye's
    count always is): a forged bye cannot make us wait for rounds that never come. A bye-ack is taken only
    once we said bye ourselves (``draining``): one we never asked for changes nothing, except that its
    sender, who was told we finished, is sent a message at our next mixing point (``contradict``), which
    undoes the forged bye there even while flow control would hold our messages back."""

    accepts = frozenset({"hello", "params", "welcome", "bye", "bye-ack"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bye_rounds: dict[int, int] = {}  # sender -> rounds it sent us in all (from its bye)
        self.draining = False  # we said bye to everyone: answers to it are taken from now on
        self.forged_byes = 0  # byes forgotten because their sender spoke again after them
        self.contradict: set[int] = set()  # answered a bye of ours we never said: to be sent a message soon

    def _restart(self, sender: int) -> None:
        super()._restart(sender)
        self._forget_bye(sender)

    def _forget_bye(self, sender: int) -> None:
        self.bye_rounds.pop(sender, None)
        self._finished.discard(sender)

    def _file(self, message: Message) -> None:
        header = message.header
        sender = header.sender
        if header.kind not in ("bye", "bye-ack"):
            if header.kind != "hello" and sender in self.bye_rounds:  # its "bye" was not its own
                self._forget_bye(sender)
                self.forged_byes += 1
            super()._file(message)
            return
        if header.kind == "bye-ack" and not self.draining:
            self.contradict.add(sender)  # it was told we finished: our next message tells it otherwise
            raise ProtocolError("bye-ack", f"peer {sender} answers a bye we never said")
        exact = header.round == self.latest_round.get(sender, -1) + 1  # all it sent us is in: a genuine count
        if sender in self.bye_rounds and not exact:
            raise ProtocolError("after-bye", f"a second {header.kind} from peer {sender}")
        if header.round <= self.latest_round.get(sender, -1):
            raise ProtocolError("bye", f"peer {sender}'s {header.kind} counts {header.round} rounds, but it "
                                       f"already sent us round {self.latest_round[sender]}")
        self.bye_rounds[sender] = header.round
        self._finished.add(sender)

    def take_contradicted(self) -> set[int]:
        with self._cond:
            senders, self.contradict = self.contradict, set()
            return senders

    def wait_drained(self, senders: Iterable[int], idle_timeout: float) -> None:
        """Wait until each of ``senders`` said bye and its last round is in (dead ones are not waited for);
        PeerTimeout when none of the missing senders delivered anything for ``idle_timeout`` seconds: a
        slow neighbour still training is waited for, a stopped one is not."""
        senders = set(senders)
        self._wait_progress(lambda: {j for j in senders - self._dead() if j not in self.bye_rounds
                                     or self.latest_round.get(j, -1) + 1 < self.bye_rounds[j]}, idle_timeout)


class LatestMailbox(Mailbox):
    """Asynchronous gossip: the newest message from each sender, replaced on arrival of a newer one.

    A sender that finishes says "bye" with the step of its last snapshot: when that is the snapshot held,
    its staleness stops growing (``Received.staleness``), and the sender, whose connection then drops, is
    finished rather than dead, so its last model stays in the mix of a peer that is still training."""

    accepts = frozenset({"hello", "params", "welcome", "bye"})

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        super().__init__(rank, world_size, layout, expects)
        self._latest: dict[int, Received] = {}

    def _restart(self, sender: int) -> None:
        self._latest.pop(sender, None)  # its new incarnation counts steps from its checkpoint
        self._finished.discard(sender)

    def _file(self, message: Message) -> None:
        header = message.header
        if header.kind == "hello":
            return
        if not self.expects(header.sender, header.round):
            raise ProtocolError("not-neighbour", f"peer {header.sender} is not our neighbour in its round {header.round}")
        held = self._latest.get(header.sender)
        if header.kind == "bye":
            self._finished.add(header.sender)
            if held is not None and held.message.header.step == header.step and held.final_step is None:
                held.final_step = self.local_step
            return
        if held is not None and header.step <= held.message.header.step:
            raise ProtocolError("replay", f"step {header.step} from peer {header.sender} is not newer than "
                                          f"the step {held.message.header.step} we hold")
        self._finished.discard(header.sender)  # (a forged bye is undone by the sender's next snapshot)
        self._latest[header.sender] = Received(message, self.local_step, time.monotonic())

    def latest(self) -> dict[int, Received]:
        """The newest snapshot of every sender that is not dead."""
        with self._cond:
            dead = self._dead()
            return {j: r for j, r in self._latest.items() if j not in dead}

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
        sender = message.header.sender
        if not self.expects(sender, message.header.round):
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
    """A parameter-server worker's: the newest weights the server sent, and whether it acknowledged a
    hello (it is alive and still has our contribution) since we last looked."""

    accepts = frozenset({"hello", "weights"})

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
        if message.header.kind == "weights":
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
                              "(--round-timeout); is the server running?")
        with self._cond:
            message, self._weights = self._weights, None
            self._acknowledged = False
            return message


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
