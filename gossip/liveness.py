"""Who is alive, and who is who, among the senders of one mailbox: connections, links, dead peers, restarts.

A peer sends to us over one connection at a time. ``Liveness`` remembers which inbound connection each
sender's latest message came on and which of those have closed, so that a second open connection speaking
for the same rank is refused (``foreign_connection``; the mailbox counts each in ``foreign``). It follows our own links
(``link``: up, down, how often each dropped), the neighbours declared dead and those that said bye, and
from these tells who is dead (``dead``). A second hello is a restart only with proof that the old process
is gone (``hello_again``); a restart is reported through the owner's ``restarted`` callback and kept until
``take_restarted``. It keeps the nonce of each sender's latest hello (``nonce_of``), for a welcome to echo.

Pure state: the owning mailbox holds its lock around every call and passes the time (its clock) in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from gossip.net.wire import Message

CONFIRM_SECONDS = 1.0  # a second hello waits this long for the drop of our link that proves a restart


class Liveness:
    """Connections, links, dead peers, restarts and hello nonces of one mailbox's senders (module docstring).
    ``restarted(sender, held)`` is the owner's: a new incarnation of ``sender`` is believed, and ``held`` is
    its hello that waited for confirmation (None: the hello being delivered now), to be filed."""

    def __init__(self, restarted: Callable[[int, Message | None], None]) -> None:
        self._restarted_callback = restarted
        self.foreign: Counter[int] = Counter()  # sender -> messages in its name refused as another connection's
        self._came_on: dict[int, int] = {}  # sender -> the inbound connection of its latest filed message
        self._closed_connections: set[int] = set()  # those of them that have closed
        self.up: set[int] = set()  # neighbours we have completed a handshake with at least once
        self._down_since: dict[int, float] = {}  # neighbour -> when our connection to it dropped
        self._drops: Counter[int] = Counter()  # neighbour -> times our connection to it dropped
        self._drops_at_hello: dict[int, int] = {}  # neighbour -> _drops when we last believed its hello
        self.declared: set[int] = set()  # declared dead and not re-admitted since
        self.finished: set[int] = set()  # said bye (gossip-async): disconnected, but not dead
        self._restarted: set[int] = set()  # said hello a second time: a new incarnation, not yet re-admitted
        # said hello again while its old connection (or our link to it) was up: since when, the connection
        # whose close would confirm it (None: our link's drop would), the connection the hello came on, the hello
        self._unconfirmed: dict[int, tuple[float, int | None, int | None, Message]] = {}
        self._nonces: dict[int, int] = {}  # sender -> the nonce of its latest hello that we took

    # -- connections ------------------------------------------------------------------------------------
    def foreign_connection(self, sender: int, connection: int | None) -> bool:
        """A message in ``sender``'s name over a connection other than that of its latest message, which
        is still open. A peer sends to us over one connection at a time (its DEALER's); a new one replaces
        it only once it has closed (a restart, or a link that dropped), so a second open one speaking for
        the same rank is someone else's. Refused whatever it claims: no stranger's message, however
        plausible, can then make the sender's later genuine ones stale, hold a slot as a proven
        connection, or speak for the sender to a server."""
        owner = self._came_on.get(sender)
        # (a connection not known yet is a new one)
        return owner is not None and owner not in self._closed_connections and connection != owner

    def came_on(self, sender: int, connection: int | None) -> bool:
        """Whether ``connection`` is the one ``sender``'s latest filed message came on."""
        return connection is not None and self._came_on.get(sender) == connection

    def took(self, sender: int, connection: int | None, hello: Message | None, again: bool) -> None:
        """A message of ``sender`` was filed (``hello``: it was a hello; ``again``: a second one)."""
        if hello is not None:
            self._nonces[sender] = hello.header.nonce
        if not again:
            self._note_connection(sender, connection)
            if hello is not None:
                self._drops_at_hello[sender] = self._drops[sender]

    def _note_connection(self, sender: int, connection: int | None) -> None:
        if connection is not None and self._came_on.get(sender) != connection:
            self._came_on[sender] = connection
            self._closed_connections &= set(self._came_on.values())

    def connection_closed(self, connection: int, now: float) -> None:
        """An inbound connection closed (a process ended, or a link was cut): it may confirm a held hello."""
        if connection in self._came_on.values():
            self._closed_connections.add(connection)
        for sender, (since, previous, new, hello) in list(self._unconfirmed.items()):
            if previous == connection:
                del self._unconfirmed[sender]
                if now - since < CONFIRM_SECONDS:
                    self._believe_restart(sender, new, hello)

    # -- restarts ---------------------------------------------------------------------------------------
    def hello_again(self, sender: int, connection: int | None, hello: Message, now: float) -> bool:
        """A second hello; False when it is held rather than taken. A new incarnation is a new process: its
        hello comes over a new connection, and the old process's connection closed when it ended. Believed
        when the connection of ``sender``'s latest message has closed (or it was declared dead, or we never
        had a link to it either way: a peer never dials its in-neighbours, so on a directed graph the link
        we know of is the one it made to us); a hello over that same connection is no restart. Where the
        transport could not name the connections (a message ahead of its connection's accept event),
        believed when our link to ``sender`` dropped since its last hello. Otherwise it is held for
        ``CONFIRM_SECONDS``, in case the close (or drop) is reported just after the hello, and forgotten
        after: a hello forged in a live neighbour's name does not make us stop waiting for it, even after
        our link to it flapped, and is not filed (a server would answer it with the whole model)."""
        previous = self._came_on.get(sender)
        if sender in self.declared or (sender not in self.up and (previous is None
                                                                  or previous in self._closed_connections)):
            self._believe_restart(sender, connection)
        elif connection is not None and previous is not None:
            if connection == previous:
                return True
            if previous in self._closed_connections:
                self._believe_restart(sender, connection)
            else:
                self._unconfirmed[sender] = (now, previous, connection, hello)
                return False
        elif self._drops[sender] > self._drops_at_hello.get(sender, 0):
            self._believe_restart(sender, connection)
        else:
            self._unconfirmed[sender] = (now, None, connection, hello)
            return False
        return True

    def _believe_restart(self, sender: int, connection: int | None, held: Message | None = None) -> None:
        self._unconfirmed.pop(sender, None)
        self._drops_at_hello[sender] = self._drops[sender]
        self._note_connection(sender, connection)
        self._restarted.add(sender)
        if held is not None:  # a hello held for confirmation: its nonce is the new incarnation's
            self._nonces[sender] = held.header.nonce
        self._restarted_callback(sender, held)

    def take_restarted(self) -> set[int]:
        """Neighbours that came back since we last asked; they count as alive again from now on."""
        back, self._restarted = self._restarted, set()
        for peer in back:
            self.declared.discard(peer)
            self._down_since.pop(peer, None)
        return back

    def nonce_of(self, sender: int) -> int:
        """The nonce of ``sender``'s latest hello that we took (0: none), for our welcome to echo."""
        return self._nonces.get(sender, 0)

    # -- links and dead peers ---------------------------------------------------------------------------
    def link(self, peer: int, up: bool, now: float) -> None:
        """Our connection to ``peer`` dropped (``up`` False) or was (re)made; a drop may confirm a held hello."""
        if up:
            self._down_since.pop(peer, None)
            self.up.add(peer)
            return
        self._down_since.setdefault(peer, now)
        self._drops[peer] += 1
        held = self._unconfirmed.get(peer)
        if held is not None and held[1] is None:  # (a hello held on a connection waits for its close)
            since, _, new, hello = self._unconfirmed.pop(peer)
            if now - since < CONFIRM_SECONDS:
                self._believe_restart(peer, new, hello)

    def linked(self, peer: int) -> bool:
        """We completed a handshake with ``peer`` and our connection to it is up."""
        return peer in self.up and peer not in self._down_since

    def dead(self, now: float, peer_timeout: float) -> set[int]:
        """Neighbours not to wait for: disconnected for ``peer_timeout`` seconds, declared dead, or replaced
        by a new incarnation that is not re-admitted yet. A finished neighbour is not dead."""
        lost = {j for j, since in self._down_since.items() if now - since >= peer_timeout and j not in self.finished}
        return lost | self.declared | self._restarted

    def link_drops(self) -> dict[str, int]:
        """How often our connection to each neighbour dropped (a flap, a death or a restart)."""
        return {str(j): n for j, n in sorted(self._drops.items())}

    def declare_dead(self, peers: Iterable[int]) -> None:
        self.declared.update(peers)
