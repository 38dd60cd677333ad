"""Pure functions on adjacency matrices: connectivity, Metropolis-Hastings weights, sanity checks.

Convention throughout: ``adjacency[i, j]`` is True when rank i receives from rank j.
"""

from __future__ import annotations

import numpy as np


def is_connected(adjacency: np.ndarray) -> bool:
    """True when the undirected closure of the graph is connected (BFS from rank 0)."""
    adjacency = np.asarray(adjacency, dtype=bool)
    linked = adjacency | adjacency.T  # a directed link still carries information both ways over time
    world_size = linked.shape[0]
    seen = np.zeros(world_size, dtype=bool)
    seen[0] = True
    frontier = [0]
    while frontier:
        reached = np.flatnonzero(linked[frontier].any(axis=0) & ~seen)
        seen[reached] = True
        frontier = reached.tolist()
    return bool(seen.all())


def metropolis_hastings(adjacency: np.ndarray) -> np.ndarray:
    """Metropolis-Hastings weights W_ij = 1 / (1 + max(d_i, d_j)) on edges, W_ii = 1 - sum_j W_ij.

    Symmetric and doubly stochastic for any undirected graph, using only the two endpoints' degrees,
    so every peer can compute its own row locally (Xiao, Boyd & Lall, IPSN 2005).
    """
    degrees = adjacency.sum(axis=1)
    weights = np.where(adjacency, 1.0 / (1.0 + np.maximum.outer(degrees, degrees)), 0.0)
    np.fill_diagonal(weights, 1.0 - weights.sum(axis=1))
    return weights


def check_adjacency(adjacency: np.ndarray, world_size: int, *, symmetric: bool) -> np.ndarray:
    """Return ``adjacency`` as a fresh bool array, or raise if a topology produced a malformed one."""
    adjacency = np.array(adjacency, dtype=bool)  # a copy, so freezing it cannot touch the caller's array
    if adjacency.shape != (world_size, world_size):
        raise ValueError(f"adjacency has shape {adjacency.shape}, expected ({world_size}, {world_size})")
    if adjacency.diagonal().any():
        raise ValueError("adjacency has self-loops; the self-weight belongs in the mixing matrix")
    if symmetric and not np.array_equal(adjacency, adjacency.T):
        raise ValueError("an undirected topology produced an asymmetric adjacency; set directed = True")
    return adjacency
