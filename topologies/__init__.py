"""Communication topologies for decentralized training: who averages weights with whom, and how much.

A ``Topology`` over ``world_size`` ranks yields, for each round, a doubly stochastic mixing matrix W
(``W[i, j] > 0`` when rank i mixes in rank j's weights) and the neighbour lists derived from it. After a
gossip step every rank holds x_i <- sum_j W_ij x_j; the SLEM of W bounds how fast ranks reach consensus.
Pure numpy: no sockets, no torch, and no import of ``gossip`` or ``launch`` (they depend on us).

Build one from a spec string: ``build("torus:2x4", 8)``, ``build("random:degree=4,seed=1", 16)``.

Adding a topology takes one module here: subclass ``Topology``, decorate it with ``@register("name")``,
implement ``_adjacency(round) -> n x n bool`` (``A[i, j]`` True when i receives from j), and import the
module below. Undirected graphs get Metropolis-Hastings weights for free; directed ones set
``directed = True`` and override ``_mixing``. Integer ``key=value`` arguments go in ``params``.
"""

from __future__ import annotations

from . import exponential, full, random_graph, ring, star, torus
from .base import Topology
from .errors import ConfigError
from .graph import is_connected, metropolis_hastings
from .partners import prefer_similar, speed_classes
from .registry import build, names, register

# Importing a topology module registers it; naming them here keeps linters from calling them unused.
TOPOLOGY_MODULES = (exponential, full, random_graph, ring, star, torus)

__all__ = ["ConfigError", "Topology", "build", "is_connected", "metropolis_hastings", "names", "prefer_similar",
           "register", "speed_classes"]
