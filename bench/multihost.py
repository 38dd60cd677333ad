"""Two hosts joined by a 100 Mbit/s link: time to 0.95 test accuracy for 4 peers, gossip against DDP.

    python bench/multihost.py                          # as root: it makes two network namespaces
    python bench/multihost.py --steps 300 --rate 10mbit  # a quick look, or another link

The two hosts are Linux network namespaces joined by a veth link limited to ``--rate`` in each direction
by a token bucket (``tests/netns.py``; ``tc tbf``, as this kernel has no ``netem``), so every byte between
the hosts goes through the kernel's TCP over a real slow link. Two peers run on each host (ranks 0-1 on
host a, 2-3 on host b). The rows, run one after the other in one invocation:

- ``gossip-sync`` and ``gossip-async``: ``python -m launch --hosts A:2,B:2 --remote-shell SHELL``, where
  SHELL runs a command in the namespace that owns an address, as ssh would on another machine; ring
  topology, so two of the four ring edges cross the link.
- ``DDP (gloo)``: ``bench/ddp.py``, one process per rank started in its namespace, gloo bound to the
  link's interface (``GLOO_SOCKET_IFNAME``), rank 0's address as the rendezvous.

Every row trains the digits MLP on the same shards, with the same learning rate, momentum, batch size,
seed and emulated accelerator step (``--compute-ms``). Time starts at the first peer's ``ready`` event;
accuracy at time t is the mean over peers of each one's latest test evaluation (every ``--eval-every``
own steps; DDP: rank 0, whose model every rank shares). "Over the link" counts the bytes that left both
ends of the limited veth during the row. The link itself is measured first with one TCP stream.
Results: ``--out`` (default ``bench/results/multihost``), one directory per row and ``results.json``.
``bench/slowlink.py`` runs its rows (another task, one peer per host, ``--compress``) through the same
functions (``benchmark``, ``run_gossip``, ``run_ddp``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from straggler import mean_eval_curve  # noqa: E402 - (bench/, the script's directory)

from tests import netns  # noqa: E402 - the namespaces the tests make
from tests.conftest import free_base_port  # noqa: E402


def run_gossip(hosts: netns.TwoHosts, out: Path, mode: str, args: argparse.Namespace, per_host: int = 2,
               task: str = "digits", extra: tuple[str, ...] = ()) -> None:
    """``per_host`` peers on each host training ``task``, on the ring (where the results in BENCHMARKS.md
    were measured: its edges that cross the link are counted there); ``extra``: more launcher flags."""
    command = [sys.executable, "-m", "launch", "--hosts", f"{hosts.wan[0]}:{per_host},{hosts.wan[1]}:{per_host}",
               "--remote-shell", str(hosts.shell), "--mode", mode, "--topology", "ring", "--task", task,
               "--steps", str(args.steps),
               "--compute-ms", str(args.compute_ms), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
               "--out", str(out), "--progress", "off", "--no-plot", "--base-port", str(free_base_port(5)), *extra]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)


def run_ddp(hosts: netns.TwoHosts, out: Path, args: argparse.Namespace, per_host: int = 2,
            task: str = "digits") -> None:
    """``per_host`` ranks on each host training ``task``'s model (``bench/ddp.py``)."""
    out.mkdir(parents=True)
    nodes = 2 * per_host
    common = [sys.executable, str(ROOT / "bench" / "ddp.py"), "--nodes", str(nodes), "--task", task,
              "--steps", str(args.steps), "--compute-ms", str(args.compute_ms), "--eval-every", str(args.eval_every),
              "--seed", str(args.seed), "--master-addr", hosts.wan[0], "--port", str(free_base_port(1)),
              "--out", str(out)]
    procs = []
    try:
        for rank in range(nodes):
            host = rank // per_host
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": hosts.wan_devices[host]}
            with open(out / f"peer-{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(hosts.exec(host, [*common, "--rank", str(rank)]), cwd=ROOT, env=env,
                                              stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=1800) for p in procs]
        if any(codes):
            raise RuntimeError(f"DDP ranks exited {codes}; see {out}/peer-*.log")
    finally:
        for p in procs:  # only our own children, by handle
            if p.poll() is None:
                p.kill()
                p.wait(10)


