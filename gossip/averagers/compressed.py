"""Compressed synchronous gossip (``--compress float16|int8``): CHOCO-Gossip, the consensus step of
CHOCO-SGD (Koloskova, Stich & Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms with
Compressed Communication", ICML 2019, Algorithm 2 with its memory-efficient bookkeeping of the
neighbours' copies).

Besides its model x_i every peer keeps a public copy x^_i, which every neighbour also holds, bit for
bit, as a replica. At mixing point r a peer compresses the difference to its public copy and moves the
copy by exactly what it sends, as every receiver will:

    q_i = Q(x_i - x^_i),    x^_i += q_i,    send q_i to every neighbour

and, once the neighbours' q_j of round r have arrived and moved its replicas x^_j += q_j,

    x_i += gamma * sum_j W_ij (x^_j - x^_i)          (j over the live neighbours)

Q is one of ``gossip/compression.py``'s codecs and gamma the consensus step (``--consensus-step``, 1 by
default: with 16- and 8-bit codecs the compression error is small enough for the full step, which
CHOCO's theory allows for any compressor close enough to the identity). What Q rounds away is not lost:
it stays in x_i - x^_i and goes out with the next q (error feedback), so x^ tracks x and the gossip
converges to exact consensus, not merely to the codec's precision.

Exactness: with W symmetric and every replica equal to its original, sum_i sum_j W_ij (x^_j - x^_i) = 0,
so the network's mean of x moves only by local progress, as in uncompressed gossip (to float32 rounding).
That needs every q delivered and applied once, in order: hence fixed deadlines (lockstep rounds) on a
fixed undirected topology, checked by the configuration. A dead neighbour's term is dropped on both
sides (its share moves to W_ii); a restarted peer cannot rebuild the replicas it lost, so ``--resume``
is refused with one line.

Overlap works as in ``SyncGossip``: with ``overlap`` the round-r mix happens at mixing point r + 1, the
local steps made meanwhile kept in x_i; without, right after the send. The messages are new tensors, so
nothing waits for ZeroMQ to let go of the weights. Memory: the public copy plus one replica per neighbour
(float32, float64 for float64 weights), beside the compressed messages in flight.

An outer optimizer (``--outer-optimizer``, decentralized DiLoCo with compressed messages) ends each
consensus step, as it ends ``SyncGossip``'s mix (``outer.py``): the mixed x_i moves by an outer step on the
change since its anchor, and the mix is the no-overlap one. What a peer then sends, Q(x_i - x^_i), is its
change since its last message: the inner steps and the outer step since, plus what earlier messages
rounded away (the error feedback of compressed pseudo-gradients, as ``gossip/coordinator/pseudograd.py``
keeps for ps-avg). The mean is kept as without the outer step: the consensus terms cancel over a
symmetric W, so sum_i delta_i is what the inner steps did.
"""

from __future__ import annotations

import dataclasses

import torch

import topologies
from gossip.averagers.base import log
from gossip.averagers.mailboxes import RoundMailbox
from gossip.averagers.neighbours import GossipAverager
from gossip.compression import add_decoded_, encode_difference_, scratch_numel
from gossip.config import GossipConfig
from gossip.errors import ConfigError
from gossip.flat import FlatParams
from gossip.link import Connect
from gossip.net.wire import CODEC_KINDS, encode, frames_per_row


