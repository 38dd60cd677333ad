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

from gossip.averagers import AVERAGERS, Averager
from gossip.config import GossipConfig
from gossip.errors import ConfigError
from gossip.flat import FlatParams


def attach(model: nn.Module, config: GossipConfig | None = None, **overrides: Any) -> Averager:
    """Flatten ``model``'s parameters, open the sockets and wait for the first neighbours.

    Keyword arguments override fields of ``config`` (see ``GossipConfig`` for every option and default).
    """
    try:
        config = dataclasses.replace(config or GossipConfig(), **overrides)
    except TypeError as exc:
        raise ConfigError(f"{exc}; see gossip.GossipConfig for the options") from exc
    topology = config.build_topology() if config.world_size > 1 else None
    averager = AVERAGERS[config.mode](FlatParams(model, config.chunk_bytes), config, topology)
    return averager.start()
