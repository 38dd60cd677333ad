"""Synchronous gossip, D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?", NeurIPS 2017): x_i <- sum_j W_ij x_j with the neighbours' weights of the same round, and
the local gradient step computed while the exchange is in flight.

At mixing point r a peer sends a snapshot s_i of its weights for round r and returns to training at once.
At mixing point r + 1 it waits (only for its in-neighbours; there is no global barrier) for their round-r
snapshots and adds sum_j W_ij (s_j - s_i) to its weights, which by then also hold the local progress made
meanwhile. With no local progress this is exactly x <- W x per round; since the columns of W sum to
one, the correction sums to zero over peers and the mean of the weights is preserved.

A neighbour whose snapshot has not arrived within ``round_timeout`` is given up as lost (a crashed
process, a dead host: torchrun with ``--max-restarts 0`` leaves the other workers running): the round is
mixed without it, as if its weight W_ij had been ours, and it is neither waited for nor sent to again.
The survivors keep training; only the mean over the lost peer's neighbourhood stops being exact.
"""

from __future__ import annotations

import logging

import torch

from gossip.averagers.base import Averager
from gossip.mailbox import RoundMailbox

log = logging.getLogger("gossip.sync")


class SyncGossip(Averager):
    _pending: tuple[int, list[torch.Tensor]] | None = None

    def _make_mailbox(self) -> RoundMailbox:
        def expects(sender: int, round: int) -> bool:
            return sender in self.topology.in_neighbors(self.rank, round)

        return RoundMailbox(self.rank, self.config.world_size, self.flat.layout, expects,
                            window=max(2, self.config.world_size))

    def _gossip(self) -> None:
        snapshot = self._complete_round(take_snapshot=True)
        round = self.rounds
        self._pending = (round, self._send_snapshot(round, latest_only=False, snapshot=snapshot))

    def _finish(self) -> None:
        self._complete_round(take_snapshot=False)

    def _complete_round(self, take_snapshot: bool) -> list[torch.Tensor] | None:
        """Wait for the pending round's messages and mix them in; optionally return the next snapshot,
        copied while the mixed weights are still in cache."""
        if self._pending is None:
            return None
        round, own = self._pending
        self._pending = None
        senders = [j for j in self.topology.in_neighbors(self.rank, round) if j not in self.lost]
        with self._timed_wait():
            messages = self.mailbox.wait_round(round, senders, self.config.round_timeout)
        if len(messages) < len(senders):
            self._lose(set(senders) - messages.keys(), round)
        row = self.topology.mixing_matrix(round)[self.rank]
        terms = [(-float(sum(row[j] for j in messages)), own)]
        terms += [(float(row[sender]), message.chunks) for sender, message in messages.items()]
        with self._timed_mix():
            snapshot = self.flat.combine_(terms, snapshot=take_snapshot)
        self.rounds = round + 1
        return snapshot

    def _lose(self, missing: set[int], round: int) -> None:
        self.lost |= missing
        for peer in missing:
            self.transport.forget(peer)
        log.warning("peer %d: nothing from peer(s) %s for round %d within %g s (--round-timeout); going on "
                    "without them", self.rank, ", ".join(map(str, sorted(missing))), round, self.config.round_timeout)
