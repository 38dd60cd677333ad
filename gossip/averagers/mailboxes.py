"""The gossip modes' mailboxes. Memory stays bounded: a sync mailbox keeps at most one message per sender
for a window of rounds (``RoundMailbox``), a push-sum one at most two masses per sender (``MassMailbox``,
``PushSumMailbox``), the latest-snapshot rule only the latest message per sender (``LatestMailbox``).
The four stand together because each files the same "params" messages by its
own rule, and reading them side by side is how the rules are compared. What they share beyond the
parameter server's mailboxes, stops and rejoining, is ``GossipMailbox``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gossip.errors import PeerTimeout, ProtocolError
from gossip.mailbox import Expects, Mailbox, impostors, ranks_text
from gossip.net.wire import Header, Layout, Message
from gossip.rejoin import Rejoin
from gossip.stops import Stops

Share = Callable[[int, int], float]  # (sender, round) -> W[us, sender] in that round: our share of its mass


@dataclass
class Received:
    message: Message
    arrival_step: int  # our own local step count when it arrived, for staleness
    final_step: int | None = None  # our local step when its sender said it was its last (a "bye")

    def staleness(self, local_step: int) -> int:
        """Our own local steps since it arrived, which stop counting once its sender has finished: the
        sender's model will never be newer than this snapshot, so it grows no staler."""
        return (local_step if self.final_step is None else self.final_step) - self.arrival_step


class GossipMailbox(Mailbox):
    """A gossip peer's mailbox: a ``Mailbox`` that hears its neighbours' stops (``gossip/stops.py``) and
    keeps its own rejoin state (``gossip/rejoin.py``), with what the averagers ask of both and of liveness:
    dead and restarted neighbours, link drops, nonces, welcomes and the first models after them."""

    accepts = frozenset({"hello", "params", "welcome"})

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        super().__init__(rank, world_size, layout, expects, stops=Stops(), rejoin=Rejoin())

    def wait_started(self, known: int, timeout: float) -> set[int]:
        """gossip-async's start (``gossip/progress.py``): wait up to ``timeout`` until more than ``known``
        peers are known to be up, or all are; the peers not known to be up if none came."""
        progress, everyone = self.progress, set(range(self.world_size))
        return self._wait(lambda: set() if len(progress.started()) > known else everyone - progress.started(),
                          timeout)

    # -- rejoining (``gossip/rejoin.py``: ``rejoin.rejoining``, ``rejoin.keep_first``) ------------------------
    def wait_first(self, senders: Iterable[int], timeout: float) -> dict[int, Header]:
        """Rejoining: wait up to ``timeout`` for the welcome of each of ``senders``, or for it to be dead; a
        sender we could not even connect to within ``peer_timeout`` has finished or died: no wait for it.
        The welcomes that came."""
        senders = set(senders)
        began = time.monotonic()

        def missing() -> set[int]:
            unreachable = set() if time.monotonic() - began < self.peer_timeout else senders - self.liveness.up
            return self.rejoin.waiting(senders, self._dead() | unreachable)

        self._wait(missing, timeout)
        with self._cond:
            return self.rejoin.welcomes(senders)

    def end_rejoin_wait(self, served: Iterable[int], late: bool) -> None:
        """``Rejoin.end_wait``, under the lock: no welcome slips between the wait's end and ``late``."""
        with self._cond:
            self.rejoin.end_wait(served, late)

    def take_first_models(self) -> dict[int, list[torch.Tensor]]:
        with self._cond:
            return self.rejoin.take_models()

    # -- liveness (``gossip/liveness.py``) --------------------------------------------------------------
    def _dead(self) -> set[int]:
        """Neighbours not to wait for (lock held): ``Liveness.dead`` by our clock."""
        return self.liveness.dead(self.clock(), self.peer_timeout)

    def dead(self) -> set[int]:
        with self._cond:
            return self._dead()

    def declare_dead(self, peers: Iterable[int]) -> None:
        with self._cond:
            self.liveness.declare_dead(peers)

    def take_restarted(self) -> set[int]:
        """Neighbours that came back since we last asked; they count as alive again from now on."""
        with self._cond:
            return self.liveness.take_restarted()

    def link_drops(self) -> dict[str, int]:
        """How often our connection to each neighbour dropped (a flap, a death or a restart)."""
        with self._cond:
            return self.liveness.link_drops()

    def nonce_of(self, sender: int) -> int:
        """The nonce of ``sender``'s latest hello that we took (0: none), for our welcome to echo."""
        with self._cond:
            return self.liveness.nonce_of(sender)

    def reported_pace(self, sender: int) -> float | None:
        """Busy seconds per round that ``sender`` last reported: seconds per step times steps per round."""
        header = self.reported.get(sender)
        if header is None or not header.step_seconds:
            return None
        return header.step_seconds * header.step / (header.round + 1)


