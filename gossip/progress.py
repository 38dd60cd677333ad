"""How far the whole swarm has trained, as one gossip-async peer knows it: the swarm-wide end and the rate
compensation of asynchronous gossip.

Every message a gossip-async peer sends carries, besides its own step, the latest step it knows of every
other peer (``Header.progress``); a receiver keeps the element-wise maximum. This is a vector clock of step
counts: each entry only grows, a peer's own entry is exact, and another's lags behind the truth by the time
news takes to travel to us (about one step per hop of the graph). Two things follow from it, on every peer
alike and without a shared clock:

- **The end.** The run has a budget of steps for the whole swarm: ``--steps`` per peer on average, N x
  ``--steps`` in all (``spent``). A peer stops at its first mixing point from which the steps it knows of,
  plus those the swarm takes at its mean rate while its own next step would run, add up to the budget: it
  does not begin a step that would end after the others stopped. So all stop within about a step of each
  other, the slow ones a little before the budget is spent and the fast ones as it is: a fast peer does more
  than ``--steps`` steps and a slow one fewer, but none trains on alone after the others stopped (it would
  learn of their end only at its next mixing point, one of its long steps too late).
- **The start.** Since the budget is shared, a peer that started early would spend the shares of those
  still starting (docs/architecture.md, 3.12: in a ring of 4 started by hand, the peer opposite a late one
  did nearly the whole budget and the late one nothing). So no peer takes its first step before it knows
  every peer is up (``started``). Its neighbours' hellos tell it of them; it then sends them "up" with the
  peers it knows of, again each time that set grows; every peer with a step in a header's vector is up
  too (a neighbour already training, whose "up" did not reach us). The news crosses the graph in about its diameter of hops; the wait is bounded by
  ``--startup-timeout`` like the hellos'. This is the one wait of the mode, before it begins: once
  training, no peer waits for another. A false flag in an "up" can only start a peer early.
- **The rate.** ``rate_factor(seconds, steps)`` is how much progress of ``steps`` own steps made over
  ``seconds`` counts: seconds x R / steps, with R the swarm's mean steps per second per peer over the last
  ``window`` mixing points (on our own clock, so no common clock is needed; a peer first heard of during
  the window counts from that first news). For a peer at a steady rate r_i
  that is R / r_i = rbar / r_i. Crediting each step with it makes every peer's data move the network's mass
  alike per unit of time (asynchronous gradient push's rate compensation, Assran & Rabbat, 2020), so the
  run minimises the mean of the peers' objectives rather than a mean weighted by their rates. Counting the
  time each step took, rather than an estimate of our own rate, keeps this exact when a peer's speed
  changes from step to step (2 cores shared by 6 peers: +-10%): only R is estimated, and R is the same
  swarm-wide quantity on every peer. Bounded to [1 / ``MAX_RATE_FACTOR``, ``MAX_RATE_FACTOR``], and 1 until
  ``MIN_RATE_POINTS`` mixing points are known.

A peer's entries are claims by its neighbours about third parties; each is bounded by the run's horizon
(N x ``--steps``), so a lying peer can at worst end the run early, never move a model.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

RATE_WINDOW = 128  # mixing points the swarm's mean rate is measured over
MIN_RATE_POINTS = 3  # mixing points before the first estimate (until then progress counts 1)
MAX_RATE_FACTOR = 8.0  # progress counts at most 8x (a peer 8x slower than the mean) and at least 1/8


class SwarmProgress:
    """Every peer's latest known step, merged from the headers that arrive (on the transport's thread) and
    advanced by our own steps (on the training thread)."""

    def __init__(self, world_size: int, rank: int, window: int = RATE_WINDOW) -> None:
        self.world_size = world_size
        self.rank = rank
        self._known = [0] * world_size
        self._lock = threading.Lock()
        self._history: deque[tuple[float, tuple[int, ...]]] = deque(maxlen=window + 1)  # (time, steps known)
        self._first_news: list[tuple[float, int] | None] = [None] * world_size  # (time, step) first known
        self._rate: float | None = None  # R as of the last note()
        self._started = {rank}  # the peers known to be up

    def merge(self, progress: Sequence[int]) -> None:
        """Take the newer of ours and ``progress`` (a header's, validated) for every peer but us."""
        with self._lock:
            starting = len(self._started) < self.world_size
            for peer, step in enumerate(progress):
                if peer != self.rank and step > self._known[peer]:
                    self._known[peer] = step
                if starting and step > 0:
                    self._started.add(peer)

    def note_started(self, peers: Iterable[int]) -> None:
        """``peers`` are up: they said hello, or are flagged in an "up"."""
        with self._lock:
            self._started.update(peers)

    def started(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._started)

    def advance(self, step: int) -> None:
        """Our own step (never goes back, except after a restart)."""
        with self._lock:
            self._known[self.rank] = step

    def vector(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._known)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._known)

    def spent(self, steps: int, within: float = 0.0) -> bool:
        """The swarm will have done ``steps`` steps per peer on average, as far as we know, before a step of
        ours that takes ``within`` seconds would end: the others' steps meanwhile (at the mean rate R, once
        known; N R ``within`` less our one) are counted ahead."""
        ahead = max(0.0, self.world_size * (self.mean_rate() or 0.0) * within - 1.0)
        return self.total + ahead >= self.world_size * steps

    def mean_step(self) -> int:
        """The steps of the average peer: where the swarm is in a schedule written in ``--steps``."""
        return self.total // self.world_size

    def note(self, now: float) -> None:
        """At a mixing point, at ``now`` (seconds on our clock): remember the steps we know of, and measure R
        (``mean_rate``) from them, once here rather than at every step."""
        with self._lock:
            known = tuple(self._known)
            self._history.append((now, known))
            for peer, step in enumerate(known):
                if step > 0 and self._first_news[peer] is None:
                    self._first_news[peer] = (now, step)
            self._rate = self._measure(now, known)

    def _measure(self, now: float, known: tuple[int, ...]) -> float | None:
        """The mean over the peers we know of of their steps per second, each from the window's start or,
        when we first heard of it later, from that first news (a jump from 0 to wherever the peer was, not
        progress made in the window)."""
        if len(self._history) < MIN_RATE_POINTS:
            return None
        start, at_start = self._history[0]
        rates = []
        for peer, step in enumerate(known):
            first = self._first_news[peer]
            if first is None:
                continue
            then, before = (start, at_start[peer]) if at_start[peer] > 0 else first
            if now > then:
                rates.append((step - before) / (now - then))
        return sum(rates) / len(rates) if rates and sum(rates) > 0 else None

    def mean_rate(self) -> float | None:
        """R, the mean over the peers of their steps per second over the window, as of the last mixing
        point (None: not known yet)."""
        return self._rate

    def rate_factor(self, seconds: float, steps: int) -> float:
        """seconds x R / steps (module docstring): 1 for a peer at the swarm's mean rate."""
        rate = self.mean_rate()
        if rate is None or steps <= 0:
            return 1.0
        return min(MAX_RATE_FACTOR, max(1.0 / MAX_RATE_FACTOR, seconds * rate / steps))
