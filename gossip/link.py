"""What an averager needs of the network: ``Link``, the few operations it calls, and ``Connect``, how it gets one.

An averager (and the parameter server) builds its mailbox first, then calls its ``connect(mailbox)`` for a
link that delivers into that mailbox. Real runs use the ZeroMQ transport (``gossip/net/transport.py``)
that ``gossip/connect.py connector`` builds from the run's configuration; the unit tests join averagers in
one process through ``tests/memory_link.py``, without sockets.

What a link owes its mailbox, from whatever thread it runs on:

- ``mailbox.deliver(authenticated, frames, connection)`` for every message: the frames ``encode`` made
  (``gossip/net/wire.py``), as buffers the link owns; ``authenticated`` the sender's proven rank or None;
  ``connection`` a serial naming the inbound connection it came on (None: not known). A ``ProtocolError``
  it raises drops that message, counted in ``statistics()["dropped"]`` by its reason.
- ``mailbox.link(dest, up)`` when its own connection to ``dest`` is made or lost (not for the server);
- ``mailbox.connection_closed(connection)`` when an inbound connection closes;
- ``mailbox.fail(exc)`` when the link itself breaks, after which ``post`` and ``offer`` raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gossip.mailbox import Mailbox


class Sent(Protocol):
    """One tracked ``post``: ``wait`` returns True once the link holds none of the frames' memory any more
    (sent to every destination, or dropped), so the sender may write to it again."""

    def wait(self, timeout: float) -> bool: ...


class Link(Protocol):
    """One peer's way to the others, by rank."""

    @property
    def started(self) -> bool:
        """``start`` ran and ``close`` has not: messages can be posted."""

    def start(self) -> None:
        """Listen, so that messages to us are delivered to the mailbox from now on."""

    def post(self, dests: Sequence[int], frames: list[Any], *, latest_only: bool, timeout: float,
             track: bool = False) -> Sent | None:
        """Queue ``frames`` for every rank in ``dests``, in order per destination. ``latest_only`` replaces
        a queued, unsent ``latest_only`` message instead of waiting; otherwise wait up to ``timeout`` seconds
        for room (``PeerTimeout`` after that). ``track``: return a ``Sent`` for the frames' memory."""

    def offer(self, dests: Sequence[int], frames: list[Any], timeout: float) -> list[int]:
        """Queue ``frames`` only for the ranks in ``dests`` with nothing queued (never waiting for room, never
        replacing); the ranks that took it. Push-sum keeps the mass of a message not taken."""

    def forget(self, dest: int) -> None:
        """Stop sending to ``dest`` (declared dead): drop what is queued for it and close the connection; a
        later post to it connects afresh."""

    def close(self, flush_timeout: float | None = None) -> None:
        """Deliver what is queued for up to ``flush_timeout`` seconds (0: drop it), then stop."""

    def statistics(self) -> dict[str, Any]:
        """Counters for the run's summary: ``bytes_sent``, ``bytes_received``, ``messages_sent``,
        ``messages_received``, ``replaced``, ``dropped`` (by reason), ``routes``, ``send_buffers``."""


Connect = Callable[["Mailbox"], Link]  # the averager's mailbox -> the link that delivers into it
