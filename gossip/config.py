"""Frozen configuration dataclasses: the single home of every default.

``GossipConfig`` is what one peer's averager needs, in the sections of ``gossip/sections.py``
(``gossip.attach`` builds it from keyword arguments, ``GossipConfig.of``); ``CoordinatorConfig`` is the
parameter server's; ``RunConfig`` is a whole local run as ``python -m launch`` describes it, holding a
``GossipConfig`` whose ``rank`` is filled in per peer. The launcher's flags take their defaults from these
fields, so a default is changed here and nowhere else. Each field that is a flag is described once, by its
help in ``launch/flags.py`` (``gossip-launch --help``); the comments here say only what that help does not.

Each field's default sits beside the check that refuses a bad value of it (``gossip/checks.py``), so that
neither is a file away from the other; the checks that read several fields of a run are here too, with
``USED_ONLY_IN``, which refuses a setting where the run would not read it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import topologies
from gossip.checks import (
    MAX_WAIT_SECONDS,
    check_auto_number,
    check_choice,
    check_int,
    check_per_peer,
    check_positive,
    check_seconds,
    flag_of,
    is_real,
)
from gossip.errors import ConfigError
from gossip.net.address import bindable, check_host, parse_hosts, split_endpoint
from gossip.net.limits import MAX_PROGRESS_PEERS
from gossip.partition import parse_partition
from gossip.recipes import OPTIMIZER_DEFAULTS, RECIPES, recipe
from gossip.sections import (
    SECTIONS,
    Asynchronous,
    Bounds,
    Compression,
    Graph,
    Network,
    Robustness,
    SyncRounds,
    Timeouts,
)

GOSSIP_MODES = ("gossip-sync", "gossip-async")
PS_MODES = ("ps-sync", "ps-avg", "ps-async", "ps-ssp", "ps-dcasgd")  # a parameter server and N workers
MODES = GOSSIP_MODES + PS_MODES
DERIVED_FIELDS = frozenset(f.name for f in dataclasses.fields(Bounds))  # GossipConfig fields RunConfig computes
SWARM_BUDGET_MODES = ("gossip-async", "ps-async", "ps-ssp", "ps-dcasgd")  # end on the swarm's steps, not each peer's
COORDINATE_WISE = ("median", "trimmed-mean")  # gossip/aggregate.py: gossip, ps-sync and ps-avg
NORM_BOUNDED = ("ps-sync", "ps-async", "ps-ssp", "ps-dcasgd")  # norm-clip: gossip/coordinator/normbound.py


def robust_rules(mode: str) -> str:
    """The --aggregate values that keep a byzantine contribution out of ``mode``'s result, in words: a
    server that applies one gradient at a time has no median, only the norm bound."""
    return "norm-clip" if mode in ("ps-async", "ps-ssp", "ps-dcasgd") else "median or trimmed-mean"


OPTIMIZERS = ("sgd", "adamw")  # gossip/optim.py
LR_SCHEDULES = ("constant", "cosine", "linear")
OUTER_OPTIMIZERS = ("sgd", "nesterov")  # ps-avg's outer step: gossip/coordinator/averaging.py
OUTER_DEFAULTS = {"sgd": (1.0, 0.0), "nesterov": (0.7, 0.9)}  # (lr, momentum): plain averaging; OpenDiLoCo's
SECOND_MOMENTS = ("auto", "own", "swarm")  # --second-moment: gossip/swarm_adamw.py
OWN_OPTIMIZER_MODES = ("gossip-sync", "gossip-async", "ps-avg")  # every peer steps its own optimizer
DEFAULT_NODES = 4
MAX_SEED = (1 << 32) - 1  # numpy's and torch's generators take any 32-bit seed; runs derive per-peer seeds from it
MIN_SPEED, MAX_SPEED = 1e-6, 1e6  # --speeds: a peer at speed s sleeps (1/s - 1) times its step's compute time


@dataclass(frozen=True)
class GossipConfig:
    """How one peer exchanges and averages weights with its neighbours: who it is (``rank`` of
    ``world_size``), the ``mode``, and one section per concern (``gossip/sections.py``). ``of``, ``flat``
    and ``replace`` name fields by their own names wherever they sit, as flags and ``attach`` keywords do."""

    rank: int = 0
    world_size: int = 1
    mode: str = "gossip-sync"
    seed: int = 0
    graph: Graph = field(default_factory=Graph)
    sync: SyncRounds = field(default_factory=SyncRounds)
    asynchronous: Asynchronous = field(default_factory=Asynchronous)
    compression: Compression = field(default_factory=Compression)
    robust: Robustness = field(default_factory=Robustness)
    network: Network = field(default_factory=Network)
    timeouts: Timeouts = field(default_factory=Timeouts)
    bounds: Bounds = field(default_factory=Bounds)

    def __post_init__(self) -> None:
        """The checks that read two sections, or a section and the world size; each section has checked
        its own fields."""
        check_int(self, "world_size", minimum=1)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ConfigError(f"rank must be an integer, got {self.rank!r}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.world_size - 1}; ranks count from 0")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; choose one of: {', '.join(MODES)}")
        check_int(self, "seed", minimum=0, maximum=MAX_SEED)
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"GossipConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        graph, sync, asynchronous = self.graph, self.sync, self.asynchronous
        if asynchronous.async_rule == "push-sum" and self.mode == "gossip-async" and \
                asynchronous.staleness_weight != "none":
            raise ConfigError(f"--staleness-weight {asynchronous.staleness_weight} weights held snapshots by age, "
                              "which push-sum has none of (each message is mixed once, when it arrives); add "
                              "--async-rule latest to mix the latest snapshot of each neighbour by age instead")
        if self.mode != "gossip-sync" and (sync.weight_by != "none" or sync.deadline != "fixed"):
            raise ConfigError("--weight-by samples and --deadline adaptive need --mode gossip-sync (gossip-async "
                              "never waits, and its push-sum mass already carries whatever arrives late)")
        if sync.overlap is False and self.mode != "gossip-sync":
            raise ConfigError("--no-overlap applies to --mode gossip-sync (the other modes never wait for a round)")
        if self.parameter_server and (graph.schedule != "steps" or graph.partners != "any"):
            raise ConfigError("--schedule time and --partners apply to the gossip modes; the ps-* modes talk to "
                              "the server every step (ps-avg: every --local-steps steps)")
        _check_aggregate(self)
        _check_compress(self)
        check_per_peer(graph, "peer_speeds", self.world_size, lambda v: 0 < v <= 1e6, "positive numbers")
        check_per_peer(self.network, "link_latency_ms", self.world_size, lambda v: 0 <= v <= 60_000,
                       "milliseconds in 0..60000")
        _check_network(self)
        if self.world_size > 1 and not self.parameter_server:
            topology = self.build_topology()  # a bad spec fails here, before any socket opens
            if self.robust.aggregate != "mean":
                _check_robust_degree(self, topology)

    @classmethod
    def of(cls, **values: Any) -> GossipConfig:
        """A config from fields named flat (``GossipConfig.of(world_size=4, compress="int8")``), each in
        its section; the others keep their defaults."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> GossipConfig:
        """This config with the named fields changed, wherever they sit; an unknown name is refused."""
        unknown = sorted(set(values) - set(SECTION_OF))
        if unknown:
            close = difflib.get_close_matches(unknown[0], SECTION_OF, n=1, cutoff=0.8)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"unknown option {unknown[0]!r}; {hint}see gossip.GossipConfig for the options")
        top = {name: value for name, value in values.items() if SECTION_OF[name] is None}
        for section in SECTIONS:
            changed = {name: value for name, value in values.items() if SECTION_OF[name] == section}
            if changed:
                top[section] = dataclasses.replace(getattr(self, section), **changed)
        return dataclasses.replace(self, **top)

    def flat(self) -> dict[str, Any]:
        """Every field by its own name, the sections' included (what ``of`` takes back)."""
        values = {name: getattr(self, name) for name in TOP_FIELDS}
        for section in SECTIONS:
            values.update(dataclasses.asdict(getattr(self, section)))
        return values

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GossipConfig:
        """The config that ``dataclasses.asdict`` gave ``data`` (``config.json``): sections are dicts there,
        and lists stand for tuples."""
        data = dict(data)
        sections = {}
        for name, kind in SECTIONS.items():
            given = dict(data.pop(name, {}))
            for f in dataclasses.fields(kind):
                if isinstance(f.default, tuple) and f.name in given:
                    given[f.name] = tuple(given[f.name])
            sections[name] = kind(**given)
        return cls(**data, **sections)

    @property
    def parameter_server(self) -> bool:
        return self.mode in PS_MODES

    @property
    def swarm_budget(self) -> bool:
        """The run ends once the swarm has done ``--steps`` per peer on average (steps, or the server's
        gradients), not as each peer has done its own: the asynchronous modes under schedule "steps"
        (``gossip/progress.py``, ``gossip/coordinator/core.py``)."""
        return self.mode in SWARM_BUDGET_MODES and self.graph.schedule == "steps"

    @property
    def server_rank(self) -> int:
        """The server takes the rank after the last worker's, so one list of endpoints names everyone."""
        return self.world_size

    @property
    def topology_spec(self) -> str:
        """``--topology``, with "auto" resolved: SGP's exponential graph for gossip-sync's plain lockstep mix
        (every step, fixed deadlines, no --weight-by, the plain mean, no --compress, --partners any), where it
        came closest to a synchronous server with AdamW on the language model (docs/architecture.md, section
        3.1); the random graph with --partners similar-speed, the one graph it applies to; the ring otherwise,
        where the other rules were built and measured."""
        if self.graph.topology != "auto":
            return self.graph.topology
        if self.graph.partners != "any":
            return "random"
        return "exponential" if self.plain_lockstep else "ring"

    @property
    def plain_lockstep(self) -> bool:
        """gossip-sync's plain lockstep mix: every step, fixed deadlines, no --weight-by, the plain mean and no
        --compress."""
        graph, sync = self.graph, self.sync
        return (self.mode == "gossip-sync" and graph.schedule == "steps" and graph.gossip_every == 1
                and sync.deadline == "fixed" and sync.weight_by == "none" and self.robust.aggregate == "mean"
                and self.compression.compress == "none")

    @property
    def overlaps(self) -> bool:
        """``--overlap``, with auto (None) resolved: off on the exponential graph (SGP's setting: each round
        mixes this step's weights), on elsewhere."""
        if self.sync.overlap is not None:
            return self.sync.overlap
        return self.topology_spec != "exponential"

    def build_topology(self) -> topologies.Topology:
        """The topology every peer of this run builds, with partner classes when ``partners`` asks for them."""
        topology = build_topology(self.topology_spec, self.world_size)
        if self.graph.partners == "similar-speed":
            speeds = self.graph.peer_speeds or (1.0,) * self.world_size
            try:
                topology = topologies.prefer_similar(topology, topologies.speed_classes(speeds))
            except topologies.ConfigError as exc:
                raise ConfigError(f"--partners similar-speed: {exc}") from exc
        return topology

    def endpoint(self, rank: int) -> str:
        """The ZeroMQ endpoint on which peer ``rank`` (or the server, ``server_rank``) receives."""
        network = self.network
        if rank == self.server_rank and network.server_endpoint:
            return network.server_endpoint
        if network.endpoints and rank < self.world_size:
            return network.endpoints[rank]
        return f"tcp://{network.host}:{network.base_port + rank}"

    def bind_endpoint(self, rank: int) -> str:
        """Where peer ``rank`` listens: its endpoint's port on ``bind``, by default on the endpoint's own
        address (ZeroMQ binds addresses, not names: a peer announced by name listens on every interface)."""
        host, port = split_endpoint(self.endpoint(rank))
        return f"tcp://{self.network.bind or bindable(host)}:{port}"


