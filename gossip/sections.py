"""The sections of ``GossipConfig``, one frozen dataclass per concern: who mixes with whom and when
(``Graph``), gossip-sync's rounds (``SyncRounds``), the asynchronous modes' weights (``Asynchronous``),
compressed gossip (``Compression``), robust aggregation and fault injection (``Robustness``), the sockets
(``Network``), the waits (``Timeouts``) and what no honest message can exceed (``Bounds``).

Each section checks its own fields when it is built; what depends on two sections, or on the world size,
``GossipConfig`` checks. Field names are unique across the sections, so a flag, a ``gossip.attach``
keyword and a ``config.json`` key each name one field (``GossipConfig.of``, ``.flat``, ``.replace``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gossip.checks import check_bool, check_choice, check_int, check_positive, check_seconds, is_real
from gossip.errors import ConfigError

MiB = 1 << 20
STALENESS_WEIGHTS = ("none", "inverse", "exp")
RATE_COMPENSATION = ("on", "off")  # asynchronous modes: every peer's data counts alike, or by its rate
ASYNC_RULES = ("push-sum", "latest")  # gossip-async: gossip/averagers/pushsum.py, gossip/averagers/latest.py
SCHEDULES = ("steps", "time")
WEIGHT_BY = ("none", "samples")
DEADLINES = ("fixed", "adaptive")
PARTNERS = ("any", "similar-speed")
AGGREGATES = ("mean", "median", "trimmed-mean", "norm-clip")
COMPRESS = ("none", "float16", "int8")  # gossip/compression.py
# --peer-timeout also sets ZeroMQ's HEARTBEAT_TTL, which holds at most 6553.599 s (gossip/net/transport.py)
MAX_PEER_TIMEOUT = 6553.0


@dataclass(frozen=True)
class Graph:
    """Who mixes with whom (the topology, partner classes by declared speed) and when (every
    ``gossip_every`` steps, or every ``round_seconds`` under schedule "time")."""

    topology: str = "auto"  # GossipConfig.topology_spec resolves it
    partners: str = "any"
    peer_speeds: tuple[float, ...] = ()  # declared per-peer speeds (partners "similar-speed"); empty: all 1
    gossip_every: int = 1
    schedule: str = "steps"
    round_seconds: float = 0.5

    def __post_init__(self) -> None:
        check_choice(self, "schedule", SCHEDULES)
        check_choice(self, "partners", PARTNERS)
        check_int(self, "gossip_every", minimum=1)
        check_seconds(self, "round_seconds")


@dataclass(frozen=True)
class SyncRounds:
    """gossip-sync's lockstep rounds: overlap with the next steps, what a peer's mass counts, and the
    deadline after which a late neighbour's share waits for the next round (``gossip/deadlines.py``)."""

    overlap: bool | None = None  # None: auto (GossipConfig.overlaps resolves it)
    # Overlap copies the weights it sends only when they change before the next mix, as seen by a hook on
    # optimizer steps and the forward pass (gossip/writes.py); a loop that writes them otherwise (in place
    # through ``.data``, without a torch.optim optimizer) sets False to copy every round.
    lazy_snapshot: bool = True
    weight_by: str = "none"  # "none": a mass of 1 per peer
    deadline: str = "fixed"
    deadline_k: float = 3.0
    deadline_floor: float = 0.01  # loopback and scheduler jitter
    deadline_window: int = 16
    pace_tolerance: float = 0.5
    straggler_fraction: float = 0.75

    def __post_init__(self) -> None:
        if self.overlap is not None:
            check_bool(self, "overlap")
        check_bool(self, "lazy_snapshot")
        check_choice(self, "weight_by", WEIGHT_BY)
        check_choice(self, "deadline", DEADLINES)
        check_int(self, "deadline_window", minimum=3)
        check_positive(self, "deadline_k", "pace_tolerance")
        check_seconds(self, "deadline_floor")
        if not (is_real(self.straggler_fraction) and 0 < self.straggler_fraction < 1):
            raise ConfigError(f"--straggler-fraction must be in (0, 1), got {self.straggler_fraction!r}")


