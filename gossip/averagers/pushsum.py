"""Asynchronous gossip as push-sum, the default rule of ``gossip-async``: no barrier, no peer ever waits for
another while it trains, every message is mixed exactly once, and the network's weighted average is kept
exactly, by construction. This is overlap SGP (Assran et al., "Stochastic Gradient Push for Distributed
Deep Learning", ICML 2019) without its bound on delay, i.e. asynchronous gradient push (Assran & Rabbat,
"Asynchronous Gradient Push", IEEE TAC 2020).

Every peer holds a model z_i and a push-sum weight w_i; x_i = w_i z_i is its part of the network's mass.
At each mixing point (every ``gossip_every`` steps, or every round of ``--schedule time``) it adds
whatever arrived since the last one, a message from j carrying the mass m_j = W_ij w_j^s of j's snapshot
s_j (all that j pushed to us meanwhile, in at most two parts: ``MassMailbox``), credits the local progress
made since its own last snapshot s_i with mass c, and keeps the share k of that snapshot's mass:

    x_i = c (z_i - s_i) + k w_i^s s_i + sum_j m_j s_j,    w_i = k w_i^s + sum_j m_j,    z_i = x_i / w_i

then takes the next snapshot s_i = z_i, w_i^s = w_i and pushes it to its out-neighbours. The formula of
``SyncGossip`` with overlap (``PushSumMass.mix``, ``mass.py``), except for c and that nothing is waited for:
what has not arrived is mixed at a later mixing point, whenever it comes.

- **Mass is kept.** k = W_ii plus the shares W_ki of the out-neighbours the snapshot did not go to: a dead
  or finished one, one whose previous message still waits in our outbox, or one that flow control holds
  back (``FlowWindow``, ``gossip/averagers/flow.py``: at most ``FLOW_WINDOW`` unanswered messages per
  link, sent again once the neighbour has sent us something; a massless ping until it first answers).
  Sending never blocks and never replaces an unsent message (which would lose its mass): the share stays
  with us and leaves with a later snapshot. So sum_i w_i plus the mass in flight is N at every moment and
  the weighted mean sum_i x_i / sum_i w_i moves only by local progress (tested to 1e-9).
- **Credit: every step counts 1/N.** c = 1, as in SGP, whose optimizer steps the numerator (x_i -= lr g):
  the network's mass moves by exactly the sum of all the peers' steps however messages and steps
  interleave, so the weighted mean moves by lr times the mean gradient per step (tested to 1e-9, with equal
  speeds and with a peer four times slower); with rate compensation (the default) c = rbar / r_i, below. Crediting the snapshot's weight w_i^s instead, exact in
  lockstep, over-credits here: a receiver can mix our pushed share (and credit it to its own next step)
  before our step ends; on a constant gradient the mean moved 1.24x the learning rate. The price of c = 1
  is SGP's: in z a step counts 1 / w_i, more for a light peer, less for a heavy one. It is bounded:
  c = min(1, CREDIT_BOUND w_i) (``credit_bounded`` counts the mixing points where the bound acted; with
  flow control the weights stayed within about 0.35-1.9 in our runs, so it did not).
- **Heterogeneous rates.** With flow control a link carries at most ``FLOW_WINDOW`` (1) message per step
  of the slower end, so a slow peer's weight stays near a fast one's and its snapshots are mixed once each,
  not once per step of the faster neighbours. (A window of 2 contracted a little faster with equal speeds,
  0.75-0.76 per step against 0.78-0.80 on a ring of 8 whose second eigenvalue is 0.80, but let mass pile
  up at a 4x slower peer: weight 2.8 at the end of the straggler benchmark, against 1.6.) With c = 1 a peer
  taking twice the steps would contribute twice the gradients, and the run would minimise a rate-weighted
  mean of the peers' objectives. Rate compensation (Assran & Rabbat's; ``--rate-compensation on``, the
  default) credits each step with c = rbar / r_i, the swarm's mean progress per own step
  (``gossip/progress.py``), so every peer's data moves the network's mass alike per unit of time and the
  fixed point is the minimiser of the plain mean. Only the ratios between peers matter: scaling every c
  alike changes the step size, not where it leads. (Scaling the step itself, x_i -= lr w_i g, a plain step
  on z, would need no rates without flow control, by a balance of mass, but flow control skews that
  balance: ``bench/rate_fairness.py``.)
- **The end.** Every peer stops once the swarm has done ``--steps`` steps per peer on average
  (``gossip/progress.py``), so all stop within about a step of each other whatever their speeds. It says "bye" to every peer it may have sent to, naming the
  number of rounds it sent that peer (one past the last), and drains: it waits until every in-neighbour
  said bye and its last message is in, mixing everything that arrives. A peer still training answers a
  bye with a "bye-ack" at its next mixing point and sends nothing more there (its share stays with it), so
  the finished peer's drain ends within a step, and a peer that trains on alone keeps its mass: every one
  of its last steps still counts 1/N. The final (z_i, w_i) of all peers hold exactly the network's mass,
  whose weighted average is the run's model (``model-final.pt``). A finishing peer waits only for its
  neighbours' last messages, never while it trains. A bye forged in a neighbour's name is undone by that
  neighbour's next message, and an answer nobody asked for is dropped (``PushSumMailbox``): a stranger's
  bye costs a few skipped messages on one link, never mass.
- **Dead neighbours** (``peer_timeout``) as in gossip-sync: not waited for, not sent to, their share kept;
  their mass at death is lost and the survivors' weights renormalise. A restarted one rejoins with its
  checkpoint's mass (``AsyncPushSum._rejoin``).
"""

