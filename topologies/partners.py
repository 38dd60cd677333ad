"""Partner choice by speed class: a random topology whose partners are mostly peers of similar speed.

A fast peer paired with a slow one either waits for it (gossip-sync) or mixes in a model that has made
less progress; pairing peers of similar speed keeps both rare without giving up the guarantees of the
random topology. Each round's graph is still a connected D-regular graph with Metropolis-Hastings
weights (symmetric, doubly stochastic), a pure function of (seed, round, classes); only the order in
which its Hamiltonian cycles and matchings visit the ranks is biased: ranks are grouped by class (in
class order, shuffled within a class), so a cycle crosses between classes only where one group ends
and the next begins, and those crossings join neighbouring, hence similar, classes.

Classes must be the same on every peer, so they come from the declared speeds that every peer reads
from the same configuration (``--speeds`` in local runs, ``GossipConfig.graph.peer_speeds`` otherwise): peers
measure their own speed, but no peer sees every other peer's measurement to agree on a graph. The cost is
mixing: fewer edges between groups raise the second-largest eigenvalue modulus (``slem``), which tests
and the summary report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .errors import ConfigError
from .random_graph import RandomRegular, sample_regular


def speed_classes(speeds: Sequence[float]) -> tuple[int, ...]:
    """Class of each rank, round(log2(fastest / speed)): 1 and 0.8 share class 0, 0.5 is 1, 0.25 is 2."""
    if not speeds or any(not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0) for s in speeds):
        raise ConfigError(f"speed classes need positive speeds, got {list(speeds)}")
    fastest = max(speeds)
    return tuple(int(round(math.log2(fastest / s))) for s in speeds)


class SimilarSpeedRandom(RandomRegular):
    """``random:degree=D,seed=S`` whose layers visit the ranks grouped by ``classes``."""

    def __init__(self, world_size: int, classes: Sequence[int], degree: int | None = None, seed: int = 0) -> None:
        super().__init__(world_size, degree, seed)
        if len(classes) != self.world_size:
            raise ConfigError(f"{len(classes)} speed classes for {self.world_size} ranks; give one per rank")
        self.classes = tuple(int(c) for c in classes)
        self._groups = [np.flatnonzero(np.array(self.classes) == c) for c in sorted(set(self.classes))]

    def __repr__(self) -> str:
        return f"Topology({self.spec!r}, n={self.world_size}, classes={self.classes})"

    def _grouped_order(self, rng: np.random.Generator) -> np.ndarray:
        return np.concatenate([rng.permutation(group) for group in self._groups])

    def _adjacency(self, round: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, round])
        return sample_regular(self.world_size, self.node_degree, rng, self._grouped_order)


def prefer_similar(topology: object, classes: Sequence[int]) -> SimilarSpeedRandom:
    """``topology`` (a ``random`` one) with partners drawn mostly within ``classes``."""
    if type(topology) is not RandomRegular:
        raise ConfigError(f"partner choice by speed applies to the random topology (resampled every round); "
                          f"{topology!r} has fixed partners; use --topology random[:degree=D,seed=S]")
    return SimilarSpeedRandom(topology.world_size, classes, topology.node_degree, topology.seed)
