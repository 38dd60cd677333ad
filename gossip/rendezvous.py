"""Who am I, how many are we, and where do we meet: for a peer started on its own, pure.

Rank and world size come from the first source that gives them, in this order:

1. flags: ``--rank``, ``--world-size`` (and ``--hosts``, which fixes every endpoint);
2. torchrun (and anything that sets ``torch.distributed``'s env:// variables): ``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
3. SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``;
4. Open MPI: ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``; MPICH and Intel MPI: ``PMI_RANK``,
   ``PMI_SIZE``, ``MPI_LOCALRANKID``.

Endpoints follow from ``--hosts`` when it is given. Otherwise every peer writes the endpoint it announces
into a key-value store and reads everyone's (``gossip.rendezvous_store``). The store is, in this order: the one at
``--initial-peers``; torchrun's (its agent's own store when ``TORCHELASTIC_USE_AGENT_STORE=True``, else
one that rank 0 hosts at ``MASTER_ADDR:MASTER_PORT``, as ``torch.distributed`` does); one that rank 0
hosts at ``MASTER_ADDR:MASTER_PORT`` when those are set; under SLURM one that rank 0 hosts on the first
node of the job at the rendezvous port; and for a peer started by hand with nothing of the above, one it
hosts itself, as the first peer of a swarm that others join with ``--initial-peers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gossip.config import RendezvousConfig
from gossip.errors import ConfigError
from gossip.net.address import expand_nodelist, host_of_rank, parse_hosts, split_endpoint

# (source, rank variable, size variable, local-rank variable); checked in this order after the flags
_SOURCES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class Environment:
    """What a launcher's variables say about this process."""

    source: str  # "torchrun", "SLURM", "Open MPI", "MPICH", or "" when none applies
    rank: int | None = None
    world_size: int | None = None
    local_rank: int = 0
    store: tuple[str, int] | None = None  # where the launcher says the processes meet
    agent_store: bool = False  # torchrun's agent already serves that store: every rank is a client
    namespace: str = "gossip"  # key prefix, unique per job (and per torchrun restart)


@dataclass(frozen=True)
class Plan:
    """How this peer rendezvouses: what is known up front and where the rest is exchanged."""

    source: str  # what gave the rank: "flags", a launcher's name, or "first peer" / "join"
    rank: int | None  # None: the store gives one out
    world_size: int | None  # None: the first peer's, read from the store
    local_rank: int
    endpoints: tuple[str, ...] = ()  # known up front (--hosts); then there is no store
    store: tuple[str, int] | None = None
    host_store: bool = False  # this peer serves the store (rank 0, or the first peer started by hand)
    namespace: str = "gossip"


def read_environment(env: Mapping[str, str], rendezvous_port: int) -> Environment:
    """The first launcher whose rank and size variables are both set, or ``Environment("")``."""
    for source, rank_var, size_var, local_var in _SOURCES:
        if rank_var in env and size_var in env:
            rank, size = _int(env, rank_var, 0), _int(env, size_var, 1)
            if rank >= size:
                raise ConfigError(f"{rank_var}={rank} is not below {size_var}={size}; check the launcher's variables")
            local_rank = _int(env, local_var, 0) if local_var in env else 0
            return Environment(source, rank, size, local_rank, *_meeting_point(source, env, rendezvous_port))
    return Environment("")


def _meeting_point(source: str, env: Mapping[str, str], rendezvous_port: int) -> tuple:
    """(store, agent_store, namespace) for a launcher."""
    master = (env["MASTER_ADDR"], _int(env, "MASTER_PORT", 1)) if "MASTER_ADDR" in env and "MASTER_PORT" in env else None
    if source == "torchrun":
        if master is None:
            raise ConfigError("RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not; start the peers "
                              "with torchrun, or export both")
        run = f"{env.get('TORCHELASTIC_RUN_ID', 'env')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return master, env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", f"gossip/{run}"
    if source == "SLURM":
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if master is None and nodelist:
            master = (expand_nodelist(nodelist)[0], rendezvous_port)
        job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
        return master, False, f"gossip/slurm-{job}"
    return master, False, "gossip/mpi"


