"""The flags of ``gossip-launch`` and ``gossip-peer``: one table, and the parsing built from it.

Each ``Flag`` row is the only description of its option: its help text is what ``--help`` shows, under
its group's title. Defaults are not here: every flag's default and type come from the field of the same
name in ``gossip.config`` (the single home of defaults), except the few flags no config field holds
(``OWN_DEFAULTS``). A row's ``only`` names the one command that takes it; the others are both commands'.
Within a group, rows run from the most to the least used. The table stays in one piece so that every
option's help is read in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, NamedTuple, NoReturn

from gossip.config import (
    AUTO_FIELDS,
    DERIVED_FIELDS,
    GOSSIP_FIELDS,
    MODES,
    CoordinatorConfig,
    GossipConfig,
    RendezvousConfig,
    RunConfig,
    recipe_values,
)
from gossip.sections import AGGREGATES, COMPRESS, DEADLINES, PARTNERS, SCHEDULES, STALENESS_WEIGHTS, WEIGHT_BY
from launch.procs import START_METHODS

LAUNCH, PEER = "gossip-launch", "gossip-peer"
RUN, TRAINING, DATA = "run", "training", "data and model"
MIXING, HETEROGENEITY, ASYNC = "topology and mixing", "heterogeneity", "asynchronous"
SERVER, FAULTS, MACHINES, OUTPUT = "parameter server", "faults and security", "many machines", "output"
OUTER = "outer optimizer"
GROUPS = (RUN, TRAINING, DATA, MIXING, HETEROGENEITY, ASYNC, SERVER, OUTER, FAULTS, MACHINES,
          OUTPUT)  # in --help's order


class Flag(NamedTuple):
    flag: str
    name: str  # the config field it sets (the argparse dest)
    group: str
    help: str
    only: str = ""  # LAUNCH or PEER: a flag of that command alone


TABLE: list[Flag] = [
    Flag("--nodes", "nodes", RUN, "number of local peer processes", LAUNCH),
    Flag("--mode", "mode", RUN, "averaging mode: " + ", ".join(MODES)),
    Flag("--task", "task", RUN, "digits, digits-wide, mnist, charlm (a character-level transformer), consensus, or "
                                "package.module:function (see gossip.tasks)"),
    Flag("--steps", "steps", RUN, "training steps per peer (auto: digits 300, charlm 1000); the synchronous modes "
                                  "do exactly that many on every peer, the asynchronous ones (gossip-async, ps-async, "
                                  "ps-ssp, ps-dcasgd) stop together once the swarm did N x --steps in all, a fast "
                                  "peer more and a slow one fewer"),
    Flag("--out", "out", RUN, "output directory (default: runs/<date-time>)"),
    Flag("--seed", "seed", RUN, "seed of model init, shards, batches and random topologies"),
    Flag("--threads-per-peer", "threads_per_peer", RUN, "torch threads in each peer process"),
    Flag("--start-method", "start_method", RUN, "fork: peers forked from the launcher (fast start); exec: a fresh "
                                                "'python -m gossip.peer' per peer", LAUNCH),

    Flag("--optimizer", "optimizer", TRAINING, "each peer's optimizer, sgd or adamw (auto: digits sgd, charlm "
                                               "adamw); in ps-sync, ps-async, ps-ssp, ps-dcasgd the server's"),
    Flag("--lr", "lr", TRAINING, "peak learning rate of each peer's optimizer (auto: the task's, or sgd 0.05, adamw "
                                 "1e-3; ps-sync: the server's; the other gradient ps-* modes derive the server's "
                                 "from it, see --server-lr)"),
    Flag("--lr-schedule", "lr_schedule", TRAINING, "constant, cosine or linear decay to --min-lr over the run "
                                                   "(auto: digits constant, charlm cosine); each peer by its own "
                                                   "step, a parameter server by its version"),
    Flag("--warmup-steps", "warmup_steps", TRAINING, "steps of linear warm-up from 0 to --lr (auto: 5%% of --steps "
                                                     "for charlm, else 0)"),
    Flag("--min-lr", "min_lr", TRAINING, "learning rate at the end of a cosine or linear schedule (auto: --lr / 10 "
                                         "for charlm, else 0)"),
    Flag("--weight-decay", "weight_decay", TRAINING, "decoupled weight decay of AdamW (L2 for SGD), on matrices only "
                                                     "(auto: charlm 0.1, adamw 0.01, sgd 0)"),
    Flag("--momentum", "momentum", TRAINING, "SGD momentum of each peer's optimizer (ps-sync: the server's; see "
                                             "--server-momentum)"),
    Flag("--betas", "betas", TRAINING, "AdamW's beta1,beta2 (beta1 is its momentum; see --server-momentum)"),
    Flag("--second-moment", "second_moment", TRAINING, "AdamW's second moment where each peer steps its own "
                                                       "(gossip-sync, gossip-async, ps-avg): swarm (estimated for the "
                                                       "mean of the N peers' gradients, as ps-sync's AdamW sees them) "
                                                       "or own (PyTorch's AdamW); auto: swarm on gossip-sync's "
                                                       "exponential lockstep mix, where it was measured to pay; own "
                                                       "elsewhere"),
    Flag("--batch-size", "batch_size", TRAINING, "samples per local step (auto: digits 32, charlm 16 sequences)"),

    Flag("--partition", "partition", DATA, "which samples each peer trains on: iid (a seeded round-robin deal), "
                                           "dirichlet:ALPHA (digits, mnist: each class split by a Dirichlet(ALPHA) "
                                           "draw; 0.1 = a few classes per peer), by-file (charlm: each peer its own "
                                           "files)"),
    Flag("--data", "data", DATA, "charlm: a text file or folder to train on (default: the .py sources of this "
                                 "Python's standard library)"),
    Flag("--context", "context", DATA, "charlm: characters of context"),
    Flag("--layers", "layers", DATA, "charlm: transformer blocks"),
    Flag("--model-dim", "model_dim", DATA, "charlm: width of the model"),
    Flag("--heads", "heads", DATA, "charlm: attention heads (divides --model-dim)"),
    Flag("--dim", "dim", DATA, "vector length of the consensus task"),

    Flag("--topology", "topology", MIXING, "graph spec: auto, ring, torus[:RxC], random[:degree=D,seed=S], full, "
                                           "exponential, star (auto: exponential for gossip-sync's plain lockstep "
                                           "mix, SGP's one-peer graph; random with --partners similar-speed; the "
                                           "ring otherwise)"),
    Flag("--gossip-every", "gossip_every", MIXING, "local steps between two mixes (--schedule steps)"),
    Flag("--aggregate", "aggregate", MIXING, "how models or gradients are combined: " + ", ".join(AGGREGATES) +
                                             " (median, trimmed-mean: coordinate-wise over own and neighbours' "
                                             "models, or over a version's contributions in ps-sync and ps-avg, robust "
                                             "to one sending garbage; not with --weight-by samples or --deadline "
                                             "adaptive; norm-clip: each gradient's norm bounded by the recent ones', "
                                             "in ps-sync, ps-async, ps-ssp and ps-dcasgd)"),
    Flag("--trim-fraction", "trim_fraction", MIXING, "trimmed-mean: fraction of the values dropped from each end "
                                                     "(at least one each end of 3 or more)"),
    Flag("--overlap", "overlap", MIXING, "gossip-sync: exchange while the next local step computes, from a copy of "
                                         "the weights (taken only when a step writes them before the next mix); "
                                         "--no-overlap sends the weights themselves and mixes before training on "
                                         "(no copy per round, one model less memory)"),
    Flag("--compress", "compress", MIXING, "gossip-sync: send compressed differences from a public copy the "
                                           "neighbours hold (CHOCO-gossip, error feedback; with "
                                           "--outer-optimizer, each outer step's change); ps-avg: the workers' "
                                           "changes and the server's answers, with error feedback: "
                                           + ", ".join(COMPRESS) + "; 2x (float16) or about 4x (int8) fewer bytes, "
                                           "for slow links"),
    Flag("--consensus-step", "consensus_step", MIXING, "--compress: CHOCO's consensus step size gamma in (0, 1]"),
    Flag("--chunk-mb", "chunk_mb", MIXING, "payload frame size in MiB"),
    Flag("--queue-depth", "queue_depth", MIXING, "messages queued per neighbour before a sync send waits"),

    Flag("--speeds", "speeds", HETEROGENEITY, "comma-separated per-peer speeds, e.g. 1,1,1,0.25 (a peer at 0.25 is "
                                              "4x slower)"),
    Flag("--compute-ms", "compute_ms", HETEROGENEITY, "emulated accelerator time per step in ms, scaled by 1/speed"),
    Flag("--schedule", "schedule", HETEROGENEITY, "when to mix: " + " or ".join(SCHEDULES) + " (time: every "
                                                  "--round-seconds, fast peers do more local steps per round)"),
    Flag("--rounds", "rounds", HETEROGENEITY, "under --schedule time the run lasts this many rounds (required "
                                              "there)"),
    Flag("--round-seconds", "round_seconds", HETEROGENEITY, "length of a round under --schedule time"),
    Flag("--deadline", "deadline", HETEROGENEITY, "gossip-sync waiting: " + " or ".join(DEADLINES) + " (fixed: "
                                                  "every neighbour, up to --round-timeout; adaptive: learned per "
                                                  "neighbour, late messages mixed later)"),
    Flag("--weight-by", "weight_by", HETEROGENEITY, "gossip-sync push-sum mass: " + " or ".join(WEIGHT_BY)
                                                    + " (samples: proportional to the samples trained since the "
                                                      "last mix)"),
    Flag("--partners", "partners", HETEROGENEITY, "random topology partner choice: " + " or ".join(PARTNERS)
                                                  + " (similar-speed: mostly within --speeds classes)"),
    Flag("--link-mbit", "link_mbit", HETEROGENEITY, "per-peer link rate in Mbit/s, e.g. 0,0,0,100 (0: unlimited); "
                                                    "runs each peer in its own network namespace behind a tc tbf "
                                                    "qdisc; needs root, ip and tc"),
    Flag("--link-latency-ms", "link_latency_ms", HETEROGENEITY, "per-peer one-way latency in ms added to every "
                                                                "message to or from the peer (held back by the "
                                                                "sending transport)"),
    Flag("--deadline-k", "deadline_k", HETEROGENEITY, "adaptive deadline = median + K * MAD of a neighbour's "
                                                      "lateness"),
    Flag("--deadline-floor", "deadline_floor", HETEROGENEITY, "shortest adaptive deadline in seconds"),
    Flag("--deadline-window", "deadline_window", HETEROGENEITY, "rounds of lateness and misses remembered per "
                                                                "neighbour"),
    Flag("--pace-tolerance", "pace_tolerance", HETEROGENEITY, "adaptive: a neighbour whose rounds take (1 + this) "
                                                              "times as long as ours (its reported pace) is not "
                                                              "waited for"),
    Flag("--straggler-fraction", "straggler_fraction", HETEROGENEITY, "a neighbour missing more than this share of "
                                                                      "its recent deadlines is reported as a "
                                                                      "chronic straggler"),

    Flag("--async-rule", "async_rule", ASYNC, "gossip-async mixing: push-sum (default: every message mixed once, "
                                              "the network's weighted mean kept exactly, progress at the full "
                                              "learning rate) or latest (each neighbour's latest snapshot mixed at "
                                              "every step, renormalised, weighted by age with --staleness-weight; "
                                              "does not keep the mean)"),
    Flag("--rate-compensation", "rate_compensation", ASYNC, "gossip-async, ps-async, ps-ssp, ps-dcasgd: on (default) "
                                                            "counts a peer's steps (gossip) or gradients (server) "
                                                            "by rbar / r_i, its rate relative to the mean, so every "
                                                            "peer's data counts alike and the model minimises the "
                                                            "mean of the peers' objectives; off lets a peer twice "
                                                            "as fast count twice (rate-weighted)"),
    Flag("--staleness-weight", "staleness_weight", ASYNC, "--async-rule latest: weight f(tau) of a snapshot tau "
                                                          "own steps old: " + ", ".join(STALENESS_WEIGHTS)),
    Flag("--max-staleness", "max_staleness", ASYNC, "--async-rule latest ignores snapshots older than this many "
                                                    "own steps"),
    Flag("--staleness-temperature", "staleness_temperature", ASYNC, "T in f(tau) = exp(-tau/T), in steps"),

    Flag("--server", "server", SERVER, "be the parameter server of a ps-* run", PEER),
    Flag("--local-steps", "local_steps", SERVER, "ps-avg: local steps between two averagings"),
    Flag("--server-lr", "server_lr", SERVER, "learning rate of the parameter server's SGD; auto: --lr in ps-sync, "
                                             "and in ps-async/ps-ssp/ps-dcasgd --lr * (1 - server momentum) / ((1 - "
                                             "--momentum) * k), so that k gradients move the weights as far as one "
                                             "ps-sync update"),
    Flag("--server-momentum", "server_momentum", SERVER, "momentum of the parameter server's SGD; auto: --momentum "
                                                         "in ps-sync, and in ps-async/ps-ssp/ps-dcasgd, with k = "
                                                         "N/--soft-sync updates in flight, max(0, --momentum - (1 - "
                                                         "1/k)): asynchrony already acts as momentum 1 - 1/k "
                                                         "(Mitliagkas et al. 2016), and the two compounded diverge"),
    Flag("--soft-sync", "soft_sync", SERVER, "parameter server applies the mean once this many gradients arrived "
                                             "(1: each)"),
    Flag("--staleness-bound", "staleness_bound", SERVER, "ps-ssp: a worker this many steps ahead of the slowest "
                                                         "waits"),
    Flag("--staleness-lr", "staleness_lr", SERVER, "ps-async/ps-ssp/ps-dcasgd: learning rate / max(1, staleness)"),
    Flag("--dc-lambda", "dc_lambda", SERVER, "ps-dcasgd: lambda of the delay compensation (lambda0 with "
                                             "--dc-adaptive)"),
    Flag("--dc-adaptive", "dc_adaptive", SERVER, "ps-dcasgd: DC-ASGD-a, lambda / sqrt(mean square of g + epsilon)"),
    Flag("--dc-momentum", "dc_momentum", SERVER, "ps-dcasgd with --dc-adaptive: m of the mean square of g"),
    Flag("--dc-epsilon", "dc_epsilon", SERVER, "ps-dcasgd with --dc-adaptive: epsilon under the square root"),
    Flag("--missing-worker", "missing_worker", SERVER, "parameter server, a worker silent for --round-timeout: "
                                                       "fail, or continue without it"),
    Flag("--server-retries", "server_retries", SERVER, "a worker re-joins a silent parameter server this many "
                                                       "times"),

    Flag("--outer-optimizer", "outer_optimizer", OUTER, "how the change a mix makes is applied, delta = W - "
                                                        "mixed (ps-avg: the workers' mean; gossip-sync: each peer's mix "
                                                        "every --gossip-every steps, W its weights after its last "
                                                        "outer step): sgd (with the defaults, the mix itself) or "
                                                        "nesterov (DiLoCo, Douillard et al. 2023)"),
    Flag("--outer-lr", "outer_lr", OUTER, "the outer optimizer's lr (auto: sgd 1, nesterov 0.7)"),
    Flag("--outer-momentum", "outer_momentum", OUTER, "the outer optimizer's momentum (auto: sgd 0, nesterov 0.9)"),

    Flag("--peer-timeout", "peer_timeout", FAULTS, "seconds a neighbour may stay disconnected (or silent to ZeroMQ "
                                                   "heartbeats) before it is declared dead and gossip goes on "
                                                   "without it"),
    Flag("--round-timeout", "round_timeout", FAULTS, "seconds a sync peer waits for its neighbours in one round"),
    Flag("--checkpoint-every", "checkpoint_every", FAULTS, "steps between checkpoints (server: updates); 0 = none"),
    Flag("--max-restarts", "max_restarts", FAULTS, "restart a process that died, with --resume, up to this many "
                                                   "times each"),
    Flag("--keep-going", "keep_going", FAULTS, "a peer that died for good does not stop the others"),
    Flag("--allow-divergence", "allow_divergence", FAULTS, "exit 0 even when the run's model learned nothing (test "
                                                           "accuracy at chance, or loss no lower than untrained)",
         LAUNCH),
    Flag("--secure", "secure", FAULTS, "KEYDIR from gossip-keys: CurveZMQ encryption, only allow-listed keys "
                                       "admitted"),
    Flag("--byzantine", "byzantine", FAULTS, "fault injection for tests and benchmarks: comma-separated ranks that "
                                             "send random finite garbage instead of their weights (or gradients), e.g. 3"),
    Flag("--byzantine-scale", "byzantine_scale", FAULTS, "largest magnitude of the --byzantine garbage"),
    Flag("--startup-timeout", "startup_timeout", FAULTS, "seconds a peer waits for its first neighbours to start "
         "(gossip-async: for every peer)"),
    Flag("--send-timeout", "send_timeout", FAULTS, "seconds a message may wait for a slow or absent receiver"),
    Flag("--shutdown-timeout", "shutdown_timeout", FAULTS, "seconds to deliver the last messages on exit"),

    Flag("--hosts", "hosts", MACHINES, "run on several hosts, e.g. a:4,b:2 (ranks 0-3 on a, 4-5 on b; peer r on "
                                       "port BASE_PORT+r)"),
    Flag("--hostfile", "hostfile", MACHINES, "file with one host per line ('node01 slots=4' or 'node01:4'), "
                                             "instead of --hosts", LAUNCH),
    Flag("--world-size", "world_size", MACHINES, "number of peers (0: from torchrun, SLURM or MPI, else the first "
                                                 "peer's)", PEER),
    Flag("--initial-peers", "initial_peers", MACHINES, "tcp://HOST:PORT of the swarm's rendezvous store (the first "
                                                       "peer prints it)", PEER),
    Flag("--rank", "rank", MACHINES, "this peer's rank (-1: from torchrun, SLURM or MPI, else given out by the "
                                     "first peer)", PEER),
    Flag("--device", "device", MACHINES, "auto (GPU LOCAL_RANK mod GPUs when torch sees one, else the CPU), cpu, "
                                         "cuda or cuda:I"),
    Flag("--bind", "bind", MACHINES, "address the peers listen on, e.g. 0.0.0.0 (empty: the address they "
                                     "announce)"),
    Flag("--base-port", "base_port", MACHINES, "peer r listens on tcp://HOST:(BASE_PORT + r)"),
    Flag("--announce", "announce", MACHINES, "address other hosts reach this peer at (empty: the one that routes to "
                                             "the store)", PEER),
    Flag("--host", "host", MACHINES, "address the local peers listen on", LAUNCH),
    Flag("--rendezvous-port", "rendezvous_port", MACHINES, "port of the store the first peer (or SLURM rank 0) "
                                                           "serves; 0: BASE_PORT-1", PEER),
    Flag("--rendezvous-timeout", "rendezvous_timeout", MACHINES, "seconds to wait for every peer to check in", PEER),
    Flag("--remote-shell", "remote_shell", MACHINES, "command that runs a command on another host: SHELL HOST "
                                                     "COMMAND", LAUNCH),
    Flag("--remote-python", "remote_python", MACHINES, "python on the other hosts (empty: this interpreter's path)",
         LAUNCH),
    Flag("--ipc", "ipc", MACHINES, "peers announced on a loopback address exchange over a Unix socket, not TCP "
                                   "loopback (less CPU per byte); --no-ipc keeps TCP"),

    Flag("--progress", "progress", OUTPUT, "live table on a terminal, periodic lines otherwise", LAUNCH),
    Flag("--plot", "plot", OUTPUT, "write summary.png (matplotlib adds about 2 s)", LAUNCH),
    Flag("--eval-every", "eval_every", OUTPUT, "steps between test evaluations (0: at the end only)"),
    Flag("--log-every", "log_every", OUTPUT, "steps between step events in peer-<rank>.jsonl"),
]
FLAGS = [row for row in TABLE if row.only != PEER]  # gossip-launch's
PEER_FLAGS = [row for row in TABLE if row.only == PEER]  # gossip-peer's own; see gossip.rendezvous
SHARED_FLAGS = [row for row in TABLE if not row.only]  # both commands': the run flags a peer is started with
PEER_COMMAND_FLAGS = [row for row in TABLE if row.only != LAUNCH]  # gossip-peer's
LAUNCHER_ONLY = frozenset(row.name for row in TABLE if row.only == LAUNCH)

RUN_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
COORDINATOR_FIELDS = {f.name: f for f in dataclasses.fields(CoordinatorConfig)}
RENDEZVOUS_FIELDS = {f.name: f for f in dataclasses.fields(RendezvousConfig)}
# which dataclass owns a flag's field: the first that has it (``rank``: the rendezvous's, not GossipConfig's)
OWNERS = (RUN_FIELDS, RENDEZVOUS_FIELDS, GOSSIP_FIELDS, COORDINATOR_FIELDS)
# the flags no config field holds (how the launcher shows a run and starts its peers, a peer's role)
OWN_DEFAULTS: dict[str, Any] = {"start_method": START_METHODS[0], "progress": "auto", "plot": True, "server": False}
CHOICES = {"start_method": START_METHODS, "progress": ("auto", "live", "plain", "off")}
SWITCHES = frozenset({"server"})  # given or not, no --no- form
# The flags that belong to no one mode or task (what to run, where and how its processes run and wait, what
# they write); every other flag is read only where gossip.config.USED_ONLY_IN says, and refused elsewhere.
# ``--steps`` is read under --schedule time too: it sizes an auto --warmup-steps.
READ_BY_EVERY_RUN = frozenset({
    "nodes", "mode", "task", "steps", "out", "seed", "threads_per_peer", "start_method", "partition", "speeds",
    "compute_ms", "link_mbit", "link_latency_ms", "chunk_mb", "queue_depth", "peer_timeout", "round_timeout",
    "startup_timeout", "send_timeout", "shutdown_timeout", "checkpoint_every", "max_restarts", "keep_going",
    "allow_divergence", "secure", "server", "hosts", "hostfile", "world_size", "initial_peers", "rank", "device",
    "bind", "base_port", "announce", "host", "rendezvous_port", "rendezvous_timeout", "remote_shell",
    "remote_python", "ipc", "progress", "plot", "eval_every", "log_every"})


class FlagParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line that points at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 1,1,0.25")


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 3 or 0,5")


# on/off flags whose default (None) the config resolves, and how that default is shown
AUTO_SWITCHES = {"overlap": "auto: off on the exponential graph, else on"}
# list-valued flags: how an empty default is shown, and how the flag is parsed
PER_PEER_DEFAULTS = {"speeds": "all 1", "link_mbit": "none", "link_latency_ms": "none", "byzantine": "none"}
LIST_PARSERS = {**{name: parse_floats for name in PER_PEER_DEFAULTS}, "byzantine": parse_ints,
                "initial_peers": parse_list, "betas": parse_floats}


def default_of(name: str) -> Any:
    if name in OWN_DEFAULTS:
        return OWN_DEFAULTS[name]
    field = next(fields[name] for fields in OWNERS if name in fields)
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def add_flags(parser: argparse.ArgumentParser, table: list[Flag]) -> None:
    """One argparse option per table row, typed and defaulted by its dataclass field, under its group's title."""
    groups = {title: parser.add_argument_group(title) for title in GROUPS if any(r.group == title for r in table)}
    for flag, name, group, help_text, _ in sorted(table, key=lambda row: GROUPS.index(row.group)):
        add = groups[group].add_argument
        default = default_of(name)
        if name in SWITCHES:
            add(flag, dest=name, action="store_true", help=help_text)
            continue
        shown = (",".join(map(str, default)) or PER_PEER_DEFAULTS.get(name, "none")) if isinstance(default, tuple) \
            else AUTO_SWITCHES.get(name, default)
        help_text = f"{help_text} (default: {shown!s})" if name != "out" else help_text
        if isinstance(default, bool) or name in AUTO_SWITCHES:
            add(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif name in CHOICES:
            add(flag, dest=name, choices=CHOICES[name], default=default, help=help_text)
        else:
            kind = LIST_PARSERS.get(name, type(default))
            add(flag, dest=name, type=kind, default=default, metavar=name.upper(), help=help_text)


def owned_values(args: argparse.Namespace, fields: dict[str, Any]) -> dict[str, Any]:
    """The parsed values of the flags whose field belongs to ``fields``'s dataclass."""
    owner = {name: next(f for f in OWNERS if name in f) for name in vars(args) if any(name in f for f in OWNERS)}
    return {name: value for name, value in vars(args).items() if owner.get(name) is fields}


def config_from_args(args: argparse.Namespace, nodes: int | None = None) -> RunConfig:
    """The run the flags describe, for ``nodes`` peers (default: ``--nodes``)."""
    run_values = owned_values(args, RUN_FIELDS)
    run_values["nodes"] = nodes or run_values.get("nodes", default_of("nodes"))
    if not run_values["out"]:
        run_values["out"] = time.strftime("runs/%Y%m%d-%H%M%S")
    # Partner classes come from the emulated speeds, which every peer reads from the same config.json
    # (a list of the wrong length is left for RunConfig to report, in the words of --speeds).
    speeds = run_values["speeds"] if len(run_values["speeds"]) == run_values["nodes"] else ()
    gossip = GossipConfig.of(world_size=run_values["nodes"], peer_speeds=speeds, **owned_values(args, GOSSIP_FIELDS))
    coordinator = CoordinatorConfig(**owned_values(args, COORDINATOR_FIELDS))
    return RunConfig(**run_values, gossip=gossip, coordinator=coordinator)


def rendezvous_from_args(args: argparse.Namespace) -> RendezvousConfig:
    return RendezvousConfig(**owned_values(args, RENDEZVOUS_FIELDS))


def flag_argv(values: dict[str, Any], table: list[Flag]) -> list[str]:
    """Flags that reproduce ``values`` (field name -> value), leaving out those at their default."""
    argv = []
    for row in table:
        if row.name not in values or values[row.name] == default_of(row.name):
            continue
        if row.name in AUTO_FIELDS and values[row.name] == auto_value(row.name, values):
            continue
        value = values[row.name]
        if isinstance(value, bool):
            argv.append(row.flag if value else f"--no-{row.flag[2:]}")
        else:
            argv += [row.flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return argv


def auto_value(name: str, values: dict[str, Any]) -> Any:
    """What "auto" gives field ``name`` of a run with these ``values`` (its task, optimizer, steps and lr)."""
    return recipe_values(values.get("task", "digits"), values.get("optimizer", "auto"), values.get("steps"),
                         values.get("lr"))[name]


def field_values(cfg: RunConfig, rendezvous: RendezvousConfig | None = None) -> dict[str, Any]:
    """Every flag's field name -> its value in ``cfg`` (and ``rendezvous``)."""
    values = {**dataclasses.asdict(cfg.coordinator), **cfg.gossip.flat(),
              **(dataclasses.asdict(rendezvous) if rendezvous else {})}
    values.update({f: getattr(cfg, f) for f in RUN_FIELDS if f not in ("gossip", "coordinator")})
    for name in DERIVED_FIELDS:  # not flags: computed from them by RunConfig
        values.pop(name, None)
    for name in ("endpoints", "speeds", "initial_peers", "link_mbit", "link_latency_ms", "peer_speeds", "byzantine",
                 "betas"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    return values