class RoundMailbox(GossipMailbox):
    """Synchronous gossip: one message per (round, sender), for rounds in [current, current + window]."""

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, window: int) -> None:
        super().__init__(rank, world_size, layout, expects)
        self.window = window
        self.current = 0
        self.anchored = True  # False while rejoining: the rounds the neighbours are in are not known yet
        self.anchored_at = 0  # the round we went on from after a restart
        self._rounds: dict[int, dict[int, Message]] = {}

    def _file(self, message: Message) -> None:
        header = message.header
        if header.kind == "hello":
            return
        if not self.anchored:  # rejoining: keep only what a sender sent after its welcome, from its round on
            welcome = self.rejoin.first.get(header.sender)
            if welcome is None or header.round < welcome.round:
                raise ProtocolError("before-rejoin", f"round {header.round} from peer {header.sender} was "
                                                     f"meant for our previous incarnation")
            if header.round > welcome.round + self.window:
                raise ProtocolError("future-round", f"round {header.round} from peer {header.sender} is far "
                                                    f"beyond the round {welcome.round} it re-admitted us in")
        elif header.round < self.current:
            welcome = self.rejoin.first.get(header.sender)
            if welcome is not None and welcome.round <= header.round < self.anchored_at:
                return  # sent after re-admitting us, for a round before the one we went on from: as ``anchor``
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
            self.current, self.anchored, self.anchored_at = round, True, round
            for old in [r for r in self._rounds if r < round]:
                del self._rounds[old]

    def wait_round(self, round: int, senders: Sequence[int], timeout: float,
                   serve: Callable[[dict[int, Header]], None] | None = None) -> dict[int, Message]:
        """The round's messages from ``senders`` (not waiting for dead ones, nor, after our restart, for one
        that re-admitted us in a later round); PeerTimeout naming the missing ones after ``timeout``.
        ``serve`` is called, without the lock, with the welcomes that come late (``Rejoin.take_late``),
        before and while we wait: the peers who sent them may be waiting for us."""
        deadline = time.monotonic() + timeout

        def missing() -> set[int]:
            if self.rejoin.has_late():
                return set()
            return {j for j in senders if j not in self._rounds.get(round, {}) and j not in self._dead()
                    and not self.rejoin.readmits_after(j, round)}

        while True:
            with self._cond:
                late = self.rejoin.take_late()
            if late and serve is not None:
                serve(late)
            left = self._wait(missing, deadline - time.monotonic())
            with self._cond:
                if not self.rejoin.has_late():
                    break
        if left:
            raise PeerTimeout(f"peer {self.rank} waited {timeout:g} s for round {round} from peer(s) "
                              f"{ranks_text(left)} (--round-timeout); did they stop or fall behind?"
                              f"{impostors(self.liveness.foreign, left)}")
        return self.take_round(round)

    def take_round(self, round: int) -> dict[int, Message]:
        """Remove and return what arrived for ``round``; later rounds stay; earlier ones are refused."""
        with self._cond:
            self.current = round + 1
            for old in [r for r in self._rounds if r <= round]:
                if old != round:
                    del self._rounds[old]
            return self._rounds.pop(round, {})


MAX_PARTS = 2  # messages per sender held unmerged; one beyond is merged into the latest on arrival
MAX_NOTED = 16  # rounds per sender noted between two mixing points (``Mass.rounds``); a flood notes no more


