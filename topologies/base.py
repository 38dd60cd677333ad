"""The ``Topology`` base class: a subclass describes who talks to whom, the base derives the rest.

A subclass implements ``_adjacency(round)``; the base class turns it into Metropolis-Hastings mixing
weights (Xiao, Boyd & Lall, "A scheme for robust distributed sensor fusion based on average consensus",
IPSN 2005), neighbour lists and spectral quantities, and caches recent rounds. The SLEM of W is the
per-round convergence rate of x <- W x to the average (Xiao & Boyd, "Fast linear iterations for
distributed averaging", Systems & Control Letters 2004).
"""

from __future__ import annotations

import abc
import threading
from collections import OrderedDict
from typing import ClassVar

import numpy as np

from .graph import check_adjacency, is_connected, metropolis_hastings
from .validation import check_rank, check_round, check_world_size, parse_int_args

__all__ = ["Topology", "is_connected"]  # is_connected lives in graph.py; offered here beside Topology

_CACHED_ROUNDS = 8  # peers ask for the same few rounds over and over; random graphs cost a resample


class Topology(abc.ABC):
    """A (possibly time-varying) communication graph over ``world_size`` ranks and its mixing matrix W.

    Convention: ``A[i, j]`` / ``W[i, j] > 0`` means rank i receives from rank j (j's weights are mixed
    into i's). ``directed`` is True when W is not symmetric in some round; ``time_varying`` is True
    when the graph changes with the round.
    """

    name: ClassVar[str] = "topology"  # set by @register
    params: ClassVar[tuple[str, ...]] = ()  # the key=value arguments from_spec accepts
    directed: bool = False
    time_varying: bool = False

    def __init__(self, world_size: int) -> None:
        self.world_size = check_world_size(self.name, world_size)
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._cache_lock = threading.Lock()
        # (canonical round, rank, incoming?) -> neighbours: asked for on every message and mixing point
        self._neighbours: dict[tuple[int, int, bool], tuple[int, ...]] = {}

    @classmethod
    def from_spec(cls, args: str, world_size: int) -> Topology:
        """Build from the text after ``name:`` in a spec; the default takes integer ``key=value`` pairs."""
        return cls(world_size, **parse_int_args(cls.name, args, cls.params))

    @property
    def spec(self) -> str:
        """The canonical spec: ``build(t.spec, t.world_size)`` rebuilds an identical topology."""
        return self.name

    def __repr__(self) -> str:
        return f"Topology({self.spec!r}, n={self.world_size})"

    @abc.abstractmethod
    def _adjacency(self, round: int) -> np.ndarray:
        """n x n bool, ``A[i, j]`` True when i receives from j, False diagonal; ``round`` is canonical."""

    def _mixing(self, round: int, adjacency: np.ndarray) -> np.ndarray:
        """W for this round. Directed topologies must override: MH weights need a symmetric graph."""
        if self.directed:
            raise NotImplementedError(f"directed topology {self.name} must override _mixing")
        return metropolis_hastings(adjacency)

    def _canonical_round(self, round: int) -> int:
        """Rounds that share a canonical round share a graph, and so share a cache entry."""
        return round if self.time_varying else 0

    def _matrices(self, round: int) -> tuple[np.ndarray, np.ndarray]:
        key = self._canonical_round(check_round(round))
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # Computed outside the lock: two threads may both compute a round, which is harmless.
        adjacency = check_adjacency(self._adjacency(key), self.world_size, symmetric=not self.directed)
        weights = np.asarray(self._mixing(key, adjacency), dtype=np.float64)
        adjacency.flags.writeable = weights.flags.writeable = False  # shared by every caller
        with self._cache_lock:
            self._cache[key] = (adjacency, weights)
            while len(self._cache) > _CACHED_ROUNDS:
                self._cache.popitem(last=False)
        return adjacency, weights

    def adjacency(self, round: int = 0) -> np.ndarray:
        """Read-only n x n bool matrix; ``A[i, j]`` True when i receives from j in ``round``."""
        return self._matrices(round)[0]

    def mixing_matrix(self, round: int = 0) -> np.ndarray:
        """Read-only n x n float64 doubly stochastic W for ``round``."""
        return self._matrices(round)[1]

    def in_neighbours(self, rank: int, round: int = 0) -> tuple[int, ...]:
        """Sorted ranks whose weights ``rank`` mixes in (``W[rank, j] > 0``, j != rank)."""
        return self._neighbours_of(rank, round, incoming=True)

    def out_neighbours(self, rank: int, round: int = 0) -> tuple[int, ...]:
        """Sorted ranks that need ``rank``'s weights (``W[k, rank] > 0``, k != rank)."""
        return self._neighbours_of(rank, round, incoming=False)

    def _neighbours_of(self, rank: int, round: int, incoming: bool) -> tuple[int, ...]:
        key = (self._canonical_round(check_round(round)), check_rank(rank, self.spec, self.world_size), incoming)
        found = self._neighbours.get(key)
        if found is None:
            weights = self.mixing_matrix(key[0])
            found = _others(weights[key[1], :] if incoming else weights[:, key[1]], key[1])
            if len(self._neighbours) >= 2 * _CACHED_ROUNDS * self.world_size:
                self._neighbours.clear()  # (a time-varying graph's old rounds)
            self._neighbours[key] = found
        return found

    def neighbours(self, rank: int, round: int = 0) -> tuple[int, ...]:
        """Sorted union of in- and out-neighbours."""
        return tuple(sorted(set(self.in_neighbours(rank, round)) | set(self.out_neighbours(rank, round))))

    def degree(self, rank: int, round: int = 0) -> int:
        return len(self.neighbours(rank, round))

    def edges(self, round: int = 0) -> set[frozenset[int]] | set[tuple[int, int]]:
        """Undirected: ``{frozenset({i, j})}``. Directed: arcs ``(sender, receiver)``."""
        receivers, senders = np.nonzero(self.adjacency(round))
        if self.directed:
            return {(int(s), int(r)) for r, s in zip(receivers, senders, strict=True)}
        return {frozenset((int(r), int(s))) for r, s in zip(receivers, senders, strict=True)}

    def slem(self, round: int = 0) -> float:
        """Second-largest eigenvalue modulus of W(round); 1 when the round's graph is disconnected."""
        weights = self.mixing_matrix(round)
        if np.array_equal(weights, weights.T):
            rest = np.linalg.eigvalsh(weights)[:-1]  # ascending, and the largest is the eigenvalue 1
        else:
            eigenvalues = np.linalg.eigvals(weights)
            rest = np.delete(eigenvalues, np.argmin(np.abs(eigenvalues - 1.0)))
        # Doubly stochastic W has |eigenvalue| <= 1; clip rounding so spectral_gap is never negative.
        return min(1.0, float(np.max(np.abs(rest))))

    def contraction(self, round: int = 0) -> float:
        """||W - J||_2, J = ones/n: the exact one-round contraction factor of the distance to consensus
        for doubly stochastic W (equal to slem for symmetric W, an upper bound on it otherwise)."""
        weights = self.mixing_matrix(round)
        return float(np.linalg.norm(weights - 1.0 / self.world_size, 2))

    def spectral_gap(self, round: int = 0) -> float:
        return 1.0 - self.slem(round)


def _others(weights_line: np.ndarray, rank: int) -> tuple[int, ...]:
    return tuple(int(peer) for peer in np.flatnonzero(weights_line > 0) if peer != rank)
