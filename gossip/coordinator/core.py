"""What every parameter-server mode shares, once: versions, barriers, bounded staleness and replies.

``ServerCore`` is a pure state machine (no sockets, no clocks): the server loop feeds it each worker's
contribution and sends the current weights to the workers it names. The algorithm files only supply an
``Update`` (how a batch of contributions changes the weights); *when* to apply and *whom* to answer lives
here:

- a batch is applied once ``batch_size`` contributions have arrived (N for ps-sync and ps-avg; S for
  soft synchronisation; 1 for plain asynchronous SGD), or fewer once fewer workers remain;
- each applied contribution's staleness is the server version now minus the version it was computed
  on (about N on average with N asynchronous workers);
- with a staleness bound s (SSP, Ho et al., NeurIPS 2013) a worker whose clock is more than s ahead of
  the slowest active worker gets no reply (and so cannot start its next step) until the slowest catches up;
- with a ``budget`` (the asynchronous modes: N x ``--steps`` gradients) the run ends for everyone at once
  when that many contributions have been applied: every worker still waiting, and every one whose next
  contribution arrives, is told to stop (``take_ending``) and nothing more is applied. A fast worker does
  more than ``--steps`` steps and a slow one fewer, but none trains on alone after the others stopped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Contribution:
    worker: int
    version: int  # the server version of the weights it was computed from
    clock: int  # the worker's local steps after it
    chunks: list[torch.Tensor]  # gradients (or weights, for ps-avg), cut like the flat buffers
    samples: int = 0
    weight: float = 1.0  # how much it counts: rbar / r_i with an AdamW server's rate compensation (rates.py)


class Update(Protocol):
    def apply(self, batch: list[Contribution], staleness: list[int], version: int) -> float | None:
        """Change the server's weights with one batch of contributions, making ``version``; returns the
        learning rate it stepped with (None when the update has none)."""

    def sent(self, worker: int) -> None:
        """The current weights are being sent to ``worker`` (DC-ASGD backs them up)."""

    def left(self, worker: int) -> None:
        """``worker`` finished or was given up on (the memory of rate compensation drops its gradient)."""

    def state_dict(self) -> dict:
        """What a checkpoint must hold besides the weights (optimizer state, DC-ASGD backups)."""

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Applied:
    version: int  # the version the batch produced
    workers: list[int]
    staleness: list[int]
    lr: float | None = None  # the server optimizer's, for this update


@dataclass
class ServerCore:
    workers: int
    update: Update
    batch_size: int
    staleness_bound: int | None = None  # None: no bound (everything but ps-ssp)
    budget: int = 0  # contributions after which the run ends (0: each worker ends on its own)
    version: int = 0
    contributed: int = 0  # contributions applied so far
    clocks: list[int] = field(default_factory=list)
    active: set[int] = field(default_factory=set)
    pending: list[Contribution] = field(default_factory=list)
    held: set[int] = field(default_factory=set)  # workers owed a reply that SSP holds back
    staleness: Counter[int] = field(default_factory=Counter)
    updates: int = 0
    applied: list[Applied] = field(default_factory=list)  # what the last submit() or leave() applied
    ending: set[int] = field(default_factory=set)  # workers to tell that the run is over (``take_ending``)

    def __post_init__(self) -> None:
        self.clocks = [0] * self.workers
        self.active = set(range(self.workers))

    def join(self, worker: int, clock: int = 0) -> list[int]:
        """A worker said hello at ``clock`` (first, or again after it or we restarted): it counts as
        active again, anything it had waiting is forgotten, and it gets the current weights at once."""
        self.active.add(worker)
        self.clocks[worker] = clock
        self.pending = [c for c in self.pending if c.worker != worker]
        self.held.discard(worker)
        self.update.sent(worker)
        return [worker]

    def submit(self, contribution: Contribution) -> list[int]:
        """File one contribution; returns the workers to send the current weights to now."""
        self.applied = []
        self.clocks[contribution.worker] = contribution.clock
        if self.spent:
            self.ending.add(contribution.worker)
            return []
        self.pending.append(contribution)
        return self._release(self._apply_if_full())

    @property
    def spent(self) -> bool:
        """The run's budget of contributions has been applied."""
        return 0 < self.budget <= self.contributed

    def take_ending(self) -> list[int]:
        """The workers to tell now that the run is over (each once per contribution it sent after the end)."""
        ending, self.ending = sorted(self.ending), set()
        return ending

    def leave(self, worker: int) -> list[int]:
        """A worker finished (or was given up on): it no longer counts toward batches or holds back
        faster workers; what it had waiting is dropped."""
        self.applied = []
        self.active.discard(worker)
        self.update.left(worker)
        self.held.discard(worker)
        self.pending = [c for c in self.pending if c.worker != worker]
        return self._release(self._apply_if_full())

    def _apply_if_full(self) -> list[int]:
        needed = min(self.batch_size, max(1, len(self.active)))
        if len(self.pending) < needed:
            return []
        batch, self.pending = self.pending, []
        taus = [self.version - c.version for c in batch]
        lr = self.update.apply(batch, taus, self.version + 1)
        self.version += 1
        self.updates += 1
        self.contributed += len(batch)
        self.staleness.update(taus)
        self.applied.append(Applied(self.version, [c.worker for c in batch], taus, lr))
        return [c.worker for c in batch]

    def _release(self, due: list[int]) -> list[int]:
        if self.spent:  # the budget ran out (with this batch or before): everyone still waiting stops
            self.ending.update(due, self.held, (c.worker for c in self.pending))
            self.pending = []
            self.held.clear()
            return []
        self.held.update(due)
        ready = sorted(w for w in self.held if self.may_proceed(w))
        self.held.difference_update(ready)
        for worker in ready:
            self.update.sent(worker)
        return ready

    def may_proceed(self, worker: int) -> bool:
        if self.staleness_bound is None or worker not in self.active:
            return True
        slowest = min(self.clocks[w] for w in self.active)
        return self.clocks[worker] - slowest <= self.staleness_bound

    def state_dict(self) -> dict:
        return {"version": self.version, "updates": self.updates, "contributed": self.contributed,
                "clocks": list(self.clocks),
                "active": sorted(self.active), "staleness": dict(self.staleness), "update": self.update.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume after a restart; contributions that were pending are gone (their workers re-join)."""
        self.version, self.updates, self.contributed = state["version"], state["updates"], state["contributed"]
        self.clocks, self.active = list(state["clocks"]), set(state["active"])
        self.staleness = Counter(state["staleness"])
        self.pending, self.held = [], set()
        self.update.load_state_dict(state["update"])

    def lead(self, worker: int) -> int:
        """How many steps ``worker`` is ahead of the slowest active worker (0 when it is the slowest)."""
        others = [self.clocks[w] for w in self.active] or [self.clocks[worker]]
        return self.clocks[worker] - min(others)
