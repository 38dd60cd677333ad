"""``python -m launch`` / ``gossip-launch``: parse the flags, run the peers, print the summary.

Every flag's default comes from ``gossip.config`` (the single home of defaults). A bad flag ends in
one line on stderr that says what is wrong and how to fix it, and exit status 2. ``FLAGS`` are the
launcher's; a peer started on its own (``gossip-peer``, ``launch/peer.py``) takes the same flags except
``LAUNCHER_ONLY``, plus ``PEER_FLAGS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from gossip.config import (AGGREGATES, DEADLINES, DERIVED_FIELDS, MODES, PARTNERS, SCHEDULES, STALENESS_WEIGHTS,
                           WEIGHT_BY, CoordinatorConfig, GossipConfig, RendezvousConfig, RunConfig)
from gossip.errors import ConfigError, TaskError
from launch.procs import START_METHODS

PROG = "gossip-launch"
RUN_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
GOSSIP_FIELDS = {f.name: f for f in dataclasses.fields(GossipConfig)}
COORDINATOR_FIELDS = {f.name: f for f in dataclasses.fields(CoordinatorConfig)}
RENDEZVOUS_FIELDS = {f.name: f for f in dataclasses.fields(RendezvousConfig)}
# which dataclass owns a flag's field: the first that has it (``rank``: the rendezvous's, not GossipConfig's)
OWNERS = (RUN_FIELDS, RENDEZVOUS_FIELDS, GOSSIP_FIELDS, COORDINATOR_FIELDS)

# (flag, field, help); the owning dataclass is found by field name, the type from the default.
FLAGS: list[tuple[str, str, str]] = [
    ("--nodes", "nodes", "number of local peer processes"),
    ("--topology", "topology", "graph spec: ring, torus[:RxC], random[:degree=D,seed=S], full, exponential, star"),
    ("--mode", "mode", "averaging mode: " + ", ".join(MODES)),
    ("--task", "task", "digits, consensus, or package.module:function (see gossip.tasks)"),
    ("--steps", "steps", "local training steps per peer"),
    ("--out", "out", "output directory (default: runs/<date-time>)"),
    ("--seed", "seed", "seed of model init, shards, batches and random topologies"),
    ("--base-port", "base_port", "peer r listens on tcp://HOST:(BASE_PORT + r)"),
    ("--host", "host", "address the local peers listen on"),
    ("--ipc", "ipc", "peers announced on a loopback address exchange over a Unix socket, not TCP loopback "
                     "(less CPU per byte); --no-ipc keeps TCP"),
    ("--gossip-every", "gossip_every", "local steps between two mixes (--schedule steps)"),
    ("--schedule", "schedule", "when to mix: " + " or ".join(SCHEDULES) + " (time: every --round-seconds, fast "
                               "peers do more local steps per round)"),
    ("--round-seconds", "round_seconds", "length of a round under --schedule time"),
    ("--rounds", "rounds", "under --schedule time the run lasts this many rounds (required there)"),
    ("--weight-by", "weight_by", "gossip-sync push-sum mass: " + " or ".join(WEIGHT_BY)
                                 + " (samples: proportional to the samples trained since the last mix)"),
    ("--deadline", "deadline", "gossip-sync waiting: " + " or ".join(DEADLINES) + " (fixed: every neighbour, up "
                               "to --round-timeout; adaptive: learned per neighbour, late messages mixed later)"),
    ("--overlap", "overlap", "gossip-sync: exchange while the next local step computes, from a copy of the "
                             "weights; --no-overlap sends the weights themselves and mixes before training on "
                             "(no copy per round, one model less memory)"),
    ("--deadline-k", "deadline_k", "adaptive deadline = median + K * MAD of a neighbour's lateness"),
    ("--deadline-floor", "deadline_floor", "shortest adaptive deadline in seconds"),
    ("--deadline-window", "deadline_window", "rounds of lateness and misses remembered per neighbour"),
    ("--pace-tolerance", "pace_tolerance", "adaptive: a neighbour whose rounds take (1 + this) times as long as "
                                           "ours (its reported pace) is not waited for"),
    ("--straggler-fraction", "straggler_fraction", "a neighbour missing more than this share of its recent "
                                                   "deadlines is reported as a chronic straggler"),
    ("--partners", "partners", "random topology partner choice: " + " or ".join(PARTNERS)
                               + " (similar-speed: mostly within --speeds classes)"),
    ("--async-rule", "async_rule", "gossip-async mixing: push-sum (default: every message mixed once, the "
                                   "network's weighted mean kept exactly, progress at the full learning rate) or "
                                   "latest (each neighbour's latest snapshot mixed at every step, renormalised, "
                                   "weighted by age with --staleness-weight; does not keep the mean)"),
    ("--staleness-weight", "staleness_weight", "--async-rule latest: weight f(tau) of a snapshot tau own steps "
                                               "old: " + ", ".join(STALENESS_WEIGHTS)),
    ("--staleness-temperature", "staleness_temperature", "T in f(tau) = exp(-tau/T), in steps"),
    ("--max-staleness", "max_staleness", "--async-rule latest ignores snapshots older than this many own steps"),
    ("--aggregate", "aggregate", "gossip mixing rule: " + ", ".join(AGGREGATES) + " (median, trimmed-mean: "
                                 "coordinate-wise over own and neighbours' models, robust to a neighbour sending "
                                 "garbage; not with --weight-by samples or --deadline adaptive)"),
    ("--trim-fraction", "trim_fraction", "trimmed-mean: fraction of the values dropped from each end (at least "
                                         "one each end of 3 or more)"),
    ("--byzantine", "byzantine", "fault injection for tests and benchmarks: comma-separated ranks that send "
                                 "random finite garbage instead of their weights, e.g. 3"),
    ("--byzantine-scale", "byzantine_scale", "largest magnitude of the --byzantine garbage"),
    ("--speeds", "speeds", "comma-separated per-peer speeds, e.g. 1,1,1,0.25 (a peer at 0.25 is 4x slower)"),
    ("--compute-ms", "compute_ms", "emulated accelerator time per step in ms, scaled by 1/speed"),
    ("--link-mbit", "link_mbit", "per-peer link rate in Mbit/s, e.g. 0,0,0,100 (0: unlimited); runs each peer in "
                                 "its own network namespace behind a tc tbf qdisc; needs root, ip and tc"),
    ("--link-latency-ms", "link_latency_ms", "per-peer one-way latency in ms added to every message to or from "
                                             "the peer (held back by the sending transport)"),
    ("--threads-per-peer", "threads_per_peer", "torch threads in each peer process"),
    ("--lr", "lr", "learning rate of each peer's optimizer (ps-sync: the server's; the other ps-* modes derive "
                   "the server's from it, see --server-lr)"),
    ("--momentum", "momentum", "SGD momentum of each peer's optimizer (ps-sync: the server's; see "
                               "--server-momentum)"),
    ("--batch-size", "batch_size", "samples per local step"),
    ("--dim", "dim", "vector length of the consensus task"),
    ("--eval-every", "eval_every", "steps between test evaluations (0: at the end only)"),
    ("--log-every", "log_every", "steps between step events in peer-<rank>.jsonl"),
    ("--chunk-mb", "chunk_mb", "payload frame size in MiB"),
    ("--queue-depth", "queue_depth", "messages queued per neighbour before a sync send waits"),
    ("--round-timeout", "round_timeout", "seconds a sync peer waits for its neighbours in one round"),
    ("--peer-timeout", "peer_timeout", "seconds a neighbour may stay disconnected (or silent to ZeroMQ "
                                       "heartbeats) before it is declared dead and gossip goes on without it"),
    ("--startup-timeout", "startup_timeout", "seconds a peer waits for its first neighbours to start"),
    ("--send-timeout", "send_timeout", "seconds a message may wait for a slow or absent receiver"),
    ("--shutdown-timeout", "shutdown_timeout", "seconds to deliver the last messages on exit"),
    ("--secure", "secure", "KEYDIR from gossip-keys: CurveZMQ encryption, only allow-listed keys admitted"),
    ("--local-steps", "local_steps", "ps-avg: local steps between two averagings"),
    ("--staleness-lr", "staleness_lr", "ps-async/ps-ssp/ps-dcasgd: learning rate / max(1, staleness)"),
    ("--soft-sync", "soft_sync", "parameter server applies the mean once this many gradients arrived (1: each)"),
    ("--server-momentum", "server_momentum", "momentum of the parameter server's SGD; auto: --momentum in ps-sync, "
                                             "and in ps-async/ps-ssp/ps-dcasgd, with k = N/--soft-sync updates in "
                                             "flight, max(0, --momentum - (1 - 1/k)): asynchrony already acts as "
                                             "momentum 1 - 1/k (Mitliagkas et al. 2016), and the two compounded "
                                             "diverge"),
    ("--server-lr", "server_lr", "learning rate of the parameter server's SGD; auto: --lr in ps-sync, and in "
                                 "ps-async/ps-ssp/ps-dcasgd --lr * (1 - server momentum) / ((1 - --momentum) * k), "
                                 "so that k gradients move the weights as far as one ps-sync update"),
    ("--staleness-bound", "staleness_bound", "ps-ssp: a worker this many steps ahead of the slowest waits"),
    ("--dc-lambda", "dc_lambda", "ps-dcasgd: lambda of the delay compensation (lambda0 with --dc-adaptive)"),
    ("--dc-adaptive", "dc_adaptive", "ps-dcasgd: DC-ASGD-a, lambda / sqrt(mean square of g + epsilon)"),
    ("--dc-momentum", "dc_momentum", "ps-dcasgd with --dc-adaptive: m of the mean square of g"),
    ("--dc-epsilon", "dc_epsilon", "ps-dcasgd with --dc-adaptive: epsilon under the square root"),
    ("--missing-worker", "missing_worker", "parameter server, a worker silent for --round-timeout: fail, or "
                                           "continue without it"),
    ("--server-retries", "server_retries", "a worker re-joins a silent parameter server this many times"),
    ("--checkpoint-every", "checkpoint_every", "steps between checkpoints (server: updates); 0 = none"),
    ("--max-restarts", "max_restarts", "restart a process that died, with --resume, up to this many times each"),
    ("--keep-going", "keep_going", "a peer that died for good does not stop the others"),
    ("--device", "device", "auto (GPU LOCAL_RANK mod GPUs when torch sees one, else the CPU), cpu, cuda or cuda:I"),
    ("--bind", "bind", "address the peers listen on, e.g. 0.0.0.0 (empty: the address they announce)"),
    ("--hosts", "hosts", "run on several hosts, e.g. a:4,b:2 (ranks 0-3 on a, 4-5 on b; peer r on port BASE_PORT+r)"),
    ("--hostfile", "hostfile", "file with one host per line ('node01 slots=4' or 'node01:4'), instead of --hosts"),
    ("--remote-shell", "remote_shell", "command that runs a command on another host: SHELL HOST COMMAND"),
    ("--remote-python", "remote_python", "python on the other hosts (empty: this interpreter's path)"),
]
# flags of a peer started on its own; see gossip.rendezvous for what each overrides
PEER_FLAGS: list[tuple[str, str, str]] = [
    ("--rank", "rank", "this peer's rank (-1: from torchrun, SLURM or MPI, else given out by the first peer)"),
    ("--world-size", "world_size", "number of peers (0: from torchrun, SLURM or MPI, else the first peer's)"),
    ("--announce", "announce", "address other hosts reach this peer at (empty: the one that routes to the store)"),
    ("--initial-peers", "initial_peers", "tcp://HOST:PORT of the swarm's rendezvous store (the first peer prints it)"),
    ("--rendezvous-port", "rendezvous_port", "port of the store the first peer (or SLURM rank 0) serves; 0: BASE_PORT-1"),
    ("--rendezvous-timeout", "rendezvous_timeout", "seconds to wait for every peer to check in"),
]
LAUNCHER_ONLY = frozenset({"nodes", "host", "hostfile", "remote_shell", "remote_python"})


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parse_floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 1,1,0.25")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 3 or 0,5")


# list-valued flags: how an empty default is shown, and how the flag is parsed
PER_PEER_DEFAULTS = {"speeds": "all 1", "link_mbit": "none", "link_latency_ms": "none", "byzantine": "none"}
LIST_PARSERS = {**{name: _parse_floats for name in PER_PEER_DEFAULTS}, "byzantine": _parse_ints,
                "initial_peers": _parse_list}


def default_of(name: str) -> Any:
    field = next(fields[name] for fields in OWNERS if name in fields)
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def add_flags(parser: argparse.ArgumentParser, table: list[tuple[str, str, str]]) -> None:
    """One argparse option per table row, typed and defaulted by its dataclass field."""
    for flag, name, help_text in table:
        default = default_of(name)
        shown = (",".join(map(str, default)) or PER_PEER_DEFAULTS[name]) if name in PER_PEER_DEFAULTS else default
        help_text = f"{help_text} (default: {shown!s})" if name != "out" else help_text
        if isinstance(default, bool):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        kind = LIST_PARSERS.get(name, type(default))
        parser.add_argument(flag, dest=name, type=kind, default=default, metavar=name.upper(), help=help_text)


MODES_EPILOG = """modes (each trains digits as well as ps-sync at its defaults, within 1.5 points; BENCHMARKS.md):
  gossip-sync   D-PSGD as push-sum: each round waits for the in-neighbours (or, --deadline adaptive, at most
                their learned deadline); peers move in lockstep with the slowest neighbour
  gossip-async  asynchronous push-sum: never waits, each message mixed once, the weighted mean kept exactly
                and every step counted 1/N; copies agree less closely than in lockstep
                (--async-rule latest: the older rule, staleness weighting, does not keep the mean)
  ps-sync       a server applies the mean of all N gradients per step: one machine at batch N*b, paced by
                the slowest worker
  ps-avg        workers take --local-steps steps, the server averages their weights
  ps-async      the server applies each gradient on arrival; its lr and momentum are derived from --lr and
                --momentum for the updates in flight (--server-lr, --server-momentum: auto)
  ps-ssp        ps-async, but no worker runs more than --staleness-bound steps ahead of the slowest
  ps-dcasgd     ps-async with DC-ASGD's delay compensation of stale gradients"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Start N local peers (or peers on several hosts, --hosts) that train "
                     "one model\ntogether by gossip averaging over ZeroMQ, show their progress and summarise the run.",
                     epilog=MODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, FLAGS)
    parser.add_argument("--progress", choices=("auto", "live", "plain", "off"), default="auto",
                        help="live table on a terminal, periodic lines otherwise (default: auto)")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                        help="write summary.png (matplotlib adds about 2 s) (default: True)")
    parser.add_argument("--start-method", choices=START_METHODS, default=START_METHODS[0],
                        help="fork: peers forked from the launcher (fast start); exec: a fresh "
                             f"'python -m gossip.peer' per peer (default: {START_METHODS[0]})")
    return parser


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
    gossip = GossipConfig(world_size=run_values["nodes"], peer_speeds=speeds, **owned_values(args, GOSSIP_FIELDS))
    return RunConfig(**run_values, gossip=gossip, coordinator=CoordinatorConfig(**owned_values(args, COORDINATOR_FIELDS)))


