"""Decentralized training for PyTorch: peers average weights with their neighbours over ZeroMQ.

    import gossip
    averager = gossip.attach(model, rank=rank, world_size=world_size, topology="ring")
    ... optimizer.step(); averager.step(samples=batch_size) ...
    averager.close()

Names are imported on first use, so ``gossip.config`` and ``gossip.errors`` load without torch or zmq
(the launcher's ``--help`` and flag errors stay instant).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "attach": "gossip.api", "build_topology": "gossip.config", "Averager": "gossip.averagers",
    "GossipConfig": "gossip.config", "RunConfig": "gossip.config", "Task": "gossip.tasks",
    "TaskContext": "gossip.tasks", "SwarmAdamW": "gossip.swarm_adamw", "ConfigError": "gossip.errors",
    "GossipError": "gossip.errors", "PeerTimeout": "gossip.errors", "PeerUnreachable": "gossip.errors",
    "ProtocolError": "gossip.errors", "TaskError": "gossip.errors", "TransportError": "gossip.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gossip' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
