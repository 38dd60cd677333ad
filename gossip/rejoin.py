"""A restarted gossip peer's rejoin state: this incarnation's nonce, the welcomes that re-admit it, and the
first models its neighbours send after welcoming it (when it pulls their mean instead of a checkpoint).

Each incarnation draws its own ``nonce`` and sends it in its hellos; a welcome is taken only while we rejoin
and only when it echoes that nonce, so one who never read our hello cannot welcome us. ``first`` holds each
welcome's header (the round and step its sender re-admitted us in); with ``keep_first``, the first model
each welcoming sender sends next is kept too, for ``take_models``.

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
        self._models: dict[int, list[torch.Tensor]] = {}

    def proves(self, header: Header) -> bool:
        """A welcome that echoes our hello's nonce is proven, whatever connection first spoke for its sender."""
        return self.rejoining and header.nonce == self.nonce

    def welcome(self, header: Header) -> None:
        """Take ``header``'s welcome (``sender`` takes us back in its round), or raise ``ProtocolError``."""
        if not self.rejoining:
            raise ProtocolError("welcome", f"a welcome from peer {header.sender}, but we are not rejoining")
        if header.nonce != self.nonce:
            raise ProtocolError("welcome-nonce", f"a welcome in peer {header.sender}'s name that answers no hello "
                                                 "of ours")
        self.first.setdefault(header.sender, header)

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
