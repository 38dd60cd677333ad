"""Synchronous gossip: D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
Algorithms?", NeurIPS 2017) written as push-sum (Kempe, Dobra & Gehrke, "Gossip-based computation of
aggregate information", FOCS 2003; Assran et al., "Stochastic Gradient Push for Distributed Deep
Learning", ICML 2019), with the local step computed while the exchange is in flight.

Besides its model z_i every peer holds a weight w_i; x_i = w_i z_i is its part of the network's mass. At
mixing point r it takes a snapshot (s_i, w_i^s), keeps the share W_ii of that mass and pushes the share
W_ki to each out-neighbour k (it sends s_i and w_i^s once; the receiver takes its share from the same W),
then returns to training. At mixing point r + 1, its model holding the local progress made meanwhile, it
adds what arrived, a message from j carrying the mass m_j = W_ij w_j^s:

    x_i = w_i^s z_i - (1 - W_ii) w_i^s s_i + sum_j m_j s_j,    w_i = W_ii w_i^s + sum_j m_j,    z_i = x_i / w_i

that is push-sum's rule (``PushSumMass.mix``, ``mass.py``) with the progress credited with c = w_i^s
(``snapshot_credit``) and the share k kept: W_ii plus the shares of dead out-neighbours (``_kept_share``).
The columns of W sum to one, so no mass is created or lost whichever round a message is mixed in:
sum_i x_i / sum_i w_i moves only by local progress. With every message on time and every w = 1 (W doubly
stochastic) this is exactly D-PSGD's z_i += sum_j W_ij (s_j - s_i), i.e. x <- W x per round.

Without overlap (``overlap`` False, ``--no-overlap``), mixing point r sends the live weights (s_i = z_i,
uncopied on the CPU), waits for round r's messages and mixes them at once, so the own-snapshot term
folds into the first: x_i = W_ii w_i z_i + sum_j m_j s_j, three arrays and no copy. With overlap the
snapshot is copied only when the weights are written before the next mix (training); a peer that only
mixes sends them uncopied too, and its next mixing point is the no-overlap one. What was sent stays
unchanged until ZeroMQ lets go of it (``gossip/averagers/sent.py``, ``gossip/writes.py``).

How long to wait (``deadline``):

- ``fixed``: for every in-neighbour's round-r message, up to ``round_timeout``, then fail naming it.
  The peers stay in lockstep and the run follows x <- W x exactly (tests check this to 1e-12).
- ``adaptive``: for each in-neighbour at most its learned deadline (``gossip/deadlines.py``), then mix what
  has arrived. A message that missed its round is merged into its sender's pending mass
  (``MassMailbox``) and mixed at a later mixing point, so the mean is kept although no round waits for a
  straggler. At the end a peer waits for every message addressed to it, so the final mass is complete.

Dead neighbours (both deadlines): a neighbour whose connection dropped and stayed down for
``peer_timeout`` seconds (the transport's monitor and ZeroMQ heartbeats tell), or that started again, is
dead: we stop waiting for it, mix what did arrive, stop sending to it and keep the share W_ki we would
have pushed to it, so the columns of the survivors' W still sum to one. Its mass at the moment it died
is lost and the push-sum weights renormalise: the survivors go on averaging among themselves, their
weighted mean now moving only by their own progress. A peer restarted with ``--resume`` says hello; its
neighbours re-admit it at their next mixing point and it rejoins their round (``_rejoin``), with the
mass of its checkpoint (or the mean of their models, weight 1, without one): new mass, so the weighted
mean shifts toward that model once, by its share of the total weight.

``weight_by="samples"``: before each snapshot the weight is set to the samples trained since the previous
mixing point (z unchanged), so a contribution counts in proportion to the samples it represents, and
push-sum makes each round's result exactly the sample-weighted average of what was mixed, without the
drift that renormalising each peer's own row would cause.

An outer optimizer (``--outer-optimizer``, decentralized DiLoCo: ``gossip/averagers/outer.py``) ends every
mix: the mixed z_i moves by an outer step on the change since its last one. It needs this mixing point's
weights from the neighbours, so the mix is not overlapped (``_gossip_in_place``), and fixed deadlines
without ``weight_by``: every weight stays 1, and a doubly stochastic W keeps the network's mean through
the outer step too (``outer.py`` says what varying weights did).

``aggregate`` "median" or "trimmed-mean" (``gossip/aggregate.py``; fixed deadlines, no sample weights):
at mixing point r + 1 a peer adds z_i += agg(s_i, s_j for the in-neighbours j) - s_i instead, each snapshot
counting once (whatever weight its header claims, 0 included), so the local progress made during the
exchange is kept as in the mean. The weights stay 1 and no mass is pushed: one neighbour's garbage cannot
move the result beyond its honest inputs, but the network's mean is no longer preserved exactly.
"""