# every field of GossipConfig by its own name -> the section that holds it (None: GossipConfig itself), and
# its dataclass field: what a flag or an attach keyword sets
SECTION_OF: dict[str, str | None] = {
    **{f.name: None for f in dataclasses.fields(GossipConfig) if f.name not in SECTIONS},
    **{f.name: section for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)},
}
TOP_FIELDS = tuple(name for name, section in SECTION_OF.items() if section is None)
GOSSIP_FIELDS: dict[str, dataclasses.Field[Any]] = {
    f.name: f for kind in (GossipConfig, *SECTIONS.values()) for f in dataclasses.fields(kind) if f.name in SECTION_OF}


@dataclass(frozen=True)
class CoordinatorConfig:
    """The parameter-server modes: what workers send and what the server does with it (README,
    "Parameter-server modes")."""

    local_steps: int = 10  # averaging every 10-20 minibatches still trains well
    staleness_lr: bool = False
    soft_sync: int = 1  # gradients from any workers
    staleness_bound: int = 3
    dc_lambda: float = 0.04
    dc_adaptive: bool = False
    dc_momentum: float = 0.95  # m in MS <- m MS + (1 - m) g*g
    dc_epsilon: float = 1e-7
    missing_worker: str = "fail"  # "fail" names the silent worker
    server_retries: int = 5  # with back-off, then the worker fails
    # the server's SGD, "auto" or a number used as given; "auto" is server_optimizer in gossip/coordinator/modes.py
    server_momentum: float | str = "auto"
    server_lr: float | str = "auto"
    # ps-avg's outer step on the workers' mean change (DiLoCo); sgd with lr 1 and momentum 0 is plain averaging.
    # "auto": sgd 1 and 0; nesterov 0.7 and 0.9, OpenDiLoCo's (gossip/coordinator/averaging.py)
    outer_optimizer: str = "sgd"
    outer_lr: float | str = "auto"
    outer_momentum: float | str = "auto"

    def __post_init__(self) -> None:
        check_auto_number(self, "server_momentum", lambda v: 0 <= v < 1, "in [0, 1)")
        check_auto_number(self, "server_lr", lambda v: v > 0, "> 0")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(f"--outer-optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got "
                              f"{self.outer_optimizer!r}")
        check_auto_number(self, "outer_lr", lambda v: v > 0, "> 0")
        check_auto_number(self, "outer_momentum", lambda v: 0 <= v < 1, "in [0, 1)")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            raise ConfigError("--outer-optimizer nesterov needs --outer-momentum > 0 (Nesterov's look-ahead is "
                              "the momentum); use --outer-optimizer sgd for none")
        check_int(self, "local_steps", minimum=1)
        check_int(self, "soft_sync", minimum=1)
        check_int(self, "staleness_bound", minimum=0)
        for name in ("staleness_lr", "dc_adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{flag_of(name)} is a switch (true or false), got {getattr(self, name)!r}")
        if not (is_real(self.dc_lambda) and self.dc_lambda >= 0):
            raise ConfigError(f"--dc-lambda must be a number >= 0 (0 makes DC-ASGD plain ASGD), got {self.dc_lambda!r}")
        if not (is_real(self.dc_momentum) and 0 <= self.dc_momentum < 1):
            raise ConfigError(f"--dc-momentum must be in [0, 1), got {self.dc_momentum!r}")
        check_positive(self, "dc_epsilon")
        check_int(self, "server_retries", minimum=0)
        if self.missing_worker not in ("fail", "continue"):
            raise ConfigError(f"--missing-worker must be fail or continue, got {self.missing_worker!r}")

    @property
    def outer(self) -> tuple[str, float, float]:
        """The outer step as (optimizer, lr, momentum), "auto" resolved by ``OUTER_DEFAULTS``."""
        lr, momentum = OUTER_DEFAULTS[self.outer_optimizer]
        return (self.outer_optimizer, lr if self.outer_lr == "auto" else self.outer_lr,
                momentum if self.outer_momentum == "auto" else self.outer_momentum)

    @property
    def outer_step(self) -> bool:
        """Is there an outer step other than the plain mean (outer SGD at lr 1 without momentum)?"""
        return self.outer != ("sgd", 1.0, 0.0)


