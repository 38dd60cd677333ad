"""``exponential``: the one-peer exponential graph of Stochastic Gradient Push.

Assran, Loizou, Ballas & Rabbat, "Stochastic Gradient Push for Distributed Deep Learning", ICML 2019.
At round t, with k = t mod m and m = ceil(log2 n) (the number of powers of two below n), rank i sends
to (i + 2^k) mod n and receives from (i - 2^k) mod n, and W_t = (I + P_t) / 2. Each peer sends one
message per round, yet for n a power of two W_{m-1} ... W_1 W_0 = ones/n: the exact average after
log2(n) rounds. Every W_t is a permutation average, hence doubly stochastic.
"""

from __future__ import annotations

import numpy as np

from .base import Topology
from .registry import register


@register("exponential")
class Exponential(Topology):
    """Time-varying directed graph with one in-neighbour and one out-neighbour per round."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        # Powers of two below n: 1, 2, 4, ..., so m = (n - 1).bit_length() = ceil(log2 n).
        self.offsets = tuple(1 << k for k in range((self.world_size - 1).bit_length()))
        # With n = 2 the single offset 1 is its own inverse, so W is symmetric and constant; for n > 2
        # offset 1 is a one-way shift, so W is asymmetric in at least that round.
        self.directed = self.world_size > 2
        self.time_varying = len(self.offsets) > 1

    def offset(self, round: int) -> int:
        """2^k, k = round mod m: how far ahead this round's receiver is."""
        return self.offsets[round % len(self.offsets)]

    def _canonical_round(self, round: int) -> int:
        return round % len(self.offsets)  # the graph repeats every m rounds

    def _adjacency(self, round: int) -> np.ndarray:
        ranks = np.arange(self.world_size)
        adjacency = np.zeros((self.world_size, self.world_size), dtype=bool)
        adjacency[ranks, (ranks - self.offset(round)) % self.world_size] = True
        return adjacency

    def _mixing(self, round: int, adjacency: np.ndarray) -> np.ndarray:
        # adjacency is the permutation matrix P_t (one True per row and column): W = (I + P_t) / 2.
        return (np.eye(self.world_size) + adjacency) / 2.0