class CompressedGossip(GossipAverager):
    takes_outer = True  # (the consensus step ends with the outer step, as SyncGossip's mix does)

    def __init__(self, flat: FlatParams, config: GossipConfig, topology: topologies.Topology | None,
                 outer: tuple[str, float, float] | None = None, connect: Connect | None = None) -> None:
        # (the config refused a directed or time-varying topology)
        super().__init__(flat, config, topology, outer, connect)
        self._pending: int | None = None  # the round whose neighbours' differences are still to mix
        self.codec = self.config.compression.compress
        self._frames_per_row = frames_per_row(self.codec)
        self.public = self._zeros()  # x^_i, per segment
        neighbours = self.topology.in_neighbours(self.rank, 0) if self.topology is not None else ()  # (None: alone)
        self.replicas = {j: self._zeros() for j in neighbours}  # x^_j
        # one row's work space per dtype of the public copies
        largest = max(scratch_numel(stop - start) for _, start, stop in self.flat.plan)
        self._scratch = {p.dtype: torch.empty(largest, dtype=p.dtype, device=p.device) for p in self.public}

    def _zeros(self) -> list[torch.Tensor]:
        return [torch.zeros(s.numel(), dtype=torch.promote_types(s.dtype, torch.float32), device=s.device)
                for s in self.flat.segments]

    def _make_mailbox(self) -> RoundMailbox:
        mailbox = self._round_mailbox(dataclasses.replace(self.flat.layout, codec=self.config.compression.compress))
        mailbox.accepts = frozenset({"hello", "welcome", CODEC_KINDS[self.config.compression.compress]})
        return mailbox

    def _prepare_rejoin(self) -> None:
        raise ConfigError("--compress cannot rejoin a restarted peer: its neighbours' copies of its public model "
                          "died with it; run without --compress (or --max-restarts) to restart peers")

    def _prune_dead(self) -> None:
        """As ``GossipAverager._prune_dead``, except that a neighbour that started again stays out: the
        replicas of its public copy died with it, so neither side could take the consensus step again."""
        for peer in sorted(self.mailbox.take_restarted()):
            self.dead.add(peer)
            self.transport.forget(peer)
            log.warning("peer %d: peer %d started again, but compressed gossip cannot take it back (its public "
                        "copy is lost); going on without it", self.rank, peer)
        super()._prune_dead()

    def _gossip(self) -> None:
        overlap = self.config.overlaps and self.outer is None  # (the outer step needs this round's mix)
        if overlap:
            self._complete_round()
        self._prune_dead()
        round = self.rounds
        self._send_difference(round)
        self._pending = round
        if not overlap:
            self._complete_round()

    def _send_difference(self, round: int) -> None:
        """q_i = Q(x_i - x^_i) for every frame of the plan, x^_i += q_i, and send q_i."""
        frames = []
        with self._timed_mix():
            for view, (segment, start, stop) in zip(self.flat.views(), self.flat.plan):
                public = self.public[segment][start:stop]
                frames += encode_difference_(self.codec, view, public, self._scratch[public.dtype])
        if self.flat.device.type != "cpu":
            frames = [frame.cpu() for frame in frames]
        header = self._payload_header(CODEC_KINDS[self.codec], round, weight=1.0)
        self.transport.post(self._live_out_neighbours(round), encode(header, frames), latest_only=False,
                            timeout=self.config.timeouts.send_timeout)

    def _finish(self) -> None:
        """Mix the differences of the round still in flight before the sockets close."""
        self._complete_round()

    def _complete_round(self) -> None:
        """Wait for the pending round's differences, move the replicas by them, and take the consensus
        step x_i += gamma sum_j W_ij (x^_j - x^_i), frame by frame while each is in cache."""
        if self._pending is None:
            return
        round, self._pending = self._pending, None
        senders = tuple(j for j in self.topology.in_neighbours(self.rank, round) if j not in self.dead)
        with self._timed_wait():
            messages = self.mailbox.wait_round(round, senders, self.config.timeouts.round_timeout)
        for j in self.dead & self.replicas.keys():  # a dead neighbour's term is gone for good
            del self.replicas[j]
        row, step = self.topology.mixing_matrix(round)[self.rank], self.config.compression.consensus_step
        shares = [(float(row[j]), self.replicas[j], message.chunks) for j, message in sorted(messages.items())
                  if j in self.replicas]  # (not from a neighbour declared dead: its term is gone)
        per_row = self._frames_per_row
        with self._timed_mix():
            for index, (view, (segment, start, stop)) in enumerate(zip(self.flat.views(), self.flat.plan)):
                for share, replica, chunks in shares:
                    mine = replica[segment][start:stop]
                    add_decoded_(mine, self.codec, chunks[index * per_row:(index + 1) * per_row],
                                 self._scratch[mine.dtype])
                    view.add_(mine, alpha=step * share)
                if shares:
                    view.add_(self.public[segment][start:stop], alpha=-step * sum(share for share, _, _ in shares))
            if self.outer is not None:
                self.outer.apply_()  # on the weights the consensus step mixed (see the module docstring)
        self.rounds = round + 1

    def statistics(self) -> dict:
        return {**super().statistics(), "compress": self.codec}