@dataclass(frozen=True)
class RunConfig:
    """A local run of ``nodes`` peers, as the launcher describes it to every peer process."""

    nodes: int = DEFAULT_NODES
    task: str = "digits"
    # "auto": the task's recipe (gossip/recipes.py), resolved in __post_init__ so that every reader sees numbers
    steps: int | str = "auto"
    rounds: int = 0
    out: str = ""  # empty: runs/<date-time>
    speeds: tuple[float, ...] = ()  # empty: all 1
    compute_ms: float = 0.0
    link_mbit: tuple[float, ...] = ()  # launch/links.py
    threads_per_peer: int = 1
    optimizer: str = "auto"
    lr: float | str = "auto"
    momentum: float = 0.9  # SGD's
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    # AdamW's second moment where peers step their own and average: own, or swarm (the mean gradient's);
    # auto: swarm on gossip-sync's exponential lockstep mix, own elsewhere (swarm_peers; gossip/swarm_adamw.py)
    second_moment: str = "auto"
    weight_decay: float | str = "auto"
    lr_schedule: str = "auto"
    warmup_steps: int | str = "auto"
    min_lr: float | str = "auto"
    batch_size: int | str = "auto"
    partition: str = "iid"  # gossip/partition.py
    data: str = ""  # charlm: a text file or folder; empty: the Python standard library's sources
    context: int = 64  # charlm's model (gossip/tasks/charlm.py)
    layers: int = 2
    model_dim: int = 128
    heads: int = 4
    dim: int = 256
    eval_every: int | str = "auto"
    log_every: int = 1
    trace_coords: int = 65536  # coordinates sampled per peer for the consensus-distance trace
    checkpoint_every: int = 0
    max_restarts: int = 0
    keep_going: bool = False  # a dead server always stops the run
    allow_divergence: bool = False  # exit 0 even when the product model learned nothing (launch/summary.py)
    device: str = "auto"
    # sized like the default run, so that RunConfig() is valid; other sizes pass their own GossipConfig
    gossip: GossipConfig = field(default_factory=lambda: GossipConfig(world_size=DEFAULT_NODES))
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)

    def __post_init__(self) -> None:
        check_int(self, "nodes", minimum=1)
        _resolve_recipe(self)
        check_int(self, "steps", minimum=1)
        check_int(self, "threads_per_peer", minimum=1)
        check_int(self, "batch_size", minimum=1)
        check_int(self, "dim", minimum=1)
        check_int(self, "eval_every", minimum=0)
        _check_training(self)
        _check_task_flags(self)
        check_int(self, "log_every", minimum=1)
        check_int(self, "trace_coords", minimum=1)
        check_int(self, "checkpoint_every", minimum=0)
        check_int(self, "max_restarts", minimum=0)
        if not (isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)):
            raise ConfigError(f"--device {self.device!r} is not a device; use auto, cpu, cuda or cuda:I (e.g. cuda:1)")
        if not (is_real(self.compute_ms) and self.compute_ms >= 0):
            raise ConfigError(f"--compute-ms {self.compute_ms} must be a finite number >= 0")
        if self.speeds:
            if len(self.speeds) != self.nodes:
                raise ConfigError(
                    f"--speeds lists {len(self.speeds)} values for {self.nodes} nodes; give one per node, e.g. "
                    + ",".join(["1"] * (self.nodes - 1) + ["0.25"])
                )
            bad = [s for s in self.speeds if not (is_real(s) and 0 < s)]
            if bad:
                raise ConfigError(f"--speeds must be positive numbers (1 = full speed, 0.25 = 4x slower); got {bad[0]}")
            bad = [s for s in self.speeds if not MIN_SPEED <= s <= MAX_SPEED]
            if bad:
                raise ConfigError(f"--speeds must be in {MIN_SPEED:g}..{MAX_SPEED:g} ({MIN_SPEED:g}: a million times "
                                  f"slower); got {bad[0]!r}")
        slowest = min(self.speeds, default=1.0)  # a step sleeps compute_ms / speed: at most MAX_WAIT_SECONDS
        if self.compute_ms > MAX_WAIT_SECONDS * 1000 * slowest:
            at = f" at the slowest --speeds, {slowest:g}" if slowest != 1.0 else ""
            raise ConfigError(f"--compute-ms must be in 0..{MAX_WAIT_SECONDS * 1000 * slowest:g} (a step of at most "
                              f"one week{at}), got {self.compute_ms!r}")
        if self.gossip.world_size != self.nodes:
            raise ConfigError(f"gossip.world_size {self.gossip.world_size} differs from nodes {self.nodes}")
        if self.coordinator.soft_sync > self.nodes:
            raise ConfigError(f"--soft-sync {self.coordinator.soft_sync} exceeds the {self.nodes} workers; "
                              f"use 1..{self.nodes} (1 applies every gradient on arrival)")
        outer = [flag_of(n) for n in ("outer_lr", "outer_momentum") if getattr(self.coordinator, n) != "auto"]
        if self.coordinator.outer_optimizer != "sgd":
            outer.insert(0, "--outer-optimizer")
        compress = self.gossip.compression.compress
        if outer and self.gossip.mode not in ("ps-avg", "gossip-sync"):
            raise ConfigError(f"{' and '.join(outer)} set{'s' if len(outer) == 1 else ''} the outer step of ps-avg's "
                              f"server or of each gossip-sync peer, and --mode {self.gossip.mode} has none; use --mode "
                              "ps-avg or gossip-sync (DiLoCo: --outer-optimizer nesterov)")
        given = [flag_of(n) for n in ("server_lr", "server_momentum") if getattr(self.coordinator, n) != "auto"]
        if given and self.gossip.mode not in ("ps-sync", "ps-async", "ps-ssp", "ps-dcasgd"):
            who = "workers" if self.gossip.parameter_server else "peers"
            raise ConfigError(f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} the parameter server's "
                              f"optimizer, which --mode {self.gossip.mode} has none of (its {who} step their own "
                              "optimizers with --lr and --momentum" +
                              ("; ps-avg's server steps with --outer-lr and --outer-momentum)"
                               if self.gossip.mode == "ps-avg" else ")"))
        rates = self.gossip.asynchronous.rate_compensation
        if rates != "on" and self.gossip.mode not in SWARM_BUDGET_MODES:
            raise ConfigError(f"--rate-compensation {rates} sets how an asynchronous mode "
                              f"counts a peer's steps by its rate; --mode {self.gossip.mode} is synchronous (every "
                              f"peer counts alike): use one of {', '.join(SWARM_BUDGET_MODES)}, or drop the flag")
        if self.gossip.mode == "gossip-async" and self.nodes > MAX_PROGRESS_PEERS:
            raise ConfigError(f"gossip-async carries every peer's step count in each message: at most "
                              f"{MAX_PROGRESS_PEERS} peers, got {self.nodes}; use gossip-sync for more")
        check_int(self, "rounds", minimum=0)
        if self.max_restarts and compress != "none" and self.gossip.mode == "gossip-sync":
            raise ConfigError(f"--max-restarts cannot be combined with --compress {compress}: a restarted "
                              "peer cannot rebuild its neighbours' copies of its public model")
        if self.gossip.graph.schedule == "time" and not self.rounds:
            raise ConfigError("--schedule time needs --rounds N: the run lasts N rounds of --round-seconds each, "
                              "and every peer does as many local steps as fit in a round")
        if self.gossip.graph.schedule == "time" and self.lr_schedule != "constant":
            raise ConfigError(f"--lr-schedule {self.lr_schedule} decays over the run's steps, which --schedule time "
                              "does not fix in advance; use --lr-schedule constant (a warm-up is allowed) or "
                              "--schedule steps")
        _check_unused(self)
        object.__setattr__(self, "gossip", dataclasses.replace(self.gossip, bounds=self._horizon()))
        check_per_peer(self, "link_mbit", self.nodes, lambda v: 0 <= v <= 1e6, "rates in Mbit/s >= 0 (0: unlimited)")

    def _horizon(self) -> Bounds:
        """The bounds of GossipConfig's ``max_*`` fields for this run. A push-sum weight is at most the
        network's whole mass: N, or with ``--weight-by samples`` N times the samples of a round (under
        schedule "time" a round's steps are not known in advance, so that weight is left unbounded)."""
        by_steps = self.gossip.graph.schedule == "steps"
        weight = float(self.nodes)
        if self.gossip.sync.weight_by == "samples":
            weight = float(self.nodes * self.batch_size * self.gossip.graph.gossip_every) if by_steps else 0.0
        # a swarm-wide budget lets one peer do all the swarm's steps (the others died, or are that much slower)
        share = self.nodes if self.gossip.swarm_budget else 1
        return Bounds(max_rounds=self.total_rounds * share, max_steps=self.steps * share if by_steps else 0,
                      max_weight=weight)

    @property
    def total_rounds(self) -> int:
        """Mixing rounds every peer does: ``rounds`` under schedule "time", else steps // gossip_every."""
        return self.rounds if self.gossip.graph.schedule == "time" else self.steps // self.gossip.graph.gossip_every

    @property
    def swarm_peers(self) -> int:
        """For how many peers' gradients each peer's AdamW sets its second moment (``gossip/swarm_adamw.py``):
        N with ``--second-moment swarm`` where each peer steps its own AdamW and the models are averaged
        (``OWN_OPTIMIZER_MODES``); at auto, N only where it was measured to pay: gossip-sync's plain lockstep
        mix on SGP's exponential graph without overlap and with no outer step (on the ring and in gossip-async
        it made the language model worse, in ps-avg better at one seed and worse at another:
        docs/architecture.md, 3.11); else 1, AdamW's own."""
        if self.optimizer != "adamw" or self.gossip.mode not in OWN_OPTIMIZER_MODES or self.second_moment == "own":
            return 1
        gossip = self.gossip
        measured = (gossip.plain_lockstep and gossip.topology_spec == "exponential" and not gossip.overlaps
                    and not self.coordinator.outer_step)
        return self.nodes if self.second_moment == "swarm" or measured else 1

    def speed(self, rank: int) -> float:
        return self.speeds[rank] if self.speeds else 1.0

    def for_rank(self, rank: int) -> RunConfig:
        return dataclasses.replace(self, gossip=dataclasses.replace(self.gossip, rank=rank))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data)
        for name in ("speeds", "link_mbit", "betas"):
            if name in data:
                data[name] = tuple(data[name])
        gossip = GossipConfig.from_dict(data.pop("gossip", {}))
        coordinator = CoordinatorConfig(**data.pop("coordinator", {}))
        return cls(**data, gossip=gossip, coordinator=coordinator)


