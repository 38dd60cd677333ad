"""Where the event loop leaves validated messages for the training thread: the part every mailbox shares.

``deliver`` runs on the loop thread (it is the transport's handler): it decodes and validates, checks that
the sender is who its connection says and that it is expected, bounds every number the header claims, and
files the message (``_file``, each kind of mailbox its own way). The training thread waits on a condition
variable for what it needs; once the transport has failed (``fail``) every wait raises with the reason.
Liveness lives here too: links that drop, second hellos, neighbours declared dead or restarted.
The gossip modes' mailboxes are in ``gossip/averagers/mailboxes.py``, the parameter server's and its
workers' in ``gossip/coordinator/mailboxes.py``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from gossip.errors import PeerFailed, PeerTimeout, ProtocolError, TransportError
from gossip.net.wire import MAX_INT, Header, Layout, Message, decode
from gossip.progress import SwarmProgress
from gossip.signals import raise_if_signalled

CONFIRM_SECONDS = 1.0  # a second hello waits this long for the drop of our link that proves a restart
Expects = Callable[[int, int], bool]  # (sender, round) -> is sender one of our in-neighbours then


class Mailbox:
    """Shared part: decoding, sender checks, hellos, and the condition the training thread waits on.

    ``world_size`` counts every rank that may send (workers and the server in the parameter-server modes);
    ``accepts`` names the message kinds this mailbox files; any other kind is dropped.
    """

    accepts: frozenset[str] = frozenset({"hello", "params", "welcome"})
    hears_stops = False  # gossip: a neighbour's "abort", or its layout unlike ours, stops us (``_stops``)

    def __init__(self, rank: int, world_size: int, layout: Layout, expects: Expects) -> None:
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.expects = expects
        # What no honest header exceeds (0: unbounded); the averager sets them from its config.
        self.max_rounds = self.max_steps = 0
        self.max_weight = 0.0
        self.rejoining = False  # welcomes are taken only while we rejoin
        # drawn by this incarnation, sent in our hellos: a welcome is taken only when it echoes it, so one
        # who never read our hello cannot welcome us (``nonce_of``: the neighbours' latest, to echo theirs)
        self.nonce = secrets.randbelow(MAX_INT - 1) + 1
        self._nonces: dict[int, int] = {}
        self.local_step = 0  # written by the training thread, read at arrival
        self._cond = threading.Condition()
        # what each blocked ``_wait`` still misses (its predicate): a delivery wakes the waiters only when
        # one of them misses nothing any more, not once per message
        self._waiting: list[Callable[[], set[int]]] = []
        self._blind = 0  # waiters blocked without a registered predicate (woken by every delivery)
        self._heard: set[int] = set()  # senders we have had any message from
        self.reported: dict[int, Header] = {}  # sender -> the header of its latest message (speed, pace)
        self.progress: SwarmProgress | None = None  # gossip-async: every peer's latest step, merged on arrival
        # Liveness (gossip modes): see ``link``, ``dead`` and ``take_restarted``.
        self.peer_timeout = 3.0
        self.clock = time.monotonic  # liveness's clock (a test advances its own instead of sleeping)
        self.failure: BaseException | None = None  # the transport's, once one of its tasks died
        # Peers that stopped the run, and why: their "abort", or their model layout unlike ours. Believed at
        # once when it came over the connection of the sender's latest accepted message (or with CURVE,
        # from the sender's key); otherwise (``held_stops``) only while that sender stays silent and
        # unlinked (``raise_if_stopped``).
        self._stops: dict[int, str] = {}
        self._held_stops: dict[int, tuple[str, float]] = {}  # sender -> (reason, since)
        self._down_since: dict[int, float] = {}  # neighbour -> when our connection to it dropped
        self._restarted: set[int] = set()  # said hello a second time: a new incarnation, not yet re-admitted
        # said hello again while its old connection (or our link to it) was up: since when, the connection
        # whose close would confirm it (None: our link's drop would), the connection the hello came on, the hello
        self._unconfirmed: dict[int, tuple[float, int | None, int | None, Message]] = {}
        self.foreign: Counter[int] = Counter()  # sender -> messages in its name refused as another connection's
        self._came_on: dict[int, int] = {}  # sender -> the inbound connection of its latest filed message
        self._closed_connections: set[int] = set()  # those of them that have closed
        self._drops: Counter[int] = Counter()  # neighbour -> times our connection to it dropped
        self._drops_at_hello: dict[int, int] = {}  # neighbour -> _drops when we last believed its hello
        self._declared: set[int] = set()  # declared dead and not re-admitted since
        self._up: set[int] = set()  # neighbours we have completed a handshake with at least once
        self._finished: set[int] = set()  # said bye (gossip-async): disconnected, but not dead
        self.first: dict[int, Header] = {}  # each sender's first non-hello message header (for rejoining)
        self.keep_first = False  # rejoining without a checkpoint: also keep each sender's first model
        self._first_models: dict[int, list[torch.Tensor]] = {}

    def deliver(self, authenticated: int | None, frames: Sequence[Any], connection: int | None = None) -> None:
        """The transport's handler: ``authenticated`` is the sender's rank proven by its CURVE key, or None;
        ``connection`` the serial of the inbound connection it came on (None: not known yet)."""
        try:
            message = decode(frames, self.layout, self.world_size)
        except ProtocolError as exc:
            if self.hears_stops and exc.reason == "fingerprint" and exc.sender is not None and exc.sender != self.rank \
                    and authenticated in (None, exc.sender):
                self._note_stop(exc.sender, f"the peers' models differ: peer {exc.sender}'s has layout {exc.layout}, "
                                            f"peer {self.rank}'s {self.layout.fingerprint}; every peer must build "
                                            "the same model", authenticated, connection)
            raise
        sender = message.header.sender
        if authenticated is not None and authenticated != sender:
            raise ProtocolError("sender-mismatch", f"peer {authenticated} claims to be peer {sender}")
        if sender == self.rank:
            raise ProtocolError("sender", f"a message claims to come from ourselves (peer {sender})")
        if message.header.kind == "abort" and self.hears_stops:
            self._note_stop(sender, message.header.reason, authenticated, connection)
            return
        if message.header.kind not in self.accepts:
            raise ProtocolError("kind", f"a {message.header.kind} message from peer {sender} has no place here")
        self._check_claims(message.header)
        kind = message.header.kind
        with self._cond:
            again = kind == "hello" and (sender in self._heard or sender in self._declared)
            # a welcome that echoes our hello's nonce is proven, whatever connection first spoke for its sender
            proven = kind == "welcome" and self.rejoining and message.header.nonce == self.nonce
            if again:  # "I restarted": believed, or held until the old connection closes (``_hello_again``)
                if not self._hello_again(sender, connection, message):
                    raise ProtocolError("hello-held", f"a second hello in peer {sender}'s name came over another "
                                                      f"connection than its last message, which is still open")
            elif not proven and self._foreign(sender, connection):
                self.foreign[sender] += 1
                raise ProtocolError("connection", f"a {kind} in peer {sender}'s name came over another connection "
                                                  f"than its last message, which is still open")
            if kind == "welcome":  # we restarted, and ``sender`` takes us back in its round
                if not self.rejoining:
                    raise ProtocolError("welcome", f"a welcome from peer {sender}, but we are not rejoining")
                if message.header.nonce != self.nonce:
                    raise ProtocolError("welcome-nonce", f"a welcome in peer {sender}'s name that answers no hello "
                                                         "of ours")
                self.first.setdefault(sender, message.header)
            else:
                self._file(message)
            # only what was filed counts: a rejected message neither greets nor reports a pace
            if kind == "hello":
                self._nonces[sender] = message.header.nonce
            if not again:
                self._note_connection(sender, connection)
                if kind == "hello":
                    self._drops_at_hello[sender] = self._drops[sender]
                elif kind not in ("bye", "bye-ack", "welcome"):
                    self.reported[sender] = message.header
                    if self.keep_first and sender in self.first and message.chunks:
                        self._first_models.setdefault(sender, [c.clone() for c in message.chunks])
            if self.progress is not None and message.header.progress:  # (a bye's too: the end spreads with it)
                self.progress.merge(message.header.progress)
            self._heard.add(sender)
            self._held_stops.pop(sender, None)  # it speaks: whoever said it stopped was not it
            if self._blind or not self._waiting or not all(missing() for missing in self._waiting):
                self._cond.notify_all()

    def _note_stop(self, sender: int, reason: str, authenticated: int | None, connection: int | None) -> None:
        """``sender`` stopped the run, for ``reason`` (see ``_stops``)."""
        with self._cond:
            if authenticated == sender or (connection is not None and self._came_on.get(sender) == connection):
                self._stops.setdefault(sender, reason)
            else:
                self._held_stops.setdefault(sender, (reason, self.clock()))
            self._cond.notify_all()

    def raise_if_stopped(self, waiting_for: set[int] = frozenset()) -> None:
        """``PeerFailed`` when a peer stopped the run: a believed stop at once; a held one when we wait for
        its sender (``waiting_for``), have heard nothing from it since, have no live link to it (a peer that
        could not even listen never completes a handshake; one that is up was named by someone else), and
        ``peer_timeout`` has passed."""
        with self._cond:
            if self._stops:
                raise PeerFailed(next(iter(self._stops.values())))
            for sender in waiting_for & self._held_stops.keys():
                reason, since = self._held_stops[sender]
                linked = sender in self._up and sender not in self._down_since
                if not linked and self.clock() - since >= self.peer_timeout:
                    raise PeerFailed(reason)

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
        if self.max_steps and header.progress and max(header.progress) > self.max_steps:
            raise ProtocolError("horizon", f"peer {sender} reports a peer at step {max(header.progress)}; the run "
                                           f"has {self.max_steps}")

    def _hello_again(self, sender: int, connection: int | None, hello: Message) -> bool:
        """A second hello (lock held); False when it is held rather than taken. A new incarnation is a new
        process: its hello comes over a new connection, and the old process's connection closed when it
        ended. Believed when the connection of ``sender``'s latest message has closed (or it was declared
        dead, or we never had a link to it either way: a peer never dials its in-neighbours, so on a
        directed graph the link we know of is the one it made to us); a hello over that same connection is
        no restart. Where the transport could not name the connections (a message ahead of its
        connection's accept event), believed when our link to ``sender`` dropped since its last hello.
        Otherwise it is held for ``CONFIRM_SECONDS``, in case the close (or drop) is reported just after
        the hello, and forgotten after: a hello forged in a live neighbour's name does not make us stop
        waiting for it, even after our link to it flapped, and is not filed (a server would answer it
        with the whole model)."""
        previous = self._came_on.get(sender)
        if sender in self._declared or (sender not in self._up and self._open(previous) is None):
            self._believe_restart(sender, connection)
        elif connection is not None and previous is not None:
            if connection == previous:
                return True
            if previous in self._closed_connections:
                self._believe_restart(sender, connection)
            else:
                self._unconfirmed[sender] = (self.clock(), previous, connection, hello)
                return False
        elif self._drops[sender] > self._drops_at_hello.get(sender, 0):
            self._believe_restart(sender, connection)
        else:
            self._unconfirmed[sender] = (self.clock(), None, connection, hello)
            return False
        return True

    def _open(self, connection: int | None) -> int | None:
        """``connection`` if it is known and has not closed."""
        return connection if connection is not None and connection not in self._closed_connections else None

    def _foreign(self, sender: int, connection: int | None) -> bool:
        """A message in ``sender``'s name over a connection other than that of its latest message, which
        is still open (lock held). A peer sends to us over one connection at a time (its DEALER's); a new
        one replaces it only once it has closed (a restart, or a link that dropped), so a second open one
        speaking for the same rank is someone else's. Refused whatever it claims: no stranger's message,
        however plausible, can then make the sender's later genuine ones stale, hold a slot as a proven
        connection, or speak for the sender to a server."""
        owner = self._open(self._came_on.get(sender))
        return owner is not None and connection != owner  # (a connection not known yet is a new one)

    def _believe_restart(self, sender: int, connection: int | None, held: Message | None = None) -> None:
        self._unconfirmed.pop(sender, None)
        self._drops_at_hello[sender] = self._drops[sender]
        self._note_connection(sender, connection)
        self._restarted.add(sender)
        self._restart(sender)
        if held is not None:  # a hello held for confirmation: filed now (a server answers it)
            self._nonces[sender] = held.header.nonce
            try:
                self._file(held)
            except ProtocolError:
                pass

    def nonce_of(self, sender: int) -> int:
        """The nonce of ``sender``'s latest hello that we took (0: none), for our welcome to echo."""
        with self._cond:
            return self._nonces.get(sender, 0)

    def _note_connection(self, sender: int, connection: int | None) -> None:
        if connection is not None and self._came_on.get(sender) != connection:
            self._came_on[sender] = connection
            self._closed_connections &= set(self._came_on.values())

    def connection_closed(self, connection: int) -> None:
        """The transport: an inbound connection closed (a process ended, or a link was cut)."""
        with self._cond:
            if connection in self._came_on.values():
                self._closed_connections.add(connection)
            for sender, (since, previous, new, hello) in list(self._unconfirmed.items()):
                if previous == connection:
                    del self._unconfirmed[sender]
                    if self.clock() - since < CONFIRM_SECONDS:
                        self._believe_restart(sender, new, hello)
            self._cond.notify_all()

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
                held = self._unconfirmed.get(peer)
                if held is not None and held[1] is None:  # (a hello held on a connection waits for its close)
                    since, _, new, hello = self._unconfirmed.pop(peer)
                    if self.clock() - since < CONFIRM_SECONDS:
                        self._believe_restart(peer, new, hello)
            self._cond.notify_all()

    def _dead(self) -> set[int]:
        """Neighbours not to wait for (lock held): disconnected for ``peer_timeout`` seconds, declared dead,
        or replaced by a new incarnation that is not re-admitted yet. A finished neighbour is not dead."""
        now = self.clock()
        lost = {j for j, since in self._down_since.items()
                if now - since >= self.peer_timeout and j not in self._finished}
        return lost | self._declared | self._restarted

    def link_drops(self) -> dict[str, int]:
        """How often our connection to each neighbour dropped (a flap, a death or a restart)."""
        with self._cond:
            return {str(j): n for j, n in sorted(self._drops.items())}

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
            raise PeerTimeout(f"peer {self.rank} heard nothing from peer(s) {ranks_text(missing)} within {timeout:g} s "
                              f"of starting (--startup-timeout); are they running, on the same --base-port?"
                              f"{self.impostors(missing)}")

    def impostors(self, senders: Iterable[int]) -> str:
        """For a timeout's line: how many messages in the name of ``senders`` were refused for coming over a
        second connection while the first was open (a stranger that spoke for one of them first holds its
        name until its connection closes); empty when none were."""
        with self._cond:
            refused = {j: self.foreign[j] for j in senders if self.foreign[j]}
        if not refused:
            return ""
        return (f"; {sum(refused.values())} message(s) in the name of peer(s) {ranks_text(refused)} were refused for "
                "coming over a second connection while another one spoke for them: a stranger may hold their "
                "names (run with --secure)")

    def fail(self, exc: BaseException) -> None:
        """The transport died (its ``on_failure``): every wait raises with the reason instead of timing out."""
        with self._cond:
            self.failure = exc
            self._cond.notify_all()

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
