"""The staleness weights of gossip-async's "latest" rule (``gossip/averagers/latest.py``): which coefficient
each held snapshot gets. No sockets, no tensors.

The rule mixes the latest snapshot held from each neighbour j with weight W_ij * f(tau_j), where tau_j
counts our own local steps since that snapshot arrived, drops snapshots with tau_j > tau_max, and
renormalises so the coefficients sum to one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gossip.errors import ConfigError


def staleness_factor(kind: str, tau: int, temperature: float) -> float:
    """f(tau): ``none`` = 1, ``inverse`` = 1 / (1 + tau), ``exp`` = exp(-tau / temperature)."""
    if tau < 0:
        raise ValueError(f"staleness cannot be negative, got {tau}")
    if kind == "none":
        return 1.0
    if kind == "inverse":
        return 1.0 / (1.0 + tau)
    if kind == "exp":
        return math.exp(-tau / temperature)
    raise ConfigError(f"unknown staleness weight {kind!r}; choose one of: none, inverse, exp")


def stale_weights(self_weight: float, neighbours: Mapping[int, tuple[float, int]], kind: str,
                  temperature: float, max_staleness: int) -> tuple[float, dict[int, float]]:
    """Normalised (self coefficient, {neighbour: coefficient}) from ``{j: (W_ij, tau_j)}``.

    A snapshot older than ``max_staleness`` gets coefficient 0 and is left out of the result.
    """
    raw = {j: w * staleness_factor(kind, tau, temperature)
           for j, (w, tau) in neighbours.items() if tau <= max_staleness and w > 0}
    return normalise(self_weight, raw)


def normalise(self_weight: float, weights: Mapping[int, float]) -> tuple[float, dict[int, float]]:
    """Scale so that the self weight and the neighbour weights sum to one (renormalising over arrivals)."""
    if not self_weight > 0 or any(w < 0 for w in weights.values()):
        raise ValueError(f"mixing weights must be non-negative with a positive self weight, got {self_weight}, {weights}")
    total = self_weight + sum(weights.values())
    return self_weight / total, {j: w / total for j, w in weights.items()}