@dataclass(frozen=True)
class RendezvousConfig:
    """How a peer started on its own (``gossip-peer``, under torchrun, srun or mpirun) learns its rank, the
    world size and its peers' endpoints; and how ``gossip-launch --hosts`` starts peers on other hosts.
    Explicit values win over the environment (see ``gossip.rendezvous``)."""

    rank: int = -1  # -1: not given
    world_size: int = 0  # 0: not given
    announce: str = ""
    initial_peers: tuple[str, ...] = ()
    rendezvous_port: int = 0  # 0: BASE_PORT - 1 (store_port)
    rendezvous_timeout: float = 300.0
    hosts: str = ""
    hostfile: str = ""  # gossip-launch only, like the remote_* fields
    remote_shell: str = "ssh"
    remote_python: str = ""

    def __post_init__(self) -> None:
        check_int(self, "rank", minimum=-1)
        check_int(self, "world_size", minimum=0, flag="--world-size")
        check_int(self, "rendezvous_port", minimum=0, maximum=65535)
        check_seconds(self, "rendezvous_timeout")
        if self.rank >= 0 and self.world_size and self.rank >= self.world_size:
            raise ConfigError(f"--rank {self.rank} is outside 0..{self.world_size - 1}; ranks count from 0")
        if self.announce:
            check_host(self.announce, "--announce")
        for endpoint in self.initial_peers:
            split_endpoint(endpoint)
        if self.hosts:
            parse_hosts(self.hosts)
        if self.hosts and self.hostfile:
            raise ConfigError("give --hosts or --hostfile, not both")
        if not (isinstance(self.remote_shell, str) and self.remote_shell.split()):
            raise ConfigError("--remote-shell is empty; give the command that runs a command on a host, e.g. ssh")

    def store_port(self, base_port: int) -> int:
        return self.rendezvous_port or base_port - 1


