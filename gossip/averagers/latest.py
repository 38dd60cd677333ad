"""Asynchronous gossip: no barrier. At each mixing point a peer mixes the latest snapshot it holds from
each in-neighbour with weight W_ij * f(tau_j), renormalised, then sends its own snapshot on.

tau_j is the number of our own local steps since neighbour j's snapshot arrived; a snapshot is mixed again
at every mixing point until a newer one replaces it or tau_j exceeds ``max_staleness``. W_ij is taken from
the round in which j sent the snapshot, so time-varying graphs work although peers are in different rounds.
Sends keep only the newest unsent snapshot per neighbour, so a slow link or a dead peer never stalls us.
A neighbour declared dead (``peer_timeout`` after its connection dropped) no longer counts in the mix (the
others' weights are renormalised, as for a snapshot that is too stale); restarted, it is welcomed back.

Rate compensation (``--rate-compensation on``, the default): before each mix the progress since the last
one is scaled by rbar / r_i (``gossip/progress.py``), so a slow peer's steps count as much per unit of time
as a fast one's. This rule's mix is not doubly stochastic (renormalised staleness weights), so it keeps
no network mean and its fixed point is only near the mean of the peers' objectives; push-sum's is exact.
Every peer stops once the swarm has done ``--steps`` steps per peer on average.

A peer that finishes sends its final model and then "bye" with that model's step; a neighbour still
training holds it as finished: its tau stops growing, and the sender, whose connection then drops, is not
declared dead. So a peer that ends later than its neighbours (slower, or restarted) keeps mixing their
final models instead of training its last steps alone on its shard.

tau counts from arrival, not production: the transit time is not counted (peers share no clock), which on
a LAN is far below one step. Observability: ``statistics()["staleness"]`` is the histogram {tau: snapshots
mixed at that tau} (end event and summary), and ``last_mix`` the latest mix's coefficients (step events),
from which the weights can be checked against f.

``aggregate`` "median" or "trimmed-mean" (``gossip/aggregate.py``): x_i <- agg(x_i, s_j for every held
snapshot within ``max_staleness``), each counting once (``last_mix`` then names the rule and its
coefficients are null); staleness weights do not apply to it, so the config refuses them. While fewer
than 2 such snapshots are held but 2 or more in-neighbours are alive (a race, a slow neighbour), the
peer waits for more instead of trusting one alone; with 1 live in-neighbour left (the others dead) it
mixes with that one.
"""

from __future__ import annotations

from collections import Counter

from gossip.aggregate import MIN_INPUTS, aggregate_into_
from gossip.averagers.base import log
from gossip.averagers.mailboxes import LatestMailbox
from gossip.averagers.neighbours import GossipAverager
from gossip.errors import PeerTimeout
from gossip.net.wire import Header, encode
from gossip.staleness import stale_weights


