"""A 27 MB model over a 100 Mbit/s link: time to target accuracy of gossip, compressed gossip and DDP.

    python bench/slowlink.py                              # as root: it makes two network namespaces
    python bench/slowlink.py --rows gossip-sync,ddp --steps 30   # a quick look at two of the rows

What it measures: how training is slowed when every exchange must cross a slow link, and how much sending
fewer bytes per exchange (``--compress``) wins back. Two hosts (Linux network namespaces) are joined by a
veth link limited to ``--rate`` in each direction (``tests/netns.py``, ``tc tbf``), as in
``bench/multihost.py``, whose functions it uses. The task is ``digits-wide``: the digits data, shards,
batches and optimizer, with an MLP 64-2560-2560-10 of 6.7 M float32 parameters (27 MB), so that one model
takes about 2.2 s to cross the link while a step computes in about 20 ms: the link, not the compute, sets
the pace. One peer (or DDP rank) runs on each host (``--per-host``), so with two peers the ring is one edge
and every exchange crosses the link.

The rows (``--rows``, a comma list of their short names; all by default), run one after the other in one
invocation, every mode at its defaults except ``--compress``:

- ``gossip-sync``: ``python -m launch --hosts A:1,B:1 --remote-shell SHELL --mode gossip-sync``, the
  weights sent as float32;
- ``gossip-sync-float16``: the same with ``--compress float16`` (CHOCO-SGD compressed gossip, half the
  bytes per exchange);
- ``gossip-sync-int8``: the same with ``--compress int8`` (a quarter of the bytes);
- ``ddp``, shown as ``DDP (gloo)``: ``bench/ddp.py --task digits-wide``, one rank started in each namespace,
  gloo all-reducing the float32 gradients over the link.

Every row trains the same initial model on the same shards with the same learning rate, momentum, batch
size, seed and emulated accelerator step (``--compute-ms``) for ``--steps`` steps. For each row: the time
from the first peer's ``ready`` event until the mean over peers of their latest test accuracies (every
``--eval-every`` own steps; DDP: rank 0's, whose model every rank shares) first reaches ``--target``; the
final test accuracy (mean over peers); the run's wall time; and the bytes that left both ends of the
limited link during the row (payload, headers and TCP/IP overhead). The link is first measured with one TCP
stream. With the defaults the whole benchmark takes about 13 minutes. Results: ``--out`` (default
``bench/results/slowlink``), one directory per row (the peers' event logs) and ``results.json``; the
markdown table is printed at the end. A row that fails is shown as failed and the others still run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from multihost import Rows, benchmark, run_ddp, run_gossip  # (bench/, the script's directory)

from tests import netns

TASK = "digits-wide"
# short name (--rows, the row's directory) -> (the name the table shows, the launcher's extra flags; None: DDP)
ROWS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "gossip-sync": ("gossip-sync", ()),
    "gossip-sync-float16": ("gossip-sync --compress float16", ("--compress", "float16")),
    "gossip-sync-int8": ("gossip-sync --compress int8", ("--compress", "int8")),
    "ddp": ("DDP (gloo)", None),
}


def rows(names: list[str], args: argparse.Namespace) -> Rows:
    """The rows named (short names), in the order given, for ``multihost.benchmark``."""
    def runner(hosts: netns.TwoHosts, extra: tuple[str, ...] | None) -> Callable[[Path], None]:
        if extra is None:
            return lambda out: run_ddp(hosts, out, args, args.per_host, TASK)
        return lambda out: run_gossip(hosts, out, "gossip-sync", args, args.per_host, TASK, extra)

    return lambda hosts: {ROWS[name][0]: (name, runner(hosts, ROWS[name][1])) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows to run, of: {', '.join(ROWS)}")
    parser.add_argument("--steps", type=int, default=100, help="local steps per peer (and DDP steps)")
    parser.add_argument("--per-host", type=int, default=1, help="peers (DDP ranks) on each of the two hosts")
    parser.add_argument("--compute-ms", type=float, default=10.0, help="emulated accelerator time per step")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", default="100mbit", help="the link's rate, as tc writes it")
    parser.add_argument("--target", type=float, default=0.92, help="test accuracy whose time is measured")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "slowlink")
    args = parser.parse_args()
    names = [name.strip() for name in args.rows.split(",") if name.strip()]
    if not names or any(name not in ROWS for name in names) or len(set(names)) < len(names):
        parser.error(f"--rows {args.rows!r}: use a comma list of distinct rows of: {', '.join(ROWS)}")
    if args.per_host < 1:
        parser.error("--per-host must be at least 1")
    benchmark(parser, args, rows(names, args), peers=2 * args.per_host)


if __name__ == "__main__":
    main()