AUTO_FIELDS = ("optimizer", "steps", "batch_size", "eval_every", "lr", "weight_decay", "lr_schedule",
               "warmup_steps", "min_lr")  # RunConfig fields whose "auto" is the task's recipe


def recipe_values(task: str, optimizer: str, steps: int, lr: float) -> dict[str, Any]:
    """What every field of ``AUTO_FIELDS`` is at "auto" for ``task``, given the optimizer, steps and lr in
    force (warm-up and the final lr are fractions of them; another optimizer than the recipe's gets its
    usual lr and weight decay, ``OPTIMIZER_DEFAULTS``)."""
    chosen = recipe(task)
    usual = {} if optimizer == chosen.optimizer else OPTIMIZER_DEFAULTS.get(optimizer, {})
    return {"optimizer": chosen.optimizer, "steps": chosen.steps, "batch_size": chosen.batch_size,
            "eval_every": chosen.eval_every, "lr": usual.get("lr", chosen.lr),
            "weight_decay": usual.get("weight_decay", chosen.weight_decay), "lr_schedule": chosen.lr_schedule,
            "warmup_steps": round(chosen.warmup_fraction * steps) if isinstance(steps, int) else 0,
            "min_lr": chosen.min_lr_fraction * lr if is_real(lr) else 0.0}


def _resolve_recipe(cfg: RunConfig) -> None:
    """Replace every "auto" training field of ``cfg`` by its task's recipe (``gossip/recipes.py``); a number
    given as a string (as a flag gives it) becomes a number."""
    if cfg.optimizer == "auto":
        object.__setattr__(cfg, "optimizer", recipe(cfg.task).optimizer)
    check_choice(cfg, "optimizer", OPTIMIZERS)
    first = recipe_values(cfg.task, cfg.optimizer, 0, 0.0)
    _resolve_auto(cfg, "steps", int, first["steps"])
    _resolve_auto(cfg, "lr", float, first["lr"])
    defaults = recipe_values(cfg.task, cfg.optimizer, cfg.steps, cfg.lr)
    for name, kind in (("batch_size", int), ("eval_every", int), ("weight_decay", float), ("warmup_steps", int),
                       ("min_lr", float)):
        _resolve_auto(cfg, name, kind, defaults[name])
    if cfg.lr_schedule == "auto":
        object.__setattr__(cfg, "lr_schedule", defaults["lr_schedule"])


def _resolve_auto(cfg: Any, name: str, kind: type, default: int | float) -> None:
    value = getattr(cfg, name)
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            value = default if text == "auto" else kind(text) if kind is float else int(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"{flag_of(name)} must be {what} or auto, got {getattr(cfg, name)!r}") from None
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    object.__setattr__(cfg, name, value)