from __future__ import annotations

import time

import torch

from gossip.aggregate import aggregate_into_
from gossip.averagers.mailboxes import MassMailbox, RoundMailbox
from gossip.averagers.mass import PushSumMass
from gossip.averagers.neighbours import GossipAverager
from gossip.averagers.sent import SentWeights
from gossip.deadlines import ArrivalDeadlines
from gossip.net.wire import Header


def snapshot_credit(own_weight: float, total: float) -> float:
    """The mass the local progress since our snapshot is credited with: the snapshot's weight w_i^s. In
    lockstep every message is mixed one round after it was sent, so each unit of mass is credited with
    exactly one step per round."""
    return own_weight


class SyncGossip(GossipAverager):
    """gossip-sync: a round is sent at each mixing point (``_gossip``; ``_gossip_in_place`` without overlap) and
    completed at the next by push-sum's rule (``_complete_round``). It has this many methods because the
    whole round reads in this one class: what is sent and when it may change, the completion under both
    deadlines, the adaptive waits, and the rejoin after a restart."""

    takes_outer = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.mass = PushSumMass(self.flat, snapshot_credit)  # w_i, the pushed round, and the mix that completes it
        self.sent = SentWeights(self.flat, cfg, self.rank)  # what went out, and the watch for writes to it
        self.late_mixed = 0  # messages mixed after the round they were sent for
        sync = cfg.sync
        self.deadlines = ArrivalDeadlines(self.rank, sync.deadline_k, sync.deadline_floor, sync.deadline_window,
                                          sync.straggler_fraction, sync.pace_tolerance)
        self._wait_started: dict[int, float] = {}  # round -> when we started waiting for it (adaptive)

    @property
    def weight(self) -> float:
        """The push-sum weight w_i (checkpoints and traces read it)."""
        return self.mass.weight

    @property
    def adaptive(self) -> bool:
        return self.config.sync.deadline == "adaptive"

    def _make_mailbox(self) -> RoundMailbox | MassMailbox:
        if self.adaptive:
            return MassMailbox(self.rank, self.config.world_size, self.flat.layout, self._expects, self._share)
        return self._round_mailbox(self.flat.layout)

    def _gossip(self) -> None:
        if not self.config.overlaps or self.outer is not None:  # (the outer step needs this round's weights)
            self._gossip_in_place()
            return
        # Copy the next snapshot during the mix if the weights were written since the last mixing point
        # (training); else the next round most likely leaves them alone too, and they go uncopied.
        copy = self.sent.copy_next()
        snapshot = self._complete_round(take_snapshot=copy, final=False)
        round = self._open_round()
        if not copy:
            self.sent.sent_live(self._send_snapshot(round, latest_only=False, snapshot=list(self.flat.views()),
                                                    weight=self.weight, track=True), self._copy_before_write)
            self.mass.pushed(round, None, self._kept_share(round))
            return
        if snapshot is None:  # the first round
            snapshot = self.flat.snapshot()
        self.sent.sent_snapshot(self._send_snapshot(round, latest_only=False, snapshot=snapshot, weight=self.weight,
                                                    track=self.flat.device.type == "cpu"))
        self.mass.pushed(round, snapshot, self._kept_share(round))

    def _copy_before_write(self) -> None:
        """The weights sent uncopied are about to be written before the next mix: keep what was sent."""
        if self.mass.pending is not None and self.mass.pending.own is None:
            self.mass.pending.own = self.sent.copy_before_write()

    def _gossip_in_place(self) -> None:
        """``overlap`` off: send this round's weights themselves (uncopied on the CPU), wait for the
        neighbours' and mix them in before training goes on, with s_i = z_i: three arrays, no snapshot."""
        round = self._open_round()
        live = self.flat.device.type == "cpu" and self.config.robust.aggregate == "mean"
        own = None if live else self.flat.snapshot()  # (a GPU's weights go through host memory anyway)
        sent = list(self.flat.views()) if live else own
        self.sent.sent_live(self._send_snapshot(round, latest_only=False, snapshot=sent, weight=self.weight,
                                                track=live))
        self.mass.pushed(round, own, self._kept_share(round))
        self._complete_round(take_snapshot=False, final=False)

    def _open_round(self) -> int:
        """Before sending round ``rounds``: drop dead neighbours, set this round's push-sum weight; the round."""
        self._prune_dead()
        if self.config.sync.weight_by == "samples":
            self.mass.weight = float(self._represented_since_mix())
        return self.rounds

    def _kept_share(self, round: int) -> float:
        """W_ii plus the shares of the out-neighbours we did not send to (dead): push-sum mass stays with us
        instead of vanishing, so the survivors' mass is conserved and their weights renormalise."""
        column = self.topology.mixing_matrix(round)[:, self.rank]
        return float(column[self.rank]) + sum(float(column[k]) for k in self.topology.out_neighbours(self.rank, round)
                                               if k in self.dead)

    def _prepare_rejoin(self) -> None:
        if not self.adaptive:
            self.mailbox.anchored = False

    def _rejoin(self, found: bool, weight: float) -> None:
        """Restarted (``--resume``): take the others' round R (the latest any live neighbour of our first
        round is in), send a neighbour that re-admitted us in an earlier round J a massless message for each
        round J..R-1 it expects from us, which it is waiting for, so that it catches up, and drop what it
        sent us for those rounds; then go on in lockstep. On a time-varying graph the peers we did not wait
        for welcome us later, each in its own round J: one behind R gets its rounds J..R-1 when its welcome
        comes, while we wait for a round (``_catch_up``); one ahead of R sent us nothing for R..J-1, and we
        do not wait for those (``RoundMailbox.wait_round``). The local step jumps with the round, so we end
        with the others (``gossip_every`` steps per round)."""
        self.mass.weight = weight if found else 1.0
        first, rejoin = self._rejoin_round(found)
        if not self.adaptive:
            self._catch_up(first, rejoin)
            self.mailbox.anchor(rejoin)
        self._go_on_from(rejoin)

    def _takes_late_welcomes(self) -> bool:
        return not self.adaptive and self._rejoin_peers() != self._hello_peers()

    def _catch_up(self, welcomes: dict[int, Header], rejoin: int) -> None:
        """Send each of ``welcomes``' senders, re-admitting us in round J, a massless message for each round
        in J..``rejoin``-1 in which it is our out-neighbour."""
        for j, header in sorted(welcomes.items()):
            rounds = [r for r in range(header.round, rejoin) if j in self.topology.out_neighbours(self.rank, r)]
            if j in self.dead or not rounds:
                continue
            snapshot = self.flat.snapshot()
            for round in rounds:
                self.transport.post([j], self._snapshot_frames(round, snapshot, 0.0), latest_only=False,
                                    timeout=self.config.timeouts.send_timeout)

    def close(self, finish: bool = True) -> None:
        try:
            super().close(finish)
        finally:
            self.sent.close()

    def _finish(self) -> None:
        if not self.config.overlaps and self.adaptive and self.rounds > 0:
            # every round was mixed at its deadline; now wait for the late mass addressed to us (nothing sent)
            self.mass.pushed(self.rounds - 1, None, 1.0)
        self._complete_round(take_snapshot=False, final=True)

    def _complete_round(self, take_snapshot: bool, final: bool) -> list[torch.Tensor] | None:
        """Add what arrived for the pending round (and, adaptive, any late mass; ``final``: all of it);
        optionally return the next snapshot, copied while the mixed weights are still in cache."""
        pending = self.mass.take_pending()
        if pending is None:
            return None
        arrived = self._receive(pending.round, final=final)
        robust = self.config.robust
        if robust.aggregate != "mean":  # z_i += agg(s_i, s_j...) - s_i, no push-sum mass (see the docstring)
            models = [pending.own] + [chunks for _, chunks in arrived]  # once each, whatever weight (even 0) it claims
            with self._timed_mix():
                aggregate_into_(list(self.flat.views()), models, robust.aggregate, robust.trim_fraction,
                                relative_to=pending.own)
                if self.outer is not None:
                    self.outer.apply_()
                snapshot = self.flat.snapshot() if take_snapshot else None
            self.rounds = pending.round + 1
            return snapshot
        self.sent.release_live()
        # the next snapshot overwrites this one, block by block after reading it, once ZeroMQ has sent it:
        # no new model-sized allocation per round
        fuse = take_snapshot and self.outer is None  # (the outer step writes the weights after the mix)
        reuse = fuse and pending.own is not None and self.sent.snapshot_free(wait=not self.adaptive)
        with self._timed_mix():
            snapshot = self.mass.mix(pending, arrived, snapshot=fuse, into=pending.own if reuse else None)
            if self.outer is not None and self.mass.weight > 0.0:
                self.outer.apply_()  # z_i is mixed; the outer step moves it (the weight w_i stays: mass is kept)
                snapshot = self.flat.snapshot() if take_snapshot else None
        self.rounds = pending.round + 1
        return snapshot

    def _receive(self, round: int, final: bool) -> list[tuple[float, list[torch.Tensor]]]:
        """(mass, model chunks) of everything to add when completing ``round``."""
        senders = tuple(j for j in self.topology.in_neighbours(self.rank, round) if j not in self.dead)
        if not self.adaptive:
            with self._timed_wait():
                messages = self.mailbox.wait_round(round, senders, self.config.timeouts.round_timeout,
                                                   serve=lambda late: self._catch_up(late, self.resumed_at or 0))
            row = self.topology.mixing_matrix(round)[self.rank]
            # in rank order, not arrival order: the same sums in the same order make a run reproducible
            return [(float(row[j]) * m.header.weight, m.chunks) for j, m in sorted(messages.items())]
        with self._timed_wait():
            if final:
                self.mailbox.wait_counts(self._expected_counts(round), self.config.timeouts.round_timeout)
            else:
                self._wait_deadlines(round, senders)
        self._note_arrivals(round)
        return self.mass.take_arrived(self.mailbox)

    def _wait_deadlines(self, round: int, senders: tuple[int, ...]) -> None:
        start = self._wait_started[round] = time.monotonic()
        self._note_arrivals(round)
        # s/step times steps per round, as peers report theirs; this is mixing point mixing_points + 1
        own_pace = self.meter.step_seconds * self.local_step / (self.mixing_points + 1)
        deadlines = {j: start + self.deadlines.deadline(j, self.config.timeouts.round_timeout, own_pace,
                                                        self.mailbox.reported_pace(j)) for j in senders}
        missed = self.mailbox.wait_for(round, deadlines)
        for j in senders:
            self.deadlines.settle(j, j in missed)
        for old in [r for r in self._wait_started if r < round - 4 * self.config.sync.deadline_window]:
            del self._wait_started[old]

    def _note_arrivals(self, round: int) -> None:
        """Lateness of every message that arrived since we last looked, relative to the start of our wait
        for its round (0 if it came before we waited for it); count those that missed their round."""
        for sender, sent_for, arrived in self.mailbox.take_arrivals():
            late = sent_for < round
            self.late_mixed += late
            started = self._wait_started.get(sent_for)
            if started is not None or not late:  # lateness unknown once its round is forgotten
                self.deadlines.observe(sender, arrived - started if started is not None else 0.0)

    def _expected_counts(self, last_round: int) -> dict[int, int]:
        """How many messages each in-neighbour sends us in rounds 0..last_round."""
        first = self.resumed_at or 0  # a rejoined peer counts from the round it rejoined in
        if not self.topology.time_varying:
            return {sender: last_round + 1 - first for sender in self.topology.in_neighbours(self.rank, 0)}
        counts: dict[int, int] = {}
        for round in range(first, last_round + 1):
            for sender in self.topology.in_neighbours(self.rank, round):
                counts[sender] = counts.get(sender, 0) + 1
        return counts

    def statistics(self) -> dict:
        stats = {**super().statistics(), "weight": self.mass.weight}
        if self.config.overlaps:
            stats["snapshot_copies"] = self.sent.copies
        stats["relocated"] = self.sent.relocated
        if self.adaptive:  # (push-sum mass, mixed whenever it comes)
            stats.update(self.deadlines.statistics(), late_mixed=self.late_mixed,
                         last_mixed_rounds=self.mass.last_mixed_rounds)
        return stats
