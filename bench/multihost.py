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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from straggler import mean_accuracy_curve  # noqa: E402 - (bench/, the script's directory)

from tests import netns  # noqa: E402 - the namespaces the tests make
from tests.conftest import free_base_port  # noqa: E402


def run_gossip(hosts: netns.TwoHosts, out: Path, mode: str, args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "launch", "--hosts", f"{hosts.wan[0]}:2,{hosts.wan[1]}:2",
               "--remote-shell", str(hosts.shell), "--mode", mode, "--steps", str(args.steps),
               "--compute-ms", str(args.compute_ms), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
               "--out", str(out), "--progress", "off", "--no-plot", "--base-port", str(free_base_port(5))]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)


def run_ddp(hosts: netns.TwoHosts, out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True)
    common = [sys.executable, str(ROOT / "bench" / "ddp.py"), "--nodes", "4", "--steps", str(args.steps),
              "--compute-ms", str(args.compute_ms), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
              "--master-addr", hosts.wan[0], "--port", str(free_base_port(1)), "--out", str(out)]
    procs = []
    try:
        for rank in range(4):
            host = rank // 2
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


def analyse(out: Path, target: float) -> dict:
    """Time to ``target`` (mean over peers of their latest evaluations), final mean accuracy, run time."""
    events = [[json.loads(line) for line in (out / f"peer-{r}.jsonl").read_text().splitlines() if line.strip()]
              for r in range(4)]
    t0 = min(e["time"] for peer in events for e in peer if e["event"] == "ready")
    curve = mean_accuracy_curve(events, t0)
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
        hit = "not reached" if row["time_to_target"] is None else f"{row['time_to_target']:.1f} s"
        lines.append(f"| {name} | {hit} | {row['final_accuracy']:.4f} | {row['wall_seconds']:.1f} s | "
                     f"{row['link_bytes'] / 1e6:.1f} MB |")
    return "\n".join(lines)


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
        runs = {"gossip-sync": lambda out: run_gossip(hosts, out, "gossip-sync", args),
                "gossip-async": lambda out: run_gossip(hosts, out, "gossip-async", args),
                "DDP (gloo)": lambda out: run_ddp(hosts, out, args)}
        for name, run in runs.items():
            print(f"{name} ...", flush=True)
            out = args.out / name.split()[0].lower()
            before = link_bytes(hosts)
            run(out)
            results["rows"][name] = {**analyse(out, args.target), "link_bytes": link_bytes(hosts) - before}
    results["machine"] = f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results, args.target))
    print(f"\nbench time {time.time() - began:.0f} s; {results['machine']}")


if __name__ == "__main__":
    main()
