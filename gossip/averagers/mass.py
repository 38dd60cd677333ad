"""A peer's push-sum mass: its weight w_i, the round it pushed and has yet to complete, and the rule that
completes that round with what arrived (``PushSumMass``). gossip-sync (``sync.py``) and asynchronous
push-sum (``pushsum.py``) each own one; they differ in when a round is completed and in the credit c.

Besides its model z_i every peer holds a weight w_i; x_i = w_i z_i is its part of the network's mass. It
pushed a snapshot (s_i, w_i^s), keeping the share k of that snapshot's mass (``Pending``). Completing the
round adds what arrived, a message from j carrying the mass m_j = W_ij w_j^s of j's snapshot s_j, credits
the local progress made since our own snapshot with mass c, and keeps the share k:

    x_i = c (z_i - s_i) + k w_i^s s_i + sum_j m_j s_j,    w_i = k w_i^s + sum_j m_j,    z_i = x_i / w_i

written as one ``FlatParams.combine_`` on z_i. When the live weights went out and nothing wrote them
since, s_i = z_i and the first two terms fold into k w_i^s z_i. The credit c(w_i^s, w_i) is the owner's
policy: gossip-sync credits the snapshot's weight (exact in lockstep), asynchronous push-sum every step
with mass rbar / r_i, bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gossip.averagers.mailboxes import MassMailbox
from gossip.flat import FlatParams

Credit = Callable[[float, float], float]  # (w_i^s, the new w_i) -> c, the mass the local progress is credited with
Arrived = list[tuple[float, list[torch.Tensor]]]  # (mass m_j, model chunks s_j) of each message to add


@dataclass
class Pending:
    """A round we pushed and have yet to complete."""

    round: int
    own: list[torch.Tensor] | None  # our snapshot s_i; None: the live weights went out (s_i = z_i)
    weight: float  # w_i^s, the snapshot's weight
    keep: float  # k: W_ii plus the shares of the out-neighbours it did not go to


class PushSumMass:
    """One peer's push-sum weight, its pending round, and the mix that completes it."""

    def __init__(self, flat: FlatParams, credit: Credit) -> None:
        self.flat = flat
        self.credit = credit
        self.weight = 1.0  # w_i; the model holds z_i = x_i / w_i
        self.pending: Pending | None = None
        self.last_mixed_rounds: dict[str, list[int]] = {}  # sender -> rounds of its messages the last mix took

    def pushed(self, round: int, own: list[torch.Tensor] | None, keep: float) -> None:
        """Round ``round`` went out with our current weight (``own``: its snapshot, None for the live
        weights), keeping the share ``keep`` of its mass: the round completed next."""
        self.pending = Pending(round, own, self.weight, keep)

    def take_pending(self) -> Pending | None:
        pending, self.pending = self.pending, None
        return pending

    def take_arrived(self, mailbox: MassMailbox) -> Arrived:
        """(mass, model chunks) of every message with mass ``mailbox`` holds; notes their
        rounds per sender (``last_mixed_rounds``: which snapshot of each neighbour this mix adds, for a
        replay)."""
        taken = mailbox.take_all()
        self.last_mixed_rounds = {str(j): held.rounds for j, held in sorted(taken.items()) if held.rounds}
        return [part for held in taken.values() for part in held.parts]

    def mix(self, pending: Pending, arrived: Arrived, snapshot: bool,
            into: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Complete ``pending`` with ``arrived`` by the rule above, in one pass that also gives up each message's
        frames; w_i becomes the total mass. ``snapshot``: return a copy of the result, taken in the same pass
        (``into`` that buffer, when given). With no mass left to divide by (a weight that underflowed) z stays
        as it is and w_i is 0."""
        total = pending.keep * pending.weight + sum(mass for mass, _ in arrived)
        if total <= 0.0:
            self.weight = 0.0
            return self.flat.snapshot() if snapshot else None
        if pending.own is None:  # we sent the live weights, so s_i = z_i: x_i = k w_i^s z_i + sum_j m_j s_j
            scale = pending.keep * pending.weight / total
            terms = [(scale - 1.0, list(self.flat.views()))] if scale != 1.0 else []
        else:  # x_i = c (z_i - s_i) + k w_i^s s_i + sum_j m_j s_j, the progress z_i - s_i credited with c
            credit = self.credit(pending.weight, total)
            terms = [(credit / total - 1.0, list(self.flat.views()))] if credit != total else []
            terms.append(((pending.keep * pending.weight - credit) / total, pending.own))
        terms += [(mass / total, chunks) for mass, chunks in arrived if mass > 0]
        self.weight = total
        return self.flat.combine_(terms, snapshot=snapshot, into=into, release=[chunks for _, chunks in arrived])
