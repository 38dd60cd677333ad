"""``full``: every rank exchanges with every other one.

W = J = ones / n, so one round reaches the exact average (SLEM 0), at n - 1 messages per peer.
"""

from __future__ import annotations

import numpy as np

from .base import Topology
from .registry import register


@register("full")
class Full(Topology):
    """Complete graph; its Metropolis-Hastings weights are 1/n everywhere."""

    def _adjacency(self, round: int) -> np.ndarray:
        return ~np.eye(self.world_size, dtype=bool)

    def _mixing(self, round: int, adjacency: np.ndarray) -> np.ndarray:
        # The generic formula gives 1/n only up to rounding on the diagonal; J is exact.
        return np.full((self.world_size, self.world_size), 1.0 / self.world_size)
