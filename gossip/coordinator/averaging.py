"""Periodic parameter averaging (ps-avg, synchronous parameter averaging): every worker does
``local_steps`` steps with its own optimizer, then the server replaces its weights by the workers' mean.
With one local step of plain SGD this reproduces ps-sync exactly (averaging the states equals
applying the average of the deltas); with more it is local SGD."""

from __future__ import annotations

from gossip.coordinator.core import Contribution
from gossip.flat import FlatParams


class ParameterAverage:
    def __init__(self, flat: FlatParams) -> None:
        self.flat = flat

    def apply(self, batch: list[Contribution], staleness: list[int], version: int) -> None:
        """The workers' mean; there is no server learning rate (None)."""
        share = 1.0 / len(batch)
        terms = [(-1.0, list(self.flat.views()))] + [(share, c.chunks) for c in batch]
        self.flat.combine_(terms)  # W <- 0 * W + sum_m W_m / N, in one fused pass

    def sent(self, worker: int) -> None:
        """Nothing to remember per worker."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing but the weights, which the server's checkpoint holds."""
