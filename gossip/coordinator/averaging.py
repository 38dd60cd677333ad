"""Periodic parameter averaging (ps-avg): every worker does ``local_steps`` steps with its own optimizer,
then the server combines their weights.

``ParameterAverage`` replaces the server's weights by the workers' mean. With one local step of plain SGD this
reproduces ps-sync exactly (averaging the states equals applying the average of the deltas); with more it is
local SGD (Stich, ICLR 2019).

``OuterStep`` is DiLoCo's outer step (Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", 2023): the workers' mean change since the weights W they all started from,
delta = W - (1/N) sum_m W_m, is a pseudo-gradient that the server's outer optimizer steps with. In PyTorch's
form of Nesterov momentum mu and lr eta (OpenDiLoCo, Jaghouar et al. 2024: SGD, eta 0.7, mu 0.9, nesterov):

    m <- mu m + delta,   W <- W - eta (delta + mu m)

(plain momentum: W <- W - eta m). Outer SGD with eta 1 and mu 0 gives W <- (1/N) sum_m W_m, today's average, which
is why ``--outer-optimizer sgd`` at its defaults builds ``ParameterAverage``, one fused pass instead of three.
The outer momentum lives on the server and is saved in its checkpoint; each worker's inner optimizer state
(its AdamW moments) stays its own, as in DiLoCo. Float buffers (BatchNorm statistics) take the workers' mean.

With ``--aggregate median`` or ``trimmed-mean`` the workers' weights are combined coordinate-wise instead of
averaged (``gossip/aggregate.py``), buffers included: ``ParameterAverage`` takes that aggregate as the new
weights, ``OuterStep`` steps with delta = W - aggregate.
"""

from __future__ import annotations

import torch

from gossip.aggregate import aggregate_into_
from gossip.config import COORDINATE_WISE
from gossip.coordinator.core import Contribution
from gossip.coordinator.sgd import average_buffers
from gossip.flat import FlatParams


class ParameterAverage:
    def __init__(self, flat: FlatParams, aggregate: str = "mean", trim_fraction: float = 0.2) -> None:
        self.flat = flat
        self.aggregate, self.trim_fraction = aggregate, trim_fraction

    def apply(self, batch: list[Contribution], staleness: list[int], version: int) -> None:
        """The workers' mean (or robust aggregate); there is no server learning rate (None)."""
        if self.aggregate in COORDINATE_WISE:
            aggregate_into_(list(self.flat.views()), [c.chunks for c in batch], self.aggregate, self.trim_fraction)
            return
        share = 1.0 / len(batch)
        terms = [(-1.0, list(self.flat.views()))] + [(share, c.chunks) for c in batch]
        self.flat.combine_(terms)  # W <- 0 * W + sum_m W_m / N, in one fused pass

    def left(self, worker: int) -> None:
        """(Nothing is kept per worker.)"""

    def sent(self, worker: int) -> None:
        """Nothing to remember per worker."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing but the weights, which the server's checkpoint holds."""


class OuterStep:
    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer, aggregate: str = "mean",
                 trim_fraction: float = 0.2) -> None:
        self.flat = flat
        self.optimizer = optimizer
        self.aggregate, self.trim_fraction = aggregate, trim_fraction
        self.gradients = flat.point_gradients_into()  # the pseudo-gradient goes here

    def apply(self, batch: list[Contribution], staleness: list[int], version: int) -> float:
        """Step with delta = W - mean (or robust aggregate) of the batch's weights; returns the outer lr."""
        if self.aggregate in COORDINATE_WISE:
            aggregate_into_(self.gradients, [c.chunks for c in batch], self.aggregate, self.trim_fraction)
            average_buffers(self.flat, [self.gradients])  # buffers take the aggregate itself
            for target, weights in zip(self.gradients, self.flat.views()):
                torch.sub(weights, target, out=target)
            self.optimizer.step()
            return self.optimizer.param_groups[0]["lr"]
        share = 1.0 / len(batch)
        for target, weights in zip(self.gradients, self.flat.views()):
            target.copy_(weights)
        for contribution in batch:
            for target, chunk in zip(self.gradients, contribution.chunks):
                target.add_(chunk, alpha=-share)
        average_buffers(self.flat, [c.chunks for c in batch])
        self.optimizer.step()
        return self.optimizer.param_groups[0]["lr"]

    def left(self, worker: int) -> None:
        """(Nothing is kept per worker.)"""

    def sent(self, worker: int) -> None:
        """Every worker starts from the weights it is sent: nothing else to remember."""

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The outer momentum (the server checked that the saved state fits this optimizer)."""
        self.optimizer.load_state_dict(state["optimizer"])