@dataclass(frozen=True)
class Asynchronous:
    """The asynchronous modes: gossip-async's rule and its staleness weights, and how a step or gradient
    counts by its peer's rate (``gossip/progress.py``)."""

    async_rule: str = "push-sum"
    staleness_weight: str = "none"  # f(tau) = 1 (none), 1/(1+tau) (inverse), exp(-tau/T)
    staleness_temperature: float = 4.0
    max_staleness: int = 20
    rate_compensation: str = "on"  # a step or gradient counts by rbar / r_i

    def __post_init__(self) -> None:
        check_choice(self, "async_rule", ASYNC_RULES)
        check_choice(self, "staleness_weight", STALENESS_WEIGHTS)
        check_choice(self, "rate_compensation", RATE_COMPENSATION)
        check_positive(self, "staleness_temperature")
        check_int(self, "max_staleness", minimum=0)


@dataclass(frozen=True)
class Compression:
    """What a peer sends compressed: CHOCO-gossip of compressed differences in gossip-sync
    (``gossip/averagers/compressed.py``), compressed pseudo-gradients in ps-avg and outer steps."""

    compress: str = "none"
    consensus_step: float = 1.0  # CHOCO's gamma

    def __post_init__(self) -> None:
        check_choice(self, "compress", COMPRESS)
        if not (is_real(self.consensus_step) and 0 < self.consensus_step <= 1):
            raise ConfigError(f"--consensus-step must be in (0, 1], got {self.consensus_step!r}")


@dataclass(frozen=True)
class Robustness:
    """How contributions are combined (``gossip/aggregate.py``), and which peers send garbage on purpose."""

    aggregate: str = "mean"
    trim_fraction: float = 0.2
    byzantine: tuple[int, ...] = ()
    byzantine_scale: float = 1e30  # uniform in [-scale, scale], capped at a tenth of the dtype's largest

    def __post_init__(self) -> None:
        check_choice(self, "aggregate", AGGREGATES)
        if not (is_real(self.trim_fraction) and 0 < self.trim_fraction < 0.5):
            raise ConfigError(f"--trim-fraction must be in (0, 0.5), got {self.trim_fraction!r}")
        check_positive(self, "byzantine_scale")


@dataclass(frozen=True)
class Network:
    """Where peers listen and how bytes travel: endpoints, binding, IPC on one host, CURVE keys, frame
    size, queues, and emulated per-peer latency."""

    host: str = "127.0.0.1"
    base_port: int = 47000
    endpoints: tuple[str, ...] = ()  # one per rank; empty means tcp://host:(base_port + rank)
    bind: str = ""  # empty: our endpoint's host if it is an IP address
    server_endpoint: str = ""  # ps-* modes; empty means tcp://host:(base_port + world_size)
    ipc: bool = True  # gossip/net/address.py
    secure: str = ""  # KEYDIR (gossip/net/security.py): only the keys of this run's ranks are admitted
    chunk_mb: float = 8.0  # 8-16 MiB keeps glibc from mapping every frame anew
    queue_depth: int = 8
    link_latency_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        check_bool(self, "ipc")
        check_int(self, "queue_depth", minimum=1)
        if not (is_real(self.chunk_mb) and 0.0625 <= self.chunk_mb <= 64):
            raise ConfigError(f"--chunk-mb {self.chunk_mb} is out of range; use a value in 0.0625..64 (8 is good)")

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mb * MiB) // 64 * 64  # a multiple of every element size


@dataclass(frozen=True)
class Timeouts:
    """Every wait, in seconds."""

    round_timeout: float = 60.0
    peer_timeout: float = 3.0  # also ZeroMQ's heartbeat TTL (MAX_PEER_TIMEOUT)
    startup_timeout: float = 120.0
    send_timeout: float = 60.0
    shutdown_timeout: float = 10.0

    def __post_init__(self) -> None:
        check_seconds(self, "round_timeout", "startup_timeout", "send_timeout", "shutdown_timeout")
        check_seconds(self, "peer_timeout", limit=MAX_PEER_TIMEOUT, why="ZeroMQ's heartbeat limit")


@dataclass(frozen=True)
class Bounds:
    """What no honest message of this run can exceed (0: unknown, e.g. a library user's config): the run's
    rounds and steps, and a push-sum weight. Set from the run's flags by RunConfig; a message that claims
    more is dropped (``gossip/mailbox.py``)."""

    max_rounds: int = 0
    max_steps: int = 0
    max_weight: float = 0.0


SECTIONS = {"graph": Graph, "sync": SyncRounds, "asynchronous": Asynchronous, "compression": Compression,
            "robust": Robustness, "network": Network, "timeouts": Timeouts, "bounds": Bounds}
