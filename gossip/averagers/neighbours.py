"""What gossip adds to every averager: neighbours from a topology, hellos, liveness and rejoining.

``SyncGossip`` (``sync.py``), ``CompressedGossip`` (``compressed.py``), ``AsyncPushSum`` (``pushsum.py``) and
``LatestGossip`` (``latest.py``) each build on ``GossipAverager`` with their own round; the parameter-server
worker (``gossip/coordinator/worker.py``) stands beside it on ``Averager``, with no neighbours. Every
mailbox learns from ``_expects`` whom a round's messages come from and, where messages carry push-sum mass,
from ``_share`` the share W_ij of it that is ours.

Liveness: at every mixing point ``_prune_dead`` stops sending to neighbours the mailbox finds dead
(connection down for ``peer_timeout``, or replaced by a new incarnation) and re-admits restarted ones with a
"welcome" naming our round and step. A restarted peer (``start(resume=...)``) says hello to everyone it may
exchange with and rejoins where their welcomes say the others are (``_rejoin_gossip``; the push-sum modes
in the latest round any of them is in: ``_rejoin_round``, ``_go_on_from``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import topologies
from gossip.averagers.base import Averager, log
from gossip.averagers.mailboxes import RoundMailbox
from gossip.averagers.outer import OuterStep
from gossip.config import GossipConfig
from gossip.errors import ConfigError, PeerTimeout
from gossip.flat import FlatParams
from gossip.link import Connect
from gossip.mailbox import ranks_text
from gossip.net.transport import Delivery
from gossip.net.wire import Header, Layout, encode, params_header, up_header
from gossip.progress import SwarmProgress

PAUSE_BOUND = 2.0  # rate compensation credits a step at most this many times our usual step's time
USUAL_SMOOTHING = 0.1


class GossipAverager(Averager):
    """An averager that exchanges with the neighbours ``topology`` gives it, round by round. It has this many
    methods because every gossip mode shares them: whom it hears from and its share of their mass, hellos,
    liveness and rejoining, the swarm's end and rate factor, and the messages it sends."""

    def __init__(self, flat: FlatParams, config: GossipConfig, topology: topologies.Topology | None,
                 outer: tuple[str, float, float] | None = None, connect: Connect | None = None) -> None:
        """``outer``: (optimizer, lr, momentum) of the outer step each mixing point ends with (``outer.py``,
        ``gossip.api.gossip_outer``); None: plain gossip. ``connect``: as ``Averager``'s."""
        self.topology = topology  # None for a peer alone; set before the mailbox, which asks for neighbours
        self.dead: set[int] = set()  # neighbours declared dead and not back
        self.deaths = self.readmitted = 0  # neighbours declared dead / re-admitted after a restart
        super().__init__(flat, config, connect)
        self.outer = OuterStep(flat, *outer) if outer is not None else None
        if self.outer is not None and not (self.takes_outer and config.sync.deadline == "fixed"
                                           and config.sync.weight_by == "none"):
            raise ConfigError(f"an outer optimizer ({outer[0]}, lr {outer[1]:g}, momentum {outer[2]:g}) needs the "
                              "lockstep mix of gossip-sync with fixed deadlines and no --weight-by, whose push-sum "
                              "weights all stay 1; use that, or ps-avg")
        if config.mode == "gossip-async":  # the swarm-wide end and the rate compensation (gossip/progress.py)
            self.progress = self.mailbox.progress = SwarmProgress(config.world_size, self.rank)
        self.rate_factor = 1.0  # what the latest progress counted (rate compensation)
        self._credited_at: float | None = None  # when it was credited (time.monotonic)
        self._usual_step: float | None = None  # moving average of the credited seconds per step

    takes_outer = False  # (the lockstep mixes, SyncGossip's and CompressedGossip's, end with the outer step:
    #                       ``outer.py`` says why only they)

    def _expects(self, sender: int, round: int) -> bool:
        """Is ``sender`` one of our in-neighbours in ``round``? (The mailbox files only their messages.)"""
        return sender in self.topology.in_neighbours(self.rank, round)

    def _share(self, sender: int, round: int) -> float:
        """W_ij of ``round``: our share of the push-sum mass ``sender`` sent in that round."""
        return float(self.topology.mixing_matrix(round)[self.rank, sender])

    def _round_mailbox(self, layout: Layout) -> RoundMailbox:
        """A mailbox of whole rounds, for the modes that mix in lockstep. On a fixed undirected graph a
        neighbour is at most one round ahead of us (it needs our message to finish each round); on a directed
        or time-varying one it can lead by as many rounds as the graph's diameter, at most N - 1."""
        lockstep = self.topology is None or not (self.topology.directed or self.topology.time_varying)
        return RoundMailbox(self.rank, self.config.world_size, layout, self._expects,
                            window=2 if lockstep else max(2, self.config.world_size))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def _restore(self, resume: dict[str, Any]) -> None:
        """The outer step's anchor and momentum, when the checkpoint has them and this run steps one."""
        if self.outer is not None and resume.get("outer"):
            self.outer.load_state_dict(resume["outer"])

    def done(self, steps: int) -> bool:
        if self.progress is None:
            return super().done(steps)
        return self.progress.spent(steps, within=self.meter.step_seconds) or self._past_horizon()

    def schedule_step(self) -> int:
        return self.local_step if self.progress is None else self.progress.mean_step()

    def _rate_factor(self) -> float:
        """At a mixing point: how much the progress since the last one counts, the seconds it took times the
        swarm's mean rate per step (``gossip/progress.py``: rbar / r_i) with rate compensation, else 1."""
        if self.progress is None or self.config.asynchronous.rate_compensation != "on":
            return 1.0
        steps = self.local_step - self._mixed_at[0]
        if not steps:
            return 1.0
        # the whole cycle since the last credit, its mix included: the time in which this progress was made;
        # a pause beyond PAUSE_BOUND times our usual step (the others finishing and saving on a shared CPU)
        # is not credited: it would make one late step count many times over
        now = time.monotonic()
        seconds, self._credited_at = now - (self._credited_at or self._round_began), now
        usual = self._usual_step or seconds / steps
        seconds = min(seconds, PAUSE_BOUND * usual * steps)
        self._usual_step = usual + USUAL_SMOOTHING * (seconds / steps - usual)
        self.rate_factor = self.progress.rate_factor(seconds, steps)
        return self.rate_factor

    def _hello_peers(self) -> tuple[int, ...]:
        return self.topology.neighbours(self.rank, 0) if self.config.world_size > 1 else ()

    def _greet(self) -> None:
        """Say hello to every first-round neighbour and wait for theirs; in gossip-async then also until
        every peer is known to be up (``_wait_for_everyone``)."""
        neighbours = self._hello_peers()
        self.transport.post(neighbours, self._hello(), latest_only=False, timeout=self.config.timeouts.send_timeout)
        deadline = time.monotonic() + self.config.timeouts.startup_timeout
        self.mailbox.wait_hellos(neighbours, self.config.timeouts.startup_timeout)
        if self.progress is not None and self.config.world_size > 1:
            self._wait_for_everyone(deadline)

    def _wait_for_everyone(self, deadline: float) -> None:
        """gossip-async's start (``gossip/progress.py``): the swarm's budget is shared, so no first step
        before every peer is known to be up. Tell whoever we may exchange with which peers we know of, again
        whenever that grows, until it is all of them."""
        told: frozenset[int] = frozenset()
        world = self.config.world_size
        while True:
            started = self.progress.started()
            if started != told:
                self.transport.post(self._rejoin_peers(), encode(up_header(self.rank, started, world)),
                                    latest_only=False, timeout=self.config.timeouts.send_timeout)
                told = started
            if len(started) == world:
                return
            missing = self.mailbox.wait_started(len(started), deadline - time.monotonic())
            if missing:
                raise PeerTimeout(f"peer {self.rank} has no word that peer(s) {ranks_text(missing)} started within "
                                  f"{self.config.timeouts.startup_timeout:g} s of starting (--startup-timeout); "
                                  "gossip-async takes its first step once every peer is up: are they all "
                                  "running, on the same --base-port?")

    def _rejoin_gossip(self, found: bool, blend: bool = False) -> dict[int, Header]:
        """The gossip modes' rejoin: say hello to everyone we may exchange with, who re-admit us at their
        next mixing point with a "welcome" naming their round and step, and wait (``round_timeout``) for
        the welcome of each live neighbour; those that send none are declared dead. Without a checkpoint
        (``found`` False) take the mean of the models they send next: a pull; with one and ``blend``, the
        mean of ours and theirs. Returns the welcomes."""
        peers = self._rejoin_peers()
        self.mailbox.rejoin.keep_first = not found or blend
        self.mailbox.rejoin.rejoining = True
        self.transport.post(peers, self._hello(), latest_only=False, timeout=self.config.timeouts.send_timeout)
        with self._timed_wait():
            first = self.mailbox.wait_first(self._hello_peers(), self.config.timeouts.round_timeout)
        self.mailbox.end_rejoin_wait(first, late=self._takes_late_welcomes())
        silent = set(self._hello_peers()) - first.keys()
        if silent:
            self.mailbox.declare_dead(silent)
        self._prune_dead()
        if first and (blend or not found):
            self._pull(include_own=found)
            if self.outer is not None:  # the next outer step measures the change from the model we now hold
                self.outer.reanchor()
        self.mailbox.rejoin.keep_first = False
        log.info("peer %d rejoined: heard from peer(s) %s at rounds %s%s", self.rank,
                 ", ".join(map(str, sorted(first))) or "none", sorted({h.round for h in first.values()}),
                 "; took the mean of ours and theirs" if found and blend and first else
                 "" if found else "; took their mean model (no checkpoint)")
        return first

    def _takes_late_welcomes(self) -> bool:
        """Whether the welcomes of the peers we did not wait for are still taken after the rejoin's wait
        (``gossip/rejoin.py``): only a mode that owes those peers something does."""
        return False

    def _rejoin_round(self, found: bool) -> tuple[dict[int, Header], int]:
        """The push-sum modes' rejoin (``_rejoin_gossip``): the welcomes, and the round to go on in, the latest
        any live neighbour is in (ours, if that is later)."""
        first = self._rejoin_gossip(found)
        return first, max([self.rounds] + [header.round for header in first.values()])

    def _go_on_from(self, round: int) -> None:
        """Rejoined: take ``round`` as ours. The local step jumps with the round under schedule "steps", so we
        end with the others (``gossip_every`` steps per round)."""
        self.rounds = self.mixing_points = self.resumed_at = round
        if self.config.graph.schedule == "steps":
            self.local_step = self.mailbox.local_step = max(self.local_step, round * self.config.graph.gossip_every)
        self._mixed_at = (self.local_step, self.samples)

    def _hello(self) -> list:
        """Our hello, with this incarnation's nonce: a neighbour's welcome must echo it."""
        return encode(Header(kind="hello", sender=self.rank, nonce=self.mailbox.rejoin.nonce))

    def _abort_peers(self) -> list[int]:
        return [peer for peer in self._rejoin_peers() if peer not in self.dead] if self.config.world_size > 1 else []

    def _rejoin_peers(self) -> tuple[int, ...]:
        if self.topology.time_varying:  # anyone may be our neighbour in some round
            return tuple(r for r in range(self.config.world_size) if r != self.rank)
        return self._hello_peers()

    def _pull(self, include_own: bool) -> None:
        """Replace our model by the mean of the models the neighbours sent first after welcoming us, with
        ours counted as one more when ``include_own``: x <- x - (1 - own share) x + ..., one fused pass."""
        models = self.mailbox.take_first_models()
        if not models:
            return
        share = 1.0 / (len(models) + include_own)
        terms = [(share * include_own - 1.0, list(self.flat.views()))] + [(share, c) for c in models.values()]
        self.flat.combine_(terms, snapshot=False)

    def _prune_dead(self) -> None:
        """At a mixing point: stop sending to neighbours newly found dead; re-admit restarted ones."""
        for peer in sorted(self.mailbox.take_restarted()):
            self.dead.discard(peer)
            self.readmitted += 1
            welcome = Header(kind="welcome", sender=self.rank, round=self.rounds, step=self.local_step,
                             nonce=self.mailbox.nonce_of(peer))
            self.transport.post([peer], encode(welcome), latest_only=False, timeout=self.config.timeouts.send_timeout)
            log.warning("peer %d: peer %d started again; re-admitted at round %d", self.rank, peer, self.rounds)
        for peer in sorted(self.mailbox.dead() - self.dead):
            self.dead.add(peer)
            self.deaths += 1
            self.transport.forget(peer)
            log.warning("peer %d: peer %d is dead (no connection for %g s, --peer-timeout); going on without it, "
                        "its weights renormalised over the others", self.rank, peer, self.config.timeouts.peer_timeout)

    def statistics(self) -> dict:
        swarm = {} if self.progress is None else {"swarm_steps": self.progress.total,
                                                  "rate_factor": self.rate_factor}
        outer = {} if self.outer is None else {"outer_steps": self.outer.steps}
        return {**super().statistics(), "dead_neighbours": sorted(self.dead), "deaths": self.deaths,
                "readmitted": self.readmitted, "link_drops": self.mailbox.link_drops(), **swarm, **outer}

    def _send_snapshot(self, round: int, *, latest_only: bool, snapshot: list | None = None, weight: float = 1.0,
                       track: bool = False) -> Delivery | None:
        """Queue the weights ``snapshot`` (cut into frames and sent uncopied; None: a copy taken now) for this
        round's out-neighbours, with push-sum mass ``weight``; with ``track``, return the transport's
        ``Delivery`` of it."""
        snapshot = snapshot if snapshot is not None else self.flat.snapshot()
        frames = self._snapshot_frames(round, snapshot, weight)
        # (garbage is fresh tensors: nothing of ours held)
        track = track and self.rank not in self.config.robust.byzantine
        return self.transport.post(self._live_out_neighbours(round), frames, latest_only=latest_only,
                                   timeout=self.config.timeouts.send_timeout, track=track)

    def _snapshot_frames(self, round: int, snapshot: list, weight: float) -> list:
        """The frames of a "params" message carrying ``snapshot`` with push-sum mass ``weight``."""
        header = self._payload_header("params", round, weight)
        if self.rank in self.config.robust.byzantine:  # fault injection: the wire gets garbage, our own model is kept
            seed = ((self.config.seed * 1_000_003 + self.rank) * 1_000_003 + round) % (1 << 63)  # torch's seed range
            return encode(header, byzantine_garbage(snapshot, self.config.robust.byzantine_scale, seed))
        return encode(header, snapshot)

    def _payload_header(self, kind: str, round: int, weight: float) -> Header:
        """The header of a message of ours with a payload: our counters, pace and layout."""
        return params_header(kind, self.rank, self.flat.layout, self.flat.chunk_bytes, round=round,
                             step=self.local_step, samples=self.samples, speed=self.meter.samples_per_second,
                             step_seconds=self.meter.step_seconds, weight=weight,
                             progress=self.progress.vector() if self.progress is not None else ())

    def _live_out_neighbours(self, round: int) -> list[int]:
        """Whom we send to in ``round``: its out-neighbours not declared dead."""
        return [k for k in self.topology.out_neighbours(self.rank, round) if k not in self.dead]


def byzantine_garbage(chunks: list[torch.Tensor], scale: float, seed: int) -> list[torch.Tensor]:
    """Fault injection (``--byzantine``): chunks of values uniform in [-scale, scale], capped at a tenth of
    the dtype's largest finite value, so that the message passes every check of the wire format (finite
    values, right dtypes and layout) and only the receiver's aggregation can stop it."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(c.shape, generator=generator, dtype=torch.float64).mul_(2).sub_(1)
            .mul_(min(scale, torch.finfo(c.dtype).max / 10)).to(c.dtype) for c in chunks]
