"""``star``: rank 0 is a hub linked to every other rank; leaves only talk to the hub.

The parameter-server shape, kept for comparison: the hub carries n - 1 links while leaves carry one.
With Metropolis-Hastings weights every edge weighs 1/n, so W = I - L/n and SLEM = 1 - 1/n (n >= 3).
"""

from __future__ import annotations

import numpy as np

from .base import Topology
from .registry import register

HUB = 0


@register("star")
class Star(Topology):
    """Hub rank 0 connected to all other ranks."""

    def _adjacency(self, round: int) -> np.ndarray:
        adjacency = np.zeros((self.world_size, self.world_size), dtype=bool)
        adjacency[HUB, :] = adjacency[:, HUB] = True
        adjacency[HUB, HUB] = False
        return adjacency