def plan_rendezvous(rendezvous: RendezvousConfig, base_port: int, env: Mapping[str, str], server: bool = False) -> Plan:
    """Decide, without any network, what is known and where to meet (flags > torchrun > SLURM > MPI)."""
    found = read_environment(env, rendezvous.store_port(base_port))
    rank = None if server else (rendezvous.rank if rendezvous.rank >= 0 else found.rank)
    world_size = rendezvous.world_size or found.world_size
    source = "flags" if rendezvous.rank >= 0 or (not found.source and rendezvous.world_size) else found.source
    if rendezvous.hosts:
        return _plan_hosts(rendezvous.hosts, rank, world_size, found.local_rank, base_port, server)
    if rank is not None and world_size is not None and rank >= world_size:
        raise ConfigError(f"rank {rank} is outside 0..{world_size - 1} (world size from "
                          f"{'--world-size' if rendezvous.world_size else found.source})")
    if world_size == 1 and not server:
        return Plan(source, 0, 1, found.local_rank)  # alone: nothing to exchange
    if rendezvous.initial_peers:
        store = split_endpoint(rendezvous.initial_peers[0])
        return Plan(source if rank is not None else "join", rank, world_size, found.local_rank, store=store,
                    namespace=found.namespace)
    if found.store is not None:
        return Plan(source, rank, world_size, found.local_rank, store=found.store,
                    host_store=rank == 0 and not found.agent_store, namespace=found.namespace)
    if found.source:
        raise ConfigError(f"{found.source} gives ranks but not where rank 0 is: export MASTER_ADDR (rank 0's host) "
                          "and MASTER_PORT, or pass --initial-peers tcp://HOST:PORT")
    if world_size is None:
        raise ConfigError("this peer does not know its swarm: give the first peer --world-size N and the others "
                          "--initial-peers tcp://FIRST_HOST:PORT (the first peer prints it), or start them under "
                          "torchrun, srun or mpirun")
    return Plan("first peer", None if server else (rank if rank is not None else 0), world_size, found.local_rank,
                store=("", rendezvous.store_port(base_port)), host_store=True, namespace=found.namespace)


def _plan_hosts(spec: str, rank: int | None, world_size: int | None, local_rank: int, base_port: int,
                server: bool) -> Plan:
    hosts = parse_hosts(spec)
    slots = sum(count for _, count in hosts)
    if world_size is not None and world_size != slots:
        raise ConfigError(f"--hosts {spec} has {slots} slots but the world size is {world_size}; make them agree")
    if rank is None and not server:
        raise ConfigError("with --hosts give this peer's --rank (gossip-launch --hosts does that for you)")
    return Plan("flags", rank, slots, local_rank, endpoints=hosts_endpoints(spec, base_port))


def hosts_endpoints(spec: str, base_port: int) -> tuple[str, ...]:
    """With ``--hosts``, peer r listens on its host at port BASE_PORT + r."""
    hosts = parse_hosts(spec)
    return tuple(f"tcp://{host_of_rank(hosts, r)}:{base_port + r}" for r in range(sum(n for _, n in hosts)))


def hosts_server_endpoint(spec: str, base_port: int) -> str:
    """With ``--hosts``, the parameter server runs on the first host, on port BASE_PORT + world size."""
    hosts = parse_hosts(spec)
    return f"tcp://{hosts[0][0]}:{base_port + sum(count for _, count in hosts)}"


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env[name].strip()
    if not text.lstrip("-").isdigit() or int(text) < minimum:
        raise ConfigError(f"{name}={env[name]!r} is not an integer >= {minimum}; unset it or fix the launcher")
    return int(text)