def rendezvous_from_args(args: argparse.Namespace) -> RendezvousConfig:
    return RendezvousConfig(**owned_values(args, RENDEZVOUS_FIELDS))


def flag_argv(values: dict[str, Any], table: list[tuple[str, str, str]]) -> list[str]:
    """Flags that reproduce ``values`` (field name -> value), leaving out those at their default."""
    argv = []
    for flag, name, _ in table:
        if name not in values or values[name] == default_of(name):
            continue
        value = values[name]
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return argv


def field_values(cfg: RunConfig, rendezvous: RendezvousConfig | None = None) -> dict[str, Any]:
    """Every flag's field name -> its value in ``cfg`` (and ``rendezvous``)."""
    values = {**dataclasses.asdict(cfg.coordinator), **dataclasses.asdict(cfg.gossip),
              **(dataclasses.asdict(rendezvous) if rendezvous else {})}
    values.update({f: getattr(cfg, f) for f in RUN_FIELDS if f not in ("gossip", "coordinator")})
    for name in DERIVED_FIELDS:  # not flags: computed from them by RunConfig
        values.pop(name, None)
    for name in ("endpoints", "speeds", "initial_peers", "link_mbit", "link_latency_ms", "peer_speeds", "byzantine"):
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rendezvous = rendezvous_from_args(args)
        if rendezvous.hosts or rendezvous.hostfile:
            from launch.hosts import run_hosts  # imports torch; keep --help and flag errors fast

            nodes_given = any(a == "--nodes" or a.startswith("--nodes=") for a in (argv or sys.argv[1:]))
            return run_hosts(args, rendezvous, nodes_given, progress=args.progress, start_method=args.start_method,
                             plot=args.plot)
        cfg = config_from_args(args)
        from launch.local import run_local  # imports torch; keep --help and flag errors fast

        return run_local(cfg, progress=args.progress, start_method=args.start_method, plot=args.plot)
    except (ConfigError, TaskError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def entry_point() -> Any:
    sys.exit(main())
