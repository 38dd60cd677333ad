"""``attach``: gossip averaging for an existing PyTorch training loop in three lines::

    averager = gossip.attach(model)         # after building the model; torchrun, srun or mpirun give the rank
    ...
        optimizer.step()
        averager.step(samples=len(batch))   # after every optimizer step
    averager.close()                        # or use it as a context manager

Errors raised here name ``attach``'s keyword arguments, not the launcher's flags (``gossip/naming.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from gossip.averagers import Averager, averager_class
from gossip.config import CoordinatorConfig, GossipConfig
from gossip.errors import GossipError
from gossip.flat import FlatParams
from gossip.join import locate
from gossip.naming import as_keywords


def attach(model: nn.Module, config: GossipConfig | None = None, coordinator: CoordinatorConfig | None = None,
           resume: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None,
           **overrides: Any) -> Averager:
    """Flatten ``model``'s parameters, find the swarm, open the sockets and wait for the first neighbours
    (or, in the parameter-server modes, for the server's weights).

    Keyword arguments override fields of ``config`` (see ``GossipConfig`` for every option and default);
    ``coordinator`` holds the parameter-server settings. ``rank`` and ``world_size`` (and ``endpoints``),
    where not given, come from torchrun, SLURM or MPI (``environ``, default ``os.environ``; see
    ``gossip/join.py``); with none of them the process trains alone. ``resume``: this process restarts a
    peer, with the counters of its checkpoint (what ``averager.state_dict()`` returned; see ``Averager.start``).
    In the ps-* modes that send gradients (``averager.sends_gradients``), call ``averager.step()`` instead
    of ``optimizer.step()``.
    """
    try:
        config = (config or GossipConfig()).replace(**overrides)
        given = set(overrides)
        if config.world_size > 1:  # a config made for a swarm says who it is
            given |= {"rank", "world_size"}
        flat = FlatParams(model, config.network.chunk_bytes)
        config = locate(config, given, os.environ if environ is None else environ, flat.layout)
    except GossipError as exc:
        exc.args = (as_keywords(str(exc)),)
        raise
    return open_averager(flat, config, coordinator, resume, keywords=True)  # (which spells its own errors)


def gossip_outer(coordinator: CoordinatorConfig | None) -> tuple[str, float, float] | None:
    """The outer step a gossip peer ends each mix with (decentralized DiLoCo), from the same settings as
    ps-avg's server (``--outer-optimizer``, ``--outer-lr``, ``--outer-momentum``); None: plain gossip."""
    return coordinator.outer if coordinator is not None and coordinator.outer_step else None


def open_averager(flat: FlatParams, config: GossipConfig, coordinator: CoordinatorConfig | None = None,
                  resume: dict[str, Any] | None = None, keywords: bool = False) -> Averager:
    """The averager of ``config``'s peer, started; ``keywords``: its errors name ``attach``'s arguments."""
    if config.parameter_server:
        from gossip.coordinator.worker import PSWorker

        averager: Averager = PSWorker(flat, config, coordinator or CoordinatorConfig())
    else:
        topology = config.build_topology() if config.world_size > 1 else None
        averager = averager_class(config)(flat, config, topology, outer=gossip_outer(coordinator))
    averager.keyword_errors = keywords
    return averager.start(resume)
