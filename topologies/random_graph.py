"""``random`` / ``random:degree=D,seed=S``: a fresh random connected D-regular graph every round.

A random D-regular graph (D >= 3) is an expander with high probability (Friedman, "A proof of Alon's
second eigenvalue conjecture", Memoirs AMS 2008), so its SLEM stays bounded away from 1 as n grows,
unlike a ring's or a torus's; resampling every round also keeps any one slow cut from persisting (cf.
Ying et al., "Exponential graph is provably efficient for decentralized deep training", NeurIPS 2021,
on time-varying sparse topologies). The graph of round t is a pure function of (seed, t), so every
peer derives the same graph without talking to anyone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import Topology
from .errors import ConfigError
from .registry import register

# Repair budget per graph: measured draws (n <= 1000) needed under ~2 swaps per edge when they succeed;
# the cap bounds the time spent on near-half-density graphs, which rarely succeed, before the fallback.
REPAIRS_PER_EDGE = 4
MAX_REPAIRS = 20_000


def default_degree(world_size: int) -> int:
    """3, or the nearest valid degree: n - 1 below 4 nodes, 4 when n is odd (3 * n would be odd)."""
    if world_size < 4:
        return world_size - 1
    return 3 if world_size % 2 == 0 else 4


Permute = Callable[[np.random.Generator], np.ndarray]  # draws the order in which a layer visits the ranks


def sample_regular(world_size: int, degree: int, rng: np.random.Generator,
                   permute: Permute | None = None) -> np.ndarray:
    """Adjacency of a random connected ``degree``-regular graph; any valid (n, D) succeeds.

    ``permute`` draws each sparse layer's visiting order (default: uniform); a biased order makes
    consecutive ranks, hence edges, likelier between chosen ranks. Dense graphs ignore it."""
    if 2 * degree > world_size - 1:
        # Dense: sample the sparse complement instead. Its complement has minimum degree >= n/2, so any
        # two ranks share a neighbour and the graph is connected without needing a Hamiltonian cycle.
        complement = _sample_layers(world_size, world_size - 1 - degree, rng)
        if complement is not None:
            return ~complement & ~np.eye(world_size, dtype=bool)
    else:
        adjacency = _sample_layers(world_size, degree, rng, permute)
        if adjacency is not None:
            return adjacency
    return _circulant(world_size, degree, rng)  # same rng stream: still a pure function of (seed, round)


def _layer_edges(order: np.ndarray, cycle: bool) -> tuple[np.ndarray, np.ndarray]:
    """Endpoints of the Hamiltonian cycle visiting ``order``, or of the perfect matching pairing it up."""
    return (order, np.roll(order, -1)) if cycle else (order[0::2], order[1::2])


def _sample_layers(world_size: int, degree: int, rng: np.random.Generator,
                   permute: Permute | None = None) -> np.ndarray | None:
    """floor(D/2) edge-disjoint random Hamiltonian cycles plus, for odd D, a perfect matching (connected
    for D >= 2 by the first cycle); None when the repair budget runs out.

    Redrawing a whole layer until it misses every earlier edge rarely succeeds beyond D ~ 6 (each of
    its n edges clashes with probability ~ D/n; with 64 nodes and D = 8, 100 redraws per layer failed
    80% of the time), so a clash is repaired locally instead: swap one endpoint of a clashing edge
    with a random rank and check again.
    """
    taken = np.zeros((world_size, world_size), dtype=bool)
    repairs_left = min(REPAIRS_PER_EDGE * world_size * degree // 2, MAX_REPAIRS)
    for cycle in [True] * (degree // 2) + [False] * (degree % 2):
        order = permute(rng) if permute is not None else rng.permutation(world_size)
        while (clashes := np.flatnonzero(taken[_layer_edges(order, cycle)])).size:
            if repairs_left == 0:
                return None
            repairs_left -= 1
            clash = clashes[rng.integers(clashes.size)]
            moved, other = ((clash + 1) % world_size if cycle else 2 * clash + 1), rng.integers(world_size)
            order[[moved, other]] = order[[other, moved]]
        lows, highs = _layer_edges(order, cycle)
        taken[lows, highs] = taken[highs, lows] = True
    return taken


def _circulant(world_size: int, degree: int, rng: np.random.Generator) -> np.ndarray:
    """Fallback: offsets 1..D/2 (plus n/2 for odd D) under a random relabelling. Always D-regular and
    connected (offset 1 is a Hamiltonian cycle), but a ring lattice, so it mixes more slowly."""
    order = rng.permutation(world_size)
    adjacency = np.zeros((world_size, world_size), dtype=bool)
    for offset in list(range(1, degree // 2 + 1)) + ([world_size // 2] if degree % 2 else []):
        peers = np.roll(order, -offset)
        adjacency[order, peers] = adjacency[peers, order] = True
    return adjacency


@register("random")
class RandomRegular(Topology):
    """Connected D-regular graph resampled every round from ``np.random.default_rng([seed, round])``."""

    params = ("degree", "seed")

    def __init__(self, world_size: int, degree: int | None = None, seed: int = 0) -> None:
        super().__init__(world_size)
        # Not "degree": that name is the per-rank method every topology has.
        self.node_degree = default_degree(self.world_size) if degree is None else degree
        self.seed = seed
        _check(self.world_size, self.node_degree, self.seed)
        self.time_varying = self.node_degree < self.world_size - 1  # D = n - 1 only fits the complete graph

    @property
    def spec(self) -> str:
        return f"random:degree={self.node_degree},seed={self.seed}"

    def _adjacency(self, round: int) -> np.ndarray:
        return sample_regular(self.world_size, self.node_degree, np.random.default_rng([self.seed, round]))


def _check(world_size: int, degree: int, seed: int) -> None:
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in (degree, seed)):
        raise ConfigError(f"random needs integer degree and seed, got degree={degree!r}, seed={seed!r}")
    spec = f"random:degree={degree}"
    if degree > world_size - 1:
        raise ConfigError(f"{spec} needs at least {degree + 1} nodes, got {world_size}; use degree <= {world_size - 1}")
    if degree < 2 and not (degree == 1 and world_size == 2):
        raise ConfigError(f"{spec} cannot connect {world_size} nodes; use degree >= 2 (degree=1 only with 2 nodes)")
    if degree * world_size % 2:
        # degree is odd and n is odd here, so degree - 1 >= 2 and degree + 1 <= n - 1 are both valid.
        raise ConfigError(f"{spec} needs an even number of nodes ({degree}*{world_size} is odd); "
                          f"use degree={degree - 1} or {degree + 1}, or an even number of nodes")
    if seed < 0:
        raise ConfigError(f"random:seed={seed} is negative; use a seed >= 0")
