"""``python -m launch`` / ``gossip-launch``: parse the flags, run the peers, print the summary.

The flags, their groups and their help are one table in ``launch/flags.py``, shared with ``gossip-peer``
(``launch/peer.py``); every flag's default comes from ``gossip.config`` (the single home of defaults). A
bad flag ends in one line on stderr that says what is wrong and how to fix it, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from gossip.errors import ConfigError, TaskError
from gossip.exit import exit_now
from launch.flags import FLAGS, FlagParser, add_flags, config_from_args, rendezvous_from_args

PROG = "gossip-launch"

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
    parser = FlagParser(prog=PROG, description="Start N local peers (or peers on several hosts, --hosts) that train "
                        "one model\ntogether by gossip averaging over ZeroMQ, show their progress and summarise the "
                        "run.", epilog=MODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, FLAGS)
    return parser


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
    exit_now(main())