@dataclass
class Mass:
    """Push-sum mass from one sender that is not mixed in yet: ``parts``, each a mass times model chunks,
    mixed as terms of their own on the training thread. Only a sender more than ``MAX_PARTS`` messages
    ahead of our mixing gets merged on arrival (on the loop thread), so memory stays bounded."""

    parts: list[tuple[float, list[torch.Tensor]]]
    rounds: list[int] = field(default_factory=list)  # the rounds of the messages held, the first MAX_NOTED

    @property
    def mass(self) -> float:
        return sum(mass for mass, _ in self.parts)

    def add(self, mass: float, chunks: list[torch.Tensor], round: int) -> None:
        """Hold one more message; merging keeps the sum: m1 z1 + m2 z2 = (m1 + m2) lerp(z1, z2, m2 / (m1 + m2))."""
        if len(self.rounds) < MAX_NOTED:
            self.rounds.append(round)
        if len(self.parts) < MAX_PARTS:
            self.parts.append((mass, chunks))
            return
        held, kept = self.parts[-1]
        for mine, theirs in zip(kept, chunks, strict=True):
            mine.lerp_(theirs, mass / (held + mass))
        self.parts[-1] = (held + mass, kept)


class MassMailbox(GossipMailbox):
    """Push-sum gossip (deadline mode): whatever a sender pushed to us and we have not mixed yet, from any
    round: at most ``MAX_PARTS`` messages per sender, the next merged into the latest (``Mass``), so memory
    stays bounded however far ahead or behind a sender runs, and the merging (whole-model work) happens on
    the loop thread only for a sender that far ahead. A message without mass is not held."""

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
        held = self._pending.setdefault(sender, Mass([]))
        if mass > 0:
            held.add(mass, message.chunks, round)

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
                self.raise_if_stopped(late)
                self._block(min(min(open_deadlines) - now, 0.5))

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
                seen = (sum(self.received[j] for j in left), len(self.liveness.finished))
                if seen != progress:
                    progress, last_change = seen, now
                elif now - last_change >= idle_timeout:
                    raise PeerTimeout(f"peer {self.rank} heard nothing from peer(s) {ranks_text(left)} for "
                                      f"{idle_timeout:g} s while waiting for their last messages (--round-timeout)"
                                      f"{impostors(self.liveness.foreign, left)}")
                self.raise_if_stopped(left)
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

    accepts = frozenset({"hello", "params", "welcome", "bye", "bye-ack", "up"})

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
        self.liveness.finished.discard(sender)

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
        self.liveness.finished.add(sender)

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


class LatestMailbox(GossipMailbox):
    """Asynchronous gossip: the newest message from each sender, replaced on arrival of a newer one.

    A sender that finishes says "bye" with the step of its last snapshot: when that is the snapshot held,
    its staleness stops growing (``Received.staleness``), and the sender, whose connection then drops, is
    finished rather than dead, so its last model stays in the mix of a peer that is still training."""

    accepts = frozenset({"hello", "params", "welcome", "bye", "up"})

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        super().__init__(rank, world_size, layout, expects)
        self._latest: dict[int, Received] = {}

    def _restart(self, sender: int) -> None:
        self._latest.pop(sender, None)  # its new incarnation counts steps from its checkpoint
        self.liveness.finished.discard(sender)

    def _file(self, message: Message) -> None:
        header = message.header
        if header.kind == "hello":
            return
        if not self.expects(header.sender, header.round):
            raise ProtocolError("not-neighbour",
                                f"peer {header.sender} is not our neighbour in its round {header.round}")
        held = self._latest.get(header.sender)
        if header.kind == "bye":
            self.liveness.finished.add(header.sender)
            if held is not None and held.message.header.step == header.step and held.final_step is None:
                held.final_step = self.local_step
            return
        if held is not None and header.step <= held.message.header.step:
            raise ProtocolError("replay", f"step {header.step} from peer {header.sender} is not newer than "
                                          f"the step {held.message.header.step} we hold")
        self.liveness.finished.discard(header.sender)  # (a forged bye is undone by the sender's next snapshot)
        self._latest[header.sender] = Received(message, self.local_step)

    def latest(self) -> dict[int, Received]:
        """The newest snapshot of every sender that is not dead."""
        with self._cond:
            dead = self._dead()
            return {j: r for j, r in self._latest.items() if j not in dead}