def _check_training(cfg: RunConfig) -> None:
    """The optimizer, its schedule and the partition: each a value that means something."""
    check_positive(cfg, "lr")
    if not (is_real(cfg.momentum) and 0 <= cfg.momentum < 1):
        raise ConfigError(f"--momentum {cfg.momentum} must be in [0, 1)")
    betas = cfg.betas
    if not (isinstance(betas, tuple) and len(betas) == 2 and all(is_real(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"--betas must be two numbers in [0, 1), e.g. 0.9,0.999; got {cfg.betas!r}")
    if not (is_real(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise ConfigError(f"--weight-decay must be a number >= 0, got {cfg.weight_decay!r}")
    check_choice(cfg, "lr_schedule", LR_SCHEDULES)
    check_choice(cfg, "second_moment", SECOND_MOMENTS)
    check_int(cfg, "warmup_steps", minimum=0)
    if not (is_real(cfg.min_lr) and 0 <= cfg.min_lr <= cfg.lr):
        raise ConfigError(f"--min-lr must be in 0..--lr ({cfg.lr:g}), got {cfg.min_lr!r}")
    if cfg.optimizer == "adamw" and cfg.momentum != 0.9:
        raise ConfigError("--momentum is SGD's; AdamW's momentum is the first of --betas (e.g. --betas 0.9,0.999)")
    if cfg.optimizer == "sgd" and cfg.betas != (0.9, 0.999):
        raise ConfigError("--betas are AdamW's; SGD's momentum is --momentum (or choose --optimizer adamw)")


def _check_task_flags(cfg: RunConfig) -> None:
    """The partition rule must be one the task's data allows, and the model's sizes numbers that fit."""
    partition = parse_partition(cfg.partition)
    object.__setattr__(cfg, "partition", partition.spec)
    rules = recipe(cfg.task).partitions
    if partition.rule not in rules:
        raise ConfigError(f"--partition {partition.spec} does not apply to --task {cfg.task}; use "
                          f"{' or '.join(r + (':ALPHA' if r == 'dirichlet' else '') for r in rules)}")
    check_int(cfg, "context", minimum=1, maximum=1 << 16)
    # beyond GPT-3's 96 layers of width 12288 and 96 heads, ten times over: a typo, not a model
    for name, largest in (("layers", 1024), ("model_dim", 1 << 17), ("heads", 1024)):
        check_int(cfg, name, minimum=1, maximum=largest)
    if cfg.model_dim % cfg.heads:
        raise ConfigError(f"--model-dim {cfg.model_dim} must be a multiple of --heads {cfg.heads}")
    if not isinstance(cfg.data, str):
        raise ConfigError(f"--data must be a path, got {cfg.data!r}")


class Need(NamedTuple):
    """A condition of a setting being read: the run's ``setting`` (a field of RunConfig or of its gossip or
    coordinator part) has a value that ``holds``. ``where`` names such runs, ``fix`` says how to get one."""

    setting: str
    holds: Callable[[Any], bool]
    where: str
    fix: str


_GOSSIP = Need("mode", lambda v: v in GOSSIP_MODES, "the gossip modes", "choose --mode gossip-sync or gossip-async")
_SYNC = Need("mode", lambda v: v == "gossip-sync", "--mode gossip-sync", "choose --mode gossip-sync")
_ASYNC = Need("mode", lambda v: v == "gossip-async", "--mode gossip-async", "choose --mode gossip-async")
_LATEST = Need("async_rule", lambda v: v == "latest", "--async-rule latest", "add --async-rule latest")
_EXP = Need("staleness_weight", lambda v: v == "exp", "--staleness-weight exp", "add --staleness-weight exp")
_RATES = Need("mode", lambda v: v in SWARM_BUDGET_MODES, "--mode " + ", ".join(SWARM_BUDGET_MODES),
              "choose one of those modes")
_ADAPTIVE = Need("deadline", lambda v: v == "adaptive", "--deadline adaptive", "add --deadline adaptive")
_COMPRESSED = Need("compress", lambda v: v != "none", "--compress float16 or int8", "add --compress float16 or int8")
_TRIMMED = Need("aggregate", lambda v: v == "trimmed-mean", "--aggregate trimmed-mean", "add --aggregate trimmed-mean")
_BYZANTINE = Need("byzantine", bool, "--byzantine RANKS", "add --byzantine RANKS")
_THREE = Need("nodes", lambda v: v >= 3, "--nodes 3 or more",
              "use --nodes 3 or more (one bad input of 3 is outvoted by two)")
_TWO = Need("nodes", lambda v: v >= 2, "--nodes 2 or more",
            "use --nodes 2 or more (a byzantine peer needs an honest one to mislead)")
_BY_STEPS = Need("schedule", lambda v: v == "steps", "--schedule steps", "drop --schedule time")
_BY_TIME = Need("schedule", lambda v: v == "time", "--schedule time", "add --schedule time")
_PS = Need("mode", lambda v: v in PS_MODES, "the ps-* modes", "choose one of them")
_PS_AVG = Need("mode", lambda v: v == "ps-avg", "--mode ps-avg", "choose --mode ps-avg")
# an outer step: ps-avg's server (DiLoCo), or each gossip-sync peer's after its lockstep mix (decentralized DiLoCo)
_OUTER = Need("mode", lambda v: v in ("ps-avg", "gossip-sync"), "--mode ps-avg or gossip-sync", "choose one of them")
_COMPRESSES = Need("mode", lambda v: v in ("gossip-sync", "ps-avg"), "--mode gossip-sync or ps-avg",
                   "choose one of them")
_FIXED = Need("deadline", lambda v: v == "fixed", "--deadline fixed", "drop --deadline adaptive")
_UNWEIGHTED = Need("weight_by", lambda v: v == "none", "--weight-by none", "drop --weight-by")
_OUTER_NEEDS = (_OUTER, _FIXED, _UNWEIGHTED)  # (gossip: the lockstep mix, every weight 1; not --compress: below)
_SERVER_SGD = Need("mode", lambda v: v in PS_MODES and v != "ps-avg", "--mode ps-sync, ps-async, ps-ssp or ps-dcasgd",
                   "choose one of those modes")
_ON_ARRIVAL = Need("mode", lambda v: v in ("ps-async", "ps-ssp", "ps-dcasgd"), "--mode ps-async, ps-ssp or ps-dcasgd",
                   "choose one of those modes")
_SSP = Need("mode", lambda v: v == "ps-ssp", "--mode ps-ssp", "choose --mode ps-ssp")
_DCASGD = Need("mode", lambda v: v == "ps-dcasgd", "--mode ps-dcasgd", "choose --mode ps-dcasgd")
_DC_ADAPTIVE = Need("dc_adaptive", bool, "--dc-adaptive", "add --dc-adaptive")
_TRAINS = Need("task", lambda v: v != "consensus", "a task that trains", "choose one (consensus only mixes)")
_OWN_STEPS = Need("mode", lambda v: v in OWN_OPTIMIZER_MODES, "--mode gossip-sync, gossip-async or ps-avg",
                  "choose one of them")
_ADAMW = Need("optimizer", lambda v: v == "adamw", "--optimizer adamw", "add --optimizer adamw")
_DECAYS = Need("lr_schedule", lambda v: v in ("cosine", "linear"), "--lr-schedule cosine or linear",
               "add --lr-schedule cosine or linear")
# a user's own task gets every field of its TaskContext, and may read any of them
_CHARLM = Need("task", lambda v: v == "charlm" or v not in RECIPES, "--task charlm", "choose --task charlm")
_CONSENSUS = Need("task", lambda v: v == "consensus" or v not in RECIPES, "--task consensus", "choose --task consensus")

# The settings that only some runs read: field -> the conditions, all of which hold where it is read. A value
# other than the default (for an "auto" field: other than what auto gives) where one fails is refused, not
# ignored (``_check_unused``). Some of these have a check of their own that refuses them earlier, with more
# to say; launch/flags.py lists the flags that every run reads, so that each flag is in one of the two.
USED_ONLY_IN: dict[str, tuple[Need, ...]] = {
    "topology": (_GOSSIP,), "gossip_every": (_GOSSIP, _BY_STEPS), "schedule": (_GOSSIP,), "partners": (_GOSSIP,),
    "aggregate": (_THREE,), "byzantine": (_TWO,), "round_seconds": (_BY_TIME,), "rounds": (_BY_TIME,),
    "overlap": (_SYNC,), "compress": (_COMPRESSES,), "weight_by": (_SYNC,), "deadline": (_SYNC,),
    "deadline_k": (_ADAPTIVE,), "deadline_floor": (_ADAPTIVE,), "deadline_window": (_ADAPTIVE,),
    "straggler_fraction": (_ADAPTIVE,), "pace_tolerance": (_ADAPTIVE,),
    "consensus_step": (_COMPRESSED,), "trim_fraction": (_TRIMMED,), "byzantine_scale": (_BYZANTINE,),
    "async_rule": (_ASYNC,), "staleness_weight": (_ASYNC, _LATEST), "max_staleness": (_ASYNC, _LATEST),
    "staleness_temperature": (_ASYNC, _LATEST, _EXP), "rate_compensation": (_RATES,),
    "local_steps": (_PS_AVG,), "outer_optimizer": _OUTER_NEEDS, "outer_lr": _OUTER_NEEDS,
    "outer_momentum": _OUTER_NEEDS,
    "server_lr": (_SERVER_SGD,), "server_momentum": (_SERVER_SGD,), "soft_sync": (_ON_ARRIVAL,),
    "staleness_lr": (_ON_ARRIVAL,), "staleness_bound": (_SSP,), "dc_lambda": (_DCASGD,), "dc_adaptive": (_DCASGD,),
    "dc_momentum": (_DCASGD, _DC_ADAPTIVE), "dc_epsilon": (_DCASGD, _DC_ADAPTIVE),
    "missing_worker": (_PS,), "server_retries": (_PS,),
    "optimizer": (_TRAINS,), "lr": (_TRAINS,), "momentum": (_TRAINS,), "betas": (_TRAINS,),
    "second_moment": (_TRAINS, _OWN_STEPS, _ADAMW),
    "weight_decay": (_TRAINS,), "lr_schedule": (_TRAINS,), "warmup_steps": (_TRAINS,), "batch_size": (_TRAINS,),
    "min_lr": (_TRAINS, _DECAYS),
    "data": (_CHARLM,), "context": (_CHARLM,), "layers": (_CHARLM,), "model_dim": (_CHARLM,), "heads": (_CHARLM,),
    "dim": (_CONSENSUS,),
}


def _check_network(cfg: GossipConfig) -> None:
    """Peer r listens on BASE_PORT + r, the server on BASE_PORT + N, a rendezvous store on BASE_PORT - 1:
    all must be ports (1..65535); endpoints, when given, are one per peer."""
    network = cfg.network
    if cfg.world_size + 2 > 65535:
        raise ConfigError(f"--nodes {cfg.world_size} needs {cfg.world_size + 1} ports from --base-port on, more "
                          "than a host has (65535); use at most 65533 peers")
    check_int(network, "base_port", minimum=1)
    if network.base_port + cfg.world_size > 65535:
        raise ConfigError(f"--base-port {network.base_port} with --nodes {cfg.world_size}: the peers and the server "
                          f"would listen up to port {network.base_port + cfg.world_size}, beyond 65535; use "
                          f"--base-port at most {65535 - cfg.world_size}")
    if network.endpoints and len(network.endpoints) != cfg.world_size:
        raise ConfigError(f"{len(network.endpoints)} endpoints given for {cfg.world_size} peers; give one per peer")
    for endpoint in network.endpoints + ((network.server_endpoint,) if network.server_endpoint else ()):
        split_endpoint(endpoint)
    check_host(network.host, "--host")
    if network.bind:
        check_host(network.bind, "--bind")


def _check_unused(cfg: RunConfig) -> None:
    """Refuse a setting given where this run would not read it (``USED_ONLY_IN``), naming where it applies
    and the setting of this run that keeps it from applying."""
    for name, needs in USED_ONLY_IN.items():
        unmet = [need for need in needs if not need.holds(_value(cfg, need.setting))]
        if unmet and _given(cfg, name):
            where = needs[0].where + "".join(f" {'with' if i == 1 else 'and'} {n.where}" for i, n in enumerate(needs)
                                             if i)
            raise ConfigError(f"{flag_of(name)} applies to {where}, not {_described(cfg, unmet[0].setting)}; drop it "
                              f"or {' and '.join(need.fix for need in unmet)}")


# the gossip settings whose default the config resolves by the run's other settings: what auto gives
GRAPH_AUTO = {"topology": lambda gossip: gossip.topology_spec, "overlap": lambda gossip: gossip.overlaps}


def _owner(cfg: RunConfig, name: str) -> Any:
    """The part of ``cfg`` that holds field ``name``: the run itself, its coordinator part, or its gossip
    part or one of that part's sections."""
    if name in SECTION_OF:
        section = SECTION_OF[name]
        return getattr(cfg.gossip, section) if section else cfg.gossip
    return next(part for part in (cfg, cfg.coordinator) if name in part.__dataclass_fields__)


def _value(cfg: RunConfig, name: str) -> Any:
    return getattr(_owner(cfg, name), name)


def _given(cfg: RunConfig, name: str) -> bool:
    """Does field ``name`` differ from its default (an "auto" field: from what auto gives this run)?"""
    if name in AUTO_FIELDS:
        return _value(cfg, name) != recipe_values(cfg.task, cfg.optimizer, cfg.steps, cfg.lr)[name]
    if name in GRAPH_AUTO:  # (a configuration written before auto existed holds what auto gives)
        value = _value(cfg, name)
        auto = _default(type(_owner(cfg, name)), name)
        return value != auto and value != GRAPH_AUTO[name](cfg.gossip.replace(**{name: auto}))
    owner = _owner(cfg, name)
    return getattr(owner, name) != _default(type(owner), name)


def _described(cfg: RunConfig, name: str) -> str:
    """This run's setting ``name`` as its flag says it: "--mode ps-sync", or "a run without --dc-adaptive"."""
    value = _value(cfg, name)
    if value in (False, (), ""):
        return f"a run without {flag_of(name)}"
    return f"{flag_of(name)} {value}"


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def build_topology(spec: str, world_size: int) -> topologies.Topology:
    """``topologies.build`` with its errors translated into ours at the package boundary."""
    try:
        return topologies.build(spec, world_size)
    except topologies.ConfigError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from exc


def _check_compress(cfg: GossipConfig) -> None:
    compress, sync, robust = cfg.compression.compress, cfg.sync, cfg.robust
    if compress == "none" or cfg.mode == "ps-avg":  # (ps-avg: gossip/coordinator/pseudograd.py)
        return
    if cfg.mode != "gossip-sync":
        raise ConfigError(f"--compress {compress} applies to --mode gossip-sync (every compressed difference "
                          "must arrive, in its round) and ps-avg (each worker's change since the server's weights)")
    others = [flag for flag, on in (("--deadline adaptive", sync.deadline != "fixed"),
                                    ("--weight-by samples", sync.weight_by != "none"),
                                    (f"--aggregate {robust.aggregate}", robust.aggregate != "mean"),
                                    ("--byzantine", bool(robust.byzantine))) if on]
    if others:
        raise ConfigError(f"--compress {compress} cannot be combined with {others[0]}: compressed gossip mixes "
                          "the neighbours' public copies in lockstep rounds with the plain mean")
    topology = build_topology(cfg.topology_spec, cfg.world_size) if cfg.world_size > 1 else None
    if topology is not None and (topology.directed or topology.time_varying):
        raise ConfigError(f"--compress {compress} needs a fixed undirected topology (ring, torus, full, ...), "
                          f"not {topology.spec}: each neighbour keeps a copy of our public model, built from every "
                          "difference we ever sent it")


def _check_aggregate(cfg: GossipConfig) -> None:
    """Which rule applies where: the coordinate-wise ones wherever several models or gradients of one round
    or version are combined (the gossip modes, ps-sync, ps-avg), the norm bound wherever a server applies
    gradients (ps-sync and the asynchronous server modes, which apply one at a time)."""
    aggregate, byzantine = cfg.robust.aggregate, cfg.robust.byzantine
    robust = f"--aggregate {aggregate}"
    if aggregate in COORDINATE_WISE and cfg.mode in ("ps-async", "ps-ssp", "ps-dcasgd"):
        raise ConfigError(f"{robust} combines the contributions of one version coordinate-wise; --mode {cfg.mode} "
                          "applies each gradient on its own, which has no median: use --aggregate norm-clip (each "
                          "gradient bounded by the recent gradients' norms), or --mode ps-sync")
    if aggregate == "norm-clip" and cfg.mode not in NORM_BOUNDED:
        what = "its workers send weights" if cfg.mode == "ps-avg" else "the gossip modes mix models"
        raise ConfigError(f"--aggregate norm-clip bounds the gradients a parameter server applies, and {what}: use "
                          "--aggregate median or trimmed-mean")
    if aggregate != "mean" and (cfg.sync.weight_by != "none" or cfg.sync.deadline != "fixed"):
        raise ConfigError(f"{robust} cannot be combined with --weight-by samples or --deadline adaptive: their "
                          "push-sum masses assume a linear mean (mass carried between rounds), which a median breaks")
    if aggregate != "mean" and cfg.mode == "gossip-async" and cfg.asynchronous.async_rule == "push-sum":
        raise ConfigError(f"{robust} in gossip-async needs --async-rule latest (a median of the neighbours' latest "
                          "models; push-sum's masses assume a linear mean)")
    if aggregate != "mean" and cfg.asynchronous.staleness_weight != "none":
        raise ConfigError(f"{robust} counts each snapshot once, so --staleness-weight does not apply; use "
                          "--max-staleness to leave out old snapshots")
    if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < cfg.world_size for r in byzantine):
        raise ConfigError(f"--byzantine must list peer ranks in 0..{cfg.world_size - 1}, got "
                          f"{','.join(map(str, byzantine))}")


def _check_robust_degree(cfg: GossipConfig, topology: topologies.Topology) -> None:
    """A robust rule outvotes one bad input among 3 or more: every peer needs 2 in-neighbours in every round."""
    for round in range(16 if topology.time_varying else 1):  # time-varying graphs keep their degree
        for rank in range(cfg.world_size):
            if (degree := len(topology.in_neighbours(rank, round))) < 2:
                raise ConfigError(f"--aggregate {cfg.robust.aggregate} needs at least 2 neighbours per peer (3 "
                                  f"inputs, so that one can be outvoted); --topology {cfg.topology_spec} with "
                                  f"--nodes {cfg.world_size} gives peer {rank} {degree} in round {round}")
