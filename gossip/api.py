"""``attach``: gossip averaging for an existing PyTorch training loop in three lines::

    averager = gossip.attach(model, rank=rank, world_size=4, topology="ring")   # after building the model
    ...
        optimizer.step()
        averager.step(samples=len(batch))                                      # after every optimizer step
    averager.close()                                                           # or use it as a context manager
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from gossip.averagers import Averager, averager_class
from gossip.config import CoordinatorConfig, GossipConfig
from gossip.errors import ConfigError
from gossip.flat import FlatParams


def attach(model: nn.Module, config: GossipConfig | None = None, coordinator: CoordinatorConfig | None = None,
           resume: dict[str, Any] | None = None, **overrides: Any) -> Averager:
    """Flatten ``model``'s parameters, open the sockets and wait for the first neighbours (or, in the
    parameter-server modes, for the server's weights).

    Keyword arguments override fields of ``config`` (see ``GossipConfig`` for every option and default);
    ``coordinator`` holds the parameter-server settings. ``resume``: this process restarts a peer, with the
    counters of its checkpoint (see ``Averager.start``); it rejoins the others where they are. In the
    ps-* modes that send gradients (``averager.sends_gradients``), call ``averager.step()`` instead of
    ``optimizer.step()``.
    """
    try:
        config = dataclasses.replace(config or GossipConfig(), **overrides)
    except TypeError as exc:
        raise ConfigError(f"{exc}; see gossip.GossipConfig for the options") from exc
    flat = FlatParams(model, config.chunk_bytes)
    if config.parameter_server:
        from gossip.coordinator.worker import PSWorker

        return PSWorker(flat, config, coordinator or CoordinatorConfig()).start(resume)
    topology = config.build_topology() if config.world_size > 1 else None
    return averager_class(config)(flat, config, topology).start(resume)
