"""``ring``: rank i exchanges with i - 1 and i + 1 (mod n).

The cheapest connected graph (two peers each), but the slowest to mix: with Metropolis-Hastings
weights SLEM = 1/3 + 2/3 cos(2 pi / n) for n >= 3, so the spectral gap shrinks like 1/n^2.
"""

from __future__ import annotations

import numpy as np

from .base import Topology
from .registry import register


@register("ring")
class Ring(Topology):
    """Cycle over all ranks; n = 2 is a single edge and n = 3 a triangle."""

    def _adjacency(self, round: int) -> np.ndarray:
        ranks = np.arange(self.world_size)
        adjacency = np.zeros((self.world_size, self.world_size), dtype=bool)
        # With n = 2, i - 1 and i + 1 are the same peer; the bool matrix stores that edge once.
        adjacency[ranks, (ranks + 1) % self.world_size] = True
        adjacency[ranks, (ranks - 1) % self.world_size] = True
        return adjacency
