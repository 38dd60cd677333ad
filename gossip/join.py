"""How ``gossip.attach`` finds its swarm: explicit arguments first, then the launcher's environment.

* ``rank`` and ``world_size`` given (and optionally ``endpoints``): peer r listens on ``endpoints[r]``, by
  default ``tcp://host:(base_port + r)``, and nothing is exchanged beforehand.
* Otherwise the variables of torchrun, SLURM or MPI (``gossip.rendezvous``) give what was not given, and the
  peers meet in a key-value store, torchrun's or one that rank 0 serves at ``MASTER_ADDR:MASTER_PORT``
  (``gossip.rendezvous_store``): each announces ``tcp://ADDRESS:(base_port + rank)``, ADDRESS being the one
  it reaches the store from, and reads everyone's. So a program started by torchrun on several hosts names
  no endpoint. The peers also check there that they agree on every setting that must be common and on the
  model's layout; one that cannot go on says so in the store, and the others stop at once with its reason.
* Neither: the process trains alone (world size 1), and says so in one line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from gossip.config import GossipConfig
from gossip.errors import ConfigError
from gossip.net.address import bindable
from gossip.net.wire import Layout
from gossip.rendezvous import Plan, read_environment

log = logging.getLogger("gossip")
# settings each peer may choose for itself: where and how it listens and waits; every other field of
# GossipConfig, and the model's layout, must be the swarm's
PER_PEER = frozenset({"rank", "host", "base_port", "endpoints", "bind", "server_endpoint", "ipc", "lazy_snapshot",
                      "queue_depth", "round_timeout", "peer_timeout", "startup_timeout", "send_timeout",
                      "shutdown_timeout"})


def locate(config: GossipConfig, given: set[str], env: Mapping[str, str], layout: Layout) -> GossipConfig:
    """``config`` with the rank, world size and endpoints of this peer's swarm (module docstring); ``given``:
    the fields the caller set."""
    found = read_environment(env, config.network.base_port - 1)
    rank = config.rank if "rank" in given else found.rank
    world_size = config.world_size if "world_size" in given else found.world_size
    if world_size is None:
        log.warning("gossip: no rank or world_size given and no torchrun, SLURM or MPI variables set: this "
                    "process trains alone (pass rank= and world_size=, or start it with torchrun)")
        return dataclasses.replace(config, rank=0, world_size=1)
    if rank is None:
        raise ConfigError(f"world_size={world_size} but this process's rank is unknown: pass rank=R (0.."
                          f"{world_size - 1}), or start the processes under torchrun, srun or mpirun, which set it")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}; ranks count from 0")
    given = config.network.endpoints
    config = config.replace(rank=rank, world_size=world_size, endpoints=given if len(given) == world_size else ())
    if world_size == 1 or config.network.endpoints or not found.source:
        return config
    if found.store is None:
        raise ConfigError(f"{found.source} gives ranks but not where rank 0 is: export MASTER_ADDR (rank 0's host) "
                          "and MASTER_PORT, or pass endpoints=[...] (one tcp://HOST:PORT per rank)")
    plan = Plan(found.source, rank, world_size, found.local_rank, store=found.store,
                host_store=rank == 0 and not found.agent_store, namespace=found.namespace)
    return _meet(config, plan, layout)


def _meet(config: GossipConfig, plan: Plan, layout: Layout) -> GossipConfig:
    """Exchange endpoints through the store of ``plan``; the run stops for everyone if this peer cannot go on."""
    from gossip import rendezvous_store as exchange  # imports torch.distributed: only when a store is used

    announce = exchange.announce_address("", config.network.bind, plan.store[0])
    listen = config.network.bind or bindable(announce)  # where this peer binds, and the store it may serve listens
    meeting = exchange.StoreRendezvous(plan, config.timeouts.startup_timeout, bind=listen, keydir=config.network.secure)

    def endpoint_of(rank: int) -> str:
        exchange.check_port(listen, config.network.base_port + rank, f"peer {rank}")
        return f"tcp://{announce}:{config.network.base_port + rank}"

    settings = {name: value for name, value in config.flat().items() if name not in PER_PEER}
    meeting.open()
    try:  # (a peer that cannot join tells the others in the store: ``join``)
        assignment = meeting.join(endpoint_of, {**settings, "model_layout": layout.fingerprint}, plan.world_size,
                                  plan.rank, server=False, parameter_server=config.parameter_server)
    finally:
        meeting.close()
    return config.replace(endpoints=assignment.endpoints,
                          server_endpoint=assignment.server_endpoint or config.network.server_endpoint)
