"""A restarted gossip peer's rejoin state: this incarnation's nonce, the welcomes that re-admit it, and the
first models its neighbours send after welcoming it (when it pulls their mean instead of a checkpoint).

Each incarnation draws its own ``nonce`` and sends it in its hellos; a welcome is taken only while we rejoin
and only when it echoes that nonce, so one who never read our hello cannot welcome us. ``first`` holds each
welcome's header (the round and step its sender re-admitted us in); with ``keep_first``, the first model
each welcoming sender sends next is kept too, for ``take_models``.

On a time-varying graph we say hello to every peer but wait only for the welcomes of our first round's
neighbours; the others re-admit us whenever they next reach a mixing point. With ``late`` set after that
wait, their welcomes are still taken and queued (``take_late``): synchronous gossip owes each of them
the rounds between the one it re-admitted us in and the one we went on from.

Pure state: the owning mailbox holds its lock around every call.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import torch

from gossip.errors import ProtocolError
from gossip.net.wire import MAX_INT, Header, Message


class Rejoin:
    """Nonce, welcomes and first models of one incarnation (module docstring)."""

    def __init__(self) -> None:
        self.nonce = secrets.randbelow(MAX_INT - 1) + 1  # drawn by this incarnation, sent in our hellos
        self.rejoining = False  # welcomes are taken only while we rejoin
        self.first: dict[int, Header] = {}  # sender -> the header of its welcome
        self.keep_first = False  # rejoining without a checkpoint: also keep each sender's first model
        self.late = False  # after the rejoin's wait: still take welcomes, queued for ``take_late``
        self._late: dict[int, Header] = {}
        self._models: dict[int, list[torch.Tensor]] = {}

    def proves(self, header: Header) -> bool:
        """A welcome that echoes our hello's nonce is proven, whatever connection first spoke for its sender."""
        return (self.rejoining or self.late) and header.nonce == self.nonce

    def welcome(self, header: Header) -> None:
        """Take ``header``'s welcome (``sender`` takes us back in its round), or raise ``ProtocolError``."""
        if not (self.rejoining or self.late):
            raise ProtocolError("welcome", f"a welcome from peer {header.sender}, but we are not rejoining")
        if header.nonce != self.nonce:
            raise ProtocolError("welcome-nonce", f"a welcome in peer {header.sender}'s name that answers no hello "
                                                 "of ours")
        if header.sender in self.first:
            return
        self.first[header.sender] = header
        if not self.rejoining:
            self._late[header.sender] = header

    def end_wait(self, served: Iterable[int], late: bool) -> None:
        """The rejoin's wait is over and ``served`` are the welcomes it returned; with ``late``, go on taking
        welcomes, the ones that came since the wait returned queued as late already."""
        self.rejoining, self.late = False, late
        if late:
            self._late = {j: header for j, header in self.first.items() if j not in set(served)}

    def has_late(self) -> bool:
        return bool(self._late)

    def take_late(self) -> dict[int, Header]:
        """The welcomes that came after the rejoin's wait and were not taken yet."""
        late, self._late = self._late, {}
        return late

    def readmits_after(self, sender: int, round: int) -> bool:
        """Did ``sender`` re-admit us in a round after ``round`` (so it sent us nothing for that one)?"""
        welcome = self.first.get(sender)
        return welcome is not None and welcome.round > round

    def filed(self, message: Message) -> None:
        """A model-carrying message was filed: with ``keep_first``, keep its sender's first after its welcome."""
        sender = message.header.sender
        if self.keep_first and sender in self.first and message.chunks:
            self._models.setdefault(sender, [c.clone() for c in message.chunks])

    def take_models(self) -> dict[int, list[torch.Tensor]]:
        models, self._models, self.keep_first = self._models, {}, False
        return models

    def waiting(self, senders: set[int], gone: set[int]) -> set[int]:
        """Of ``senders``, those whose welcome (and, with ``keep_first``, the model that follows it) is still
        to come, leaving out ``gone``."""
        waiting = senders - self.first.keys() - gone
        if self.keep_first:
            waiting |= {j for j in self.first.keys() & senders if j not in self._models}
        return waiting

    def welcomes(self, senders: Iterable[int]) -> dict[int, Header]:
        return {j: self.first[j] for j in senders if j in self.first}
