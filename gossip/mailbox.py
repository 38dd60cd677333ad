"""Where the event loop leaves validated messages for the training thread: the part every mailbox shares.

``deliver`` runs on the loop thread (it is the transport's handler): it decodes and validates, checks that
the sender is who its connection says and that it is expected, bounds every number the header claims, and
files the message (``_file``, each kind of mailbox its own way). The training thread waits on a condition
variable for what it needs; once the transport has failed (``fail``) every wait raises with the reason.
Three parts sit under the same lock: who is alive and who is who (``gossip/liveness.py``: connections,
links, dead peers, restarts), and, in the gossip modes only, the peers that stopped the run
(``gossip/stops.py``) and our own rejoin after a restart (``gossip/rejoin.py``: nonce, welcomes, first
models). The gossip modes' mailboxes are in ``gossip/averagers/mailboxes.py``, the parameter server's and
its workers' in ``gossip/coordinator/mailboxes.py``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gossip.errors import PeerFailed, PeerTimeout, ProtocolError, TransportError
from gossip.liveness import Liveness
from gossip.net.wire import Header, Layout, Message, decode
from gossip.progress import SwarmProgress
from gossip.rejoin import Rejoin
from gossip.signals import raise_if_signalled
from gossip.stops import Stops

__all__ = ["Expects", "Mailbox", "check_claims", "impostors", "ranks_text"]

Expects = Callable[[int, int], bool]  # (sender, round) -> is sender one of our in-neighbours then


class Mailbox:
    """Filing and waits: decoding, sender and claim checks, the condition the training thread waits on,
    and the transport's failure. Composes ``liveness`` (every mailbox), and ``stops`` and ``rejoin``
    (given by the gossip mailboxes; None for the parameter server's and its workers').

    ``world_size`` counts every rank that may send (workers and the server in the parameter-server modes);
    ``accepts`` names the message kinds this mailbox files; any other kind is dropped.
    """

    accepts: frozenset[str] = frozenset({"hello"})

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects, *,
                 stops: Stops | None = None, rejoin: Rejoin | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.expects = expects
        # What no honest header exceeds (0: unbounded); the averager sets them from its config.
        self.max_rounds = self.max_steps = 0
        self.max_weight = 0.0
        self.local_step = 0  # written by the training thread, read at arrival
        self._cond = threading.Condition()
        # what each blocked ``_wait`` still misses (its predicate): a delivery wakes the waiters only when
        # one of them misses nothing any more, not once per message
        self._waiting: list[Callable[[], set[int]]] = []
        self._blind = 0  # waiters blocked without a registered predicate (woken by every delivery)
        self._heard: set[int] = set()  # senders we have had any message from
        self.reported: dict[int, Header] = {}  # sender -> the header of its latest message (speed, pace)
        self.progress: SwarmProgress | None = None  # gossip-async: every peer's latest step, merged on arrival
        self.failure: BaseException | None = None  # the transport's, once one of its tasks died
        self.peer_timeout = 3.0
        self.clock = time.monotonic  # liveness's clock (a test advances its own instead of sleeping)
        self.liveness = Liveness(self._restarted)
        # gossip: a neighbour's "abort", or its layout unlike ours, stops us; the welcomes that re-admit us
        self.stops, self.rejoin = stops, rejoin

    def deliver(self, authenticated: int | None, frames: Sequence[Any], connection: int | None = None) -> None:
        """The transport's handler: ``authenticated`` is the sender's rank proven by its CURVE key, or None;
        ``connection`` the serial of the inbound connection it came on (None: not known yet)."""
        try:
            message = decode(frames, self.layout, self.world_size)
        except ProtocolError as exc:
            if self.stops is not None and exc.reason == "fingerprint" and exc.sender is not None \
                    and exc.sender != self.rank and authenticated in (None, exc.sender):
                self._note_stop(exc.sender, f"the peers' models differ: peer {exc.sender}'s has layout {exc.layout}, "
                                            f"peer {self.rank}'s {self.layout.fingerprint}; every peer must build "
                                            "the same model", authenticated, connection)
            raise
        header = message.header
        sender, kind = header.sender, header.kind
        if authenticated is not None and authenticated != sender:
            raise ProtocolError("sender-mismatch", f"peer {authenticated} claims to be peer {sender}")
        if sender == self.rank:
            raise ProtocolError("sender", f"a message claims to come from ourselves (peer {sender})")
        if kind == "abort" and self.stops is not None:
            self._note_stop(sender, header.reason, authenticated, connection)
            return
        if kind not in self.accepts:
            raise ProtocolError("kind", f"a {kind} message from peer {sender} has no place here")
        check_claims(header, self.max_rounds, self.max_steps, self.max_weight)
        with self._cond:
            again = self._admit(message, connection)
            if kind == "welcome":  # we restarted, and ``sender`` takes us back in its round
                self.rejoin.welcome(header)
            elif kind != "up":
                self._file(message)
            # only what was filed counts: a rejected message neither greets nor reports a pace
            self.liveness.took(sender, connection, message if kind == "hello" else None, again)
            if not again and kind not in ("hello", "bye", "bye-ack", "welcome", "up"):
                self.reported[sender] = header
                if self.rejoin is not None:
                    self.rejoin.filed(message)
            if self.progress is not None:  # gossip-async: who has started, and how far
                if kind == "up":
                    self.progress.note_started(peer for peer, flag in enumerate(header.progress) if flag)
                elif kind == "hello":
                    self.progress.note_started((sender,))
                elif header.progress:  # (a bye's too: the end spreads with it)
                    self.progress.merge(header.progress)
            self._heard.add(sender)
            if self.stops is not None:
                self.stops.spoke(sender)
            if self._blind or not self._waiting or not all(missing() for missing in self._waiting):
                self._cond.notify_all()

    def _admit(self, message: Message, connection: int | None) -> bool:
        """Whether ``message`` is a second hello (lock held), after refusing one that is held for
        confirmation (``Liveness.hello_again``) and any message over another connection than that of its
        sender's latest (``Liveness.foreign_connection``), unless it is a welcome that answers our hello."""
        sender, kind = message.header.sender, message.header.kind
        again = kind == "hello" and (sender in self._heard or sender in self.liveness.declared)
        proven = kind == "welcome" and self.rejoin is not None and self.rejoin.proves(message.header)
        if again:  # "I restarted": believed, or held until the old connection closes
            if not self.liveness.hello_again(sender, connection, message, self.clock()):
                raise ProtocolError("hello-held", f"a second hello in peer {sender}'s name came over another "
                                                  f"connection than its last message, which is still open")
        elif not proven and self.liveness.foreign_connection(sender, connection):
            self.liveness.foreign[sender] += 1
            raise ProtocolError("connection", f"a {kind} in peer {sender}'s name came over another connection "
                                              f"than its last message, which is still open")
        return again

    def _note_stop(self, sender: int, reason: str, authenticated: int | None, connection: int | None) -> None:
        """``sender`` stopped the run, for ``reason`` (``gossip/stops.py``)."""
        with self._cond:
            believed = authenticated == sender or self.liveness.came_on(sender, connection)
            self.stops.note(sender, reason, believed, self.clock())
            self._cond.notify_all()

    def raise_if_stopped(self, waiting_for: set[int] = frozenset()) -> None:
        """``PeerFailed`` when a peer stopped the run: a believed stop at once, a held one of a sender in
        ``waiting_for`` once it has held long enough (``gossip/stops.py``)."""
        if self.stops is None:
            return
        with self._cond:
            reason = self.stops.reason(waiting_for, self.liveness.linked, self.clock(), self.peer_timeout)
        if reason is not None:
            raise PeerFailed(reason)

    def _restarted(self, sender: int, held: Message | None) -> None:
        """``Liveness`` believes a new incarnation of ``sender`` (lock held): forget what it starts over, and
        file its hello that was held for confirmation (a server answers it)."""
        self._restart(sender)
        if held is not None:
            try:
                self._file(held)
            except ProtocolError:
                pass

    def _restart(self, sender: int) -> None:
        """Forget per-sender state that a new incarnation of ``sender`` starts over (lock held)."""

    def _file(self, message: Message) -> None:
        """File a validated message, hellos included (called with the lock held)."""
        raise NotImplementedError

    # -- the transport's reports ------------------------------------------------------------------------
    def link(self, peer: int, up: bool) -> None:
        """The transport's monitor: our connection to ``peer`` dropped (``up`` False) or was (re)made."""
        with self._cond:
            self.liveness.link(peer, up, self.clock())
            self._cond.notify_all()

    def connection_closed(self, connection: int) -> None:
        """The transport: an inbound connection closed (a process ended, or a link was cut)."""
        with self._cond:
            self.liveness.connection_closed(connection, self.clock())
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The transport died (its ``on_failure``): every wait raises with the reason instead of timing out."""
        with self._cond:
            self.failure = exc
            self._cond.notify_all()

    # -- waits ------------------------------------------------------------------------------------------
    def wait_hellos(self, senders: Iterable[int], timeout: float) -> None:
        missing = self._wait(lambda: set(senders) - self._heard, timeout)
        if missing:
            raise PeerTimeout(f"peer {self.rank} heard nothing from peer(s) {ranks_text(missing)} within {timeout:g} s "
                              f"of starting (--startup-timeout); are they running, on the same --base-port?"
                              f"{impostors(self.liveness.foreign, missing)}")

    def _block(self, timeout: float, registered: bool = False) -> None:
        """``_cond.wait`` (lock held), raising ``TransportError`` once the transport has failed, and
        ``Stopped`` for a SIGINT/SIGTERM whose raise was lost (``gossip/signals.py``). A waiter that has not
        ``registered`` its predicate in ``_waiting`` (as ``_wait`` does) is woken by every delivery."""
        self._raise_if_failed()
        self.raise_if_stopped()
        raise_if_signalled()
        blind = 0 if registered else 1
        self._blind += blind
        try:
            self._cond.wait(timeout)
        finally:
            self._blind -= blind
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TransportError(f"peer {self.rank}'s transport failed: {self.failure!r}") from self.failure

    def _wait(self, missing: Callable[[], set[int]], timeout: float) -> set[int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiting.append(missing)
            try:
                while (left := missing()) and (remaining := deadline - time.monotonic()) > 0:
                    self.raise_if_stopped(left)
                    self._block(min(remaining, 0.5), registered=True)
            finally:
                self._waiting.remove(missing)
            return left


def ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def check_claims(header: Header, max_rounds: int, max_steps: int, max_weight: float) -> None:
    """Bound every number a header carries by what the run allows (0: unbounded), before anything changes:
    ``ProtocolError`` naming the claim."""
    sender = header.sender
    if max_weight and header.weight > max_weight:
        raise ProtocolError("weight", f"peer {sender} claims push-sum weight {header.weight:g}; the whole "
                                      f"network holds {max_weight:g}")
    if max_rounds and header.round > max_rounds + 1:
        raise ProtocolError("horizon", f"peer {sender} names round {header.round}; the run has {max_rounds}")
    if max_steps and header.step > max_steps:
        raise ProtocolError("horizon", f"peer {sender} names step {header.step}; the run has {max_steps}")
    if max_steps and header.progress and max(header.progress) > max_steps:
        raise ProtocolError("horizon", f"peer {sender} reports a peer at step {max(header.progress)}; the run "
                                       f"has {max_steps}")


def impostors(foreign: Counter[int], senders: Iterable[int]) -> str:
    """For a timeout's line: how many messages in the name of ``senders`` were refused for coming over a
    second connection while the first was open (``foreign``, as ``Liveness`` counts them: a stranger that
    spoke for one of them first holds its name until its connection closes); empty when none were."""
    refused = {j: foreign[j] for j in senders if foreign[j]}
    if not refused:
        return ""
    return (f"; {sum(refused.values())} message(s) in the name of peer(s) {ranks_text(refused)} were refused for "
            "coming over a second connection while another one spoke for them: a stranger may hold their "
            "names (run with --secure)")