def analyse(out: Path, target: float, peers: int = 4) -> dict:
    """Time to ``target`` (mean over peers of their latest evaluations), final mean accuracy, run time."""
    events = [[json.loads(line) for line in (out / f"peer-{r}.jsonl").read_text().splitlines() if line.strip()]
              for r in range(peers)]
    t0 = min(e["time"] for peer in events for e in peer if e["event"] == "ready")
    curve = mean_eval_curve(events, t0)
    ends = [next(e for e in peer if e["event"] == "end") for peer in events]
    evaluating = {rank for rank, peer in enumerate(events) if any(e["event"] == "eval" for e in peer)}
    final = [end["test"]["accuracy"] for rank, end in enumerate(ends) if rank in evaluating]
    return {"time_to_target": next((t for t, accuracy in curve if accuracy >= target), None),
            "final_accuracy": sum(final) / len(final), "wall_seconds": max(e["time"] for e in ends) - t0,
            "curve": curve}


def link_bytes(hosts: netns.TwoHosts) -> int:
    return sum(hosts.tx_bytes(side, hosts.wan_devices[side]) for side in (0, 1))


def table(results: dict, target: float) -> str:
    lines = [f"| variant | time to {target:.2f} | final test accuracy (mean over peers) | run time | over the link |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in results["rows"].items():
        if "failed" in row:
            lines.append(f"| {name} | failed | | | {row['link_bytes'] / 1e6:.1f} MB |")
            continue
        hit = "not reached" if row["time_to_target"] is None else f"{row['time_to_target']:.1f} s"
        lines.append(f"| {name} | {hit} | {row['final_accuracy']:.4f} | {row['wall_seconds']:.1f} s | "
                     f"{row['link_bytes'] / 1e6:.1f} MB |")
    return "\n".join(lines)


Rows = Callable[[netns.TwoHosts], dict[str, tuple[str, Callable[[Path], None]]]]


def benchmark(parser: argparse.ArgumentParser, args: argparse.Namespace, rows: Rows, peers: int) -> None:
    """Make the two hosts, measure the link, run each of ``rows(hosts)`` (name -> (directory under ``args.out``,
    run writing ``peers`` event logs there)) one after the other, then write results.json and print the table.
    A row that fails is reported as failed and the others still run; the exit status is then 1."""
    if (reason := netns.unavailable()) is not None:
        parser.error(f"cannot make the two hosts: {reason}")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; remove it or pass another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="gw6-") as scratch, netns.two_hosts(Path(scratch), args.rate) as hosts:
        results = {"rate": args.rate, "link_bytes_per_second": netns.throughput(hosts, hosts.wan[1], 16 << 20,
                                                                                  free_base_port(1)),
                   "args": {k: str(v) for k, v in vars(args).items()}, "rows": {}}
        print(f"link: one TCP stream {results['link_bytes_per_second'] * 8 / 1e6:.1f} Mbit/s", flush=True)
        for name, (directory, run) in rows(hosts).items():
            print(f"{name} ...", flush=True)
            out, before, started = args.out / directory, link_bytes(hosts), time.time()
            try:
                run(out)
                row = analyse(out, args.target, peers)
            except (subprocess.SubprocessError, RuntimeError, OSError, ValueError, KeyError, StopIteration,
                    ZeroDivisionError) as exc:
                print(f"{name} failed: {exc!r}; its output is in {out}", flush=True)
                row = {"failed": repr(exc), "seconds": time.time() - started}
            results["rows"][name] = {**row, "link_bytes": link_bytes(hosts) - before}
    results["machine"] = f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results, args.target))
    print(f"\nbench time {time.time() - began:.0f} s; {results['machine']}")
    if any("failed" in row for row in results["rows"].values()):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800, help="local steps per peer (and DDP steps)")
    parser.add_argument("--compute-ms", type=float, default=10.0)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", default="100mbit", help="the link's rate, as tc writes it")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "multihost")
    args = parser.parse_args()
    benchmark(parser, args, lambda hosts: {
        "gossip-sync": ("gossip-sync", lambda out: run_gossip(hosts, out, "gossip-sync", args)),
        "gossip-async": ("gossip-async", lambda out: run_gossip(hosts, out, "gossip-async", args)),
        "DDP (gloo)": ("ddp", lambda out: run_ddp(hosts, out, args))}, peers=4)


if __name__ == "__main__":
    main()