from __future__ import annotations

import torch

from gossip.averagers.flow import FlowWindow
from gossip.averagers.mailboxes import PushSumMailbox
from gossip.averagers.mass import PushSumMass
from gossip.averagers.neighbours import GossipAverager
from gossip.errors import PeerTimeout
from gossip.net.wire import Header, encode

FLOW_WINDOW = 1  # messages per link that may wait unanswered (gossip/averagers/flow.py)
CREDIT_BOUND = 4.0  # a step moves z by at most this many times what the optimizer did (weight below 1 / 4)


class AsyncPushSum(GossipAverager):
    takes_outer = False  # (its weights vary: ``outer.py``)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mass = PushSumMass(self.flat, self._credit)  # w_i, the pushed snapshot, and the mix that completes it
        self._last_sent: dict[int, int] = {}  # out-neighbour -> the last round we queued a snapshot for it
        self.flow = FlowWindow(FLOW_WINDOW)
        self._said_bye: set[int] = set()  # peers told we send them nothing more (they finished, or we did)
        self.credit_bounded = 0  # mixing points whose progress was credited with less than 1 (_credit)
        self.credited_steps = 0.0  # the steps our progress moved the network's mass by: sum of credit x steps

    @property
    def weight(self) -> float:
        """The push-sum weight w_i (checkpoints and traces read it)."""
        return self.mass.weight

    def _make_mailbox(self) -> PushSumMailbox:
        return PushSumMailbox(self.rank, self.config.world_size, self.flat.layout, self._expects, self._share)

    def _rejoin(self, found: bool, weight: float) -> None:
        """Restarted (``--resume``): rejoin with our checkpoint's mass (without one, weight 1 and the mean of
        the neighbours' models) in the latest round any live neighbour is in; the local step jumps with it."""
        self.mass.weight = weight if found else 1.0
        _, round = self._rejoin_round(found)
        self._go_on_from(round)

    def _gossip(self) -> None:
        self._prune_dead()
        self._said_bye &= set(self.mailbox.bye_rounds)  # (a finished peer that started again is sent to again)
        for peer in sorted(set(self.mailbox.bye_rounds).intersection(self._peers_in_any_round()) - self._said_bye):
            # it finished: we send it nothing more
            self._say_bye(peer, "bye-ack")
        snapshot = self._complete_round(take_snapshot=True, final=False)
        if snapshot is None:  # the first mixing point: the steps so far go out with our whole mass, w = 1
            snapshot = self.flat.snapshot()
            self.credited_steps += self.mass.weight * (self.local_step - self._mixed_at[0])
        round = self.rounds
        dests = [k for k in self._live_out_neighbours(round) if k not in self.mailbox.bye_rounds]  # (finished)
        heard = {k: self.mailbox.received[k] for k in dests}  # (before sending: what arrives later is newer)
        answers = {k: self._expects(k, round) for k in dests}  # (k sends to us too)
        ready = [k for k in dests if self.flow.ready(k, heard[k], answers[k])]
        pings = [k for k in ready if heard[k] == 0 and answers[k]]
        # told we finished (a bye forged in our name): a massless message undoes that at once
        pings += [k for k in sorted(self.mailbox.take_contradicted()) if k in dests and k not in ready]
        sent = []  # the out-neighbours that got our mass
        for weight, group in ((self.mass.weight, [k for k in ready if k not in pings]), (0.0, pings)):
            if group:
                taken = self.transport.offer(group, self._snapshot_frames(round, snapshot, weight),
                                             self.config.timeouts.send_timeout)
                sent += taken if weight else []
                for dest in taken:
                    self.flow.sent(dest, heard[dest])
                    self._last_sent[dest] = round
        self.flow.hold(k for k in dests if k not in sent)
        column = self.topology.mixing_matrix(round)[:, self.rank]
        self.mass.pushed(round, snapshot, 1.0 - sum(float(column[k]) for k in sent))

    def _complete_round(self, take_snapshot: bool, final: bool) -> list[torch.Tensor] | None:
        """Add everything that arrived to the pushed snapshot (``final``: first wait for every in-neighbour's
        last message); optionally return the next snapshot, copied in the same pass."""
        pending = self.mass.take_pending()
        if pending is None:
            return None
        if final:
            with self._timed_wait():
                self.mailbox.wait_drained(self._peers_in_any_round(), self.config.timeouts.round_timeout)
        arrived = self.mass.take_arrived(self.mailbox)
        with self._timed_mix():
            snapshot = self.mass.mix(pending, arrived, snapshot=take_snapshot)
        self.rounds = pending.round + 1
        return snapshot

    def _credit(self, own_weight: float, total: float) -> float:
        """Every step is credited with mass 1, whatever our weight, as SGP steps x_i -= lr g: the network's
        mass then moves by exactly the sum of all peers' steps, however messages and steps interleave; with
        rate compensation, by rbar / r_i instead (``gossip/progress.py``), so that every peer's steps move it
        alike per unit of time. In z that step counts credit / w_i; at most ``CREDIT_BOUND`` times, so a peer
        whose weight fell far below its credit takes bounded steps (its credit is then CREDIT_BOUND w_i)."""
        credit = self._rate_factor()
        if CREDIT_BOUND * total < credit:
            self.credit_bounded += 1
            credit = CREDIT_BOUND * total
        self.credited_steps += credit * (self.local_step - self._mixed_at[0])
        return credit

    def _finish(self) -> None:
        """Say bye to everyone we may have sent to, then drain: mix in every in-neighbour's last messages."""
        if self.config.world_size < 2:
            return
        self.mailbox.draining = True  # (before the byes: an answer may come back at once)
        for dest in self._peers_in_any_round():
            if dest not in self.dead and dest not in self._said_bye:
                self._say_bye(dest, "bye")
        if self.mass.pending is None:  # no mixing point yet: only what arrived is added
            self.mass.pushed(self.rounds - 1, None, 1.0)
        self._complete_round(take_snapshot=False, final=True)

    def _say_bye(self, dest: int, kind: str) -> None:
        """Tell ``dest`` we send it nothing more, and how many rounds we sent it (one past the last): we
        finished ("bye"), or it did ("bye-ack": its drain ends as soon as our last message is in, while we
        train on)."""
        self._said_bye.add(dest)
        bye = Header(kind=kind, sender=self.rank, round=self._last_sent.get(dest, -1) + 1, step=self.local_step,
                     progress=self.progress.vector() if self.progress is not None else ())
        try:
            self.transport.post([dest], encode(bye), latest_only=False, timeout=self.config.timeouts.send_timeout)
        except PeerTimeout:  # its outbox stayed full: it no longer reads, so it will not wait for this
            self.transport.forget(dest)

    def _peers_in_any_round(self) -> tuple[int, ...]:
        """Everyone we may exchange with (every other peer on a time-varying graph)."""
        return self._rejoin_peers()

    def _close_flush_seconds(self) -> float:
        return self.config.timeouts.shutdown_timeout  # the byes must arrive: the neighbours wait for them

    def statistics(self) -> dict:
        return {**super().statistics(), "weight": self.mass.weight, "last_mixed_rounds": self.mass.last_mixed_rounds,
                "received": sum(self.mailbox.received.values()), "credit_bounded": self.credit_bounded,
                "credited_steps": self.credited_steps, "forged_byes": self.mailbox.forged_byes,
                "held_back": self.flow.statistics()}