class LatestGossip(GossipAverager):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.staleness: Counter[int] = Counter()  # tau of every snapshot mixed
        self.ignored_stale = 0
        # The coefficients of the latest mix, {"self": a, "<j>": [tau_j, W_ij, c_j]}, for the step log.
        self.last_mix: dict[str, object] = {}
        self._sent_step = -1  # the local step of the last snapshot we sent
        self._after_mix: list | None = None  # the model our last mix left (rate compensation scales from it)

    def _close_flush_seconds(self) -> float:
        # Snapshots are best effort, and a neighbour that already finished would never take ours; but a
        # hello or snapshot to a neighbour still connecting deserves a moment.
        return min(1.0, self.config.timeouts.shutdown_timeout)

    def _make_mailbox(self) -> LatestMailbox:
        return LatestMailbox(self.rank, self.config.world_size, self.flat.layout, self._expects)

    def _rejoin(self, found: bool, weight: float) -> None:
        """Restarted (``--resume``): once the neighbours welcomed us, jump to the latest step and round among
        them, so we end with them, and start from the mean of our checkpoint's model and theirs (theirs
        alone without a checkpoint). The checkpoint is older than their models by up to --checkpoint-every
        steps plus the restart; with no push-sum mass to conserve in this mode, one averaging step closes
        most of that gap at once, where plain mixing closed it only within about 2 points of accuracy."""
        first = self._rejoin_gossip(found, blend=True)
        if first:
            self.local_step = self.mailbox.local_step = max(self.local_step, max(h.step for h in first.values()))
            self.rounds = self.mixing_points = max(self.rounds, max(h.round for h in first.values()))
        self._mixed_at = (self.local_step, self.samples)
        self.resumed_at = self.rounds

    def _gossip(self) -> None:
        self._prune_dead()
        self._scale_progress()
        snapshot = self._mix_latest()
        if snapshot is None:
            snapshot = self.flat.snapshot()
        self.rounds += 1
        self._send_snapshot(self.rounds, latest_only=True, snapshot=snapshot)
        self._sent_step = self.local_step
        self._after_mix = snapshot if self.config.asynchronous.rate_compensation == "on" else None

    def _scale_progress(self) -> None:
        """Rate compensation: x <- s + c (x - s), the progress since our last mix (s, the model it left)
        scaled by c = rbar / r_i (``gossip/progress.py``), one fused pass."""
        factor = self._rate_factor()
        if factor != 1.0 and self._after_mix is not None:
            with self._timed_mix():
                self.flat.combine_([(factor - 1.0, list(self.flat.views())), (1.0 - factor, self._after_mix)],
                                   snapshot=False)

    def _finish(self) -> None:
        """The mixing point our last steps did not reach (there are steps since the last one, or there was
        none), as push-sum's drain takes in the neighbours' last messages; then send our final model and
        "bye" with its step: a neighbour still training keeps it in its mix as a model that grows no staler
        (``LatestMailbox``), instead of dropping it after --max-staleness of its own steps and training the
        rest alone on its shard. A peer that took no step before the swarm's budget was spent would
        otherwise end with its initial model while holding its neighbours' final ones."""
        if self.config.world_size < 2:
            return
        self._scale_progress()
        unmixed = self.local_step != self._mixed_at[0] or self.mixing_points == 0
        snapshot = self._mix_latest() if unmixed else None
        if snapshot is not None or self._sent_step != self.local_step:
            self._send_snapshot(self.rounds, latest_only=True, snapshot=snapshot)
            self._sent_step = self.local_step
        dests = self._live_out_neighbours(self.rounds)
        bye = Header(kind="bye", sender=self.rank, round=self.rounds, step=self.local_step,
                     progress=self.progress.vector() if self.progress is not None else ())
        try:
            self.transport.post(dests, encode(bye), latest_only=False, timeout=self.config.timeouts.send_timeout)
        except PeerTimeout:  # a neighbour that takes nothing more: it ages our snapshot out as before
            log.info("peer %d: no room to say bye to peer(s) %s", self.rank, dests)

    def _mix_latest(self) -> list | None:
        """Mix in the held snapshots; returns the copy of the result taken while mixing (None if nothing
        was mixed, and the caller snapshots itself)."""
        held = self.mailbox.latest()
        neighbours = {}
        for sender, received in held.items():
            w = float(self.topology.mixing_matrix(received.message.header.round)[self.rank, sender])
            neighbours[sender] = (w, received.staleness(self.local_step))
        self_weight = float(self.topology.mixing_matrix(self.rounds)[self.rank, self.rank])
        cfg = self.config
        self_coef, coefs = stale_weights(self_weight, neighbours, cfg.asynchronous.staleness_weight,
                                         cfg.asynchronous.staleness_temperature, cfg.asynchronous.max_staleness)
        self.ignored_stale += len(neighbours) - len(coefs)
        robust = cfg.robust.aggregate != "mean"  # each snapshot within max_staleness counts once, unweighted
        live = [j for j in self.topology.in_neighbours(self.rank, self.rounds) if j not in self.dead]
        if robust and len(coefs) + 1 < MIN_INPUTS <= len(live) + 1:
            coefs = {}  # too few to outvote one, and more are coming: wait for them (gossip/aggregate.py)
        self.last_mix = {("aggregate" if robust else "self"): cfg.robust.aggregate if robust else self_coef,
                         **{str(j): [neighbours[j][1], neighbours[j][0], None if robust else c]
                            for j, c in coefs.items()}}
        if not coefs:
            return None
        # x <- a x + sum_j c_j s_j, written as x += (a - 1) x + sum_j c_j s_j so it runs as one fused pass
        terms = [(self_coef - 1.0, list(self.flat.views()))]
        terms += [(coef, held[sender].message.chunks) for sender, coef in coefs.items()]
        for sender in coefs:
            self.staleness[neighbours[sender][1]] += 1
        with self._timed_mix():
            if robust:  # x <- agg(x, s_j...)
                models = [list(self.flat.views())] + [held[sender].message.chunks for sender in coefs]
                aggregate_into_(models[0], models, cfg.robust.aggregate, cfg.robust.trim_fraction)
                return self.flat.snapshot()
            return self.flat.combine_(terms, snapshot=True)

    def statistics(self) -> dict:
        return {**super().statistics(), "staleness": dict(sorted(self.staleness.items())),
                "ignored_stale": self.ignored_stale, "last_mix": self.last_mix}
