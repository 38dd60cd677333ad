"""Stragglers: N peers train digits, one of them four times slower; who reaches the target accuracy first?

    python bench/straggler.py                       # N = 4 and 8, every variant; about 15 minutes
    python bench/straggler.py --nodes 4 --steps 60  # a quick look

Every variant trains the same MLP on the same shards (peer r's shard of the seeded permutation), with the
same learning rate, momentum and batch size, and emulates the same accelerator step (``--compute-ms``,
scaled by 1 / speed, so the slow peer's step takes four times as long). The rows:

- ``gossip-sync, fixed wait``: D-PSGD on the ring; each round waits for every neighbour (up to ``--round-timeout``).
- ``gossip-sync, adaptive deadlines``: waits per neighbour at most median + k * MAD of its lateness and not
  at all for a neighbour that reports a slower pace; late messages are mixed when they come (push-sum).
- ``gossip-async (push-sum)``: never waits; every message is mixed once, the weighted mean is kept.
- ``gossip-async, latest rule, staleness 1/(1+tau)``: never waits; each neighbour's latest snapshot, tau own
  steps old, counts 1 / (1 + tau) at every step (``--async-rule latest``).
- ``time rounds, adaptive, by samples``: rounds of ``--round-seconds``; each peer does as many steps as fit,
  with adaptive deadlines and push-sum mass proportional to the samples of the round. Run for as many
  rounds as make its total samples about the other rows' (the table shows the real total).
- ``DDP (gloo all-reduce)``: ``bench/ddp.py``, every step an all-reduce of the gradients across all ranks.
- ``one process, all data``: a single peer at full speed on the whole training set.

Gossip rows run through the real launcher (``python -m launch``), the DDP row as N real processes. Time
starts at the first peer's ``ready`` event (after start-up, which the variants do not share). Accuracy at
time t is the mean over peers of each one's latest test evaluation (every ``--eval-every`` own steps);
"steps" is the mean number of local steps per peer at that moment. Results: ``bench/results/straggler/``
(one directory per run, ``results.json``) and ``bench/results/straggler.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERHEAD_SECONDS = 0.004  # per step beyond the emulated compute, measured here; only sizes the time rows


def free_port_range(count: int) -> int:
    for base in range(30000, 40000, 97):
        with_free = []
        for port in range(base, base + count):
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))
                    with_free.append(port)
                except OSError:
                    break
        if len(with_free) == count:
            return base
    raise RuntimeError("no free port range")


def variants(args: argparse.Namespace, nodes: int) -> dict[str, list[str]]:
    speeds = [1.0] * (nodes - 1) + [args.slow]
    per_round = sum(max(1.0, args.round_seconds * s / (args.compute_ms / 1000 + OVERHEAD_SECONDS)) for s in speeds)
    rounds = math.ceil(nodes * args.steps / per_round)
    return {
        "gossip-sync, fixed wait": ["--topology", "ring"],  # (measured on the ring, beside the adaptive rows)
        "gossip-sync, adaptive deadlines": ["--deadline", "adaptive"],
        "gossip-async (push-sum)": ["--mode", "gossip-async"],
        "gossip-async, latest rule, staleness 1/(1+tau)": ["--mode", "gossip-async", "--async-rule", "latest",
                                                            "--staleness-weight", "inverse"],
        f"time rounds of {args.round_seconds:g} s, adaptive, by samples": [
            "--schedule", "time", "--round-seconds", str(args.round_seconds), "--rounds", str(rounds),
            "--deadline", "adaptive", "--weight-by", "samples"],
    }


def run_launcher(out: Path, nodes: int, speeds: list[float], args: argparse.Namespace, extra: list[str]) -> None:
    command = [sys.executable, "-m", "launch", "--nodes", str(nodes), "--steps", str(args.steps), "--out", str(out),
               "--speeds", ",".join(map(str, speeds)), "--compute-ms", str(args.compute_ms), "--eval-every",
               str(args.eval_every), "--progress", "off", "--base-port", str(free_port_range(nodes)), *extra]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)


def run_ddp(out: Path, nodes: int, speeds: list[float], args: argparse.Namespace) -> None:
    command = [sys.executable, str(ROOT / "bench" / "ddp.py"), "--nodes", str(nodes), "--steps", str(args.steps),
               "--speeds", ",".join(map(str, speeds)), "--compute-ms", str(args.compute_ms), "--eval-every",
               str(args.eval_every), "--port", str(free_port_range(1)), "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=1800)


def read_events(out: Path) -> list[list[dict]]:
    ranks = sorted(int(p.stem.split("-")[1]) for p in out.glob("peer-*.jsonl"))
    return [[json.loads(line) for line in (out / f"peer-{r}.jsonl").read_text().splitlines() if line.strip()]
            for r in ranks]


def mean_eval_curve(events: list[list[dict]], t0: float, metric: str = "accuracy") -> list[tuple[float, float]]:
    """(seconds since ``t0``, mean over the evaluating peers of each one's latest evaluated ``metric``), from
    the moment every one of them has evaluated once."""
    evals = sorted((e["time"] - t0, rank, e[metric]) for rank, peer in enumerate(events) for e in peer
                   if e["event"] == "eval")
    evaluating = {rank for _, rank, _ in evals}
    latest, curve = {}, []
    for t, rank, value in evals:
        latest[rank] = value
        if len(latest) == len(evaluating):
            curve.append((t, sum(latest.values()) / len(latest)))
    return curve


def analyse(out: Path, target: float, batch_size: int) -> dict:
    """Accuracy curve (time since the first ready, mean of the peers' latest evaluations), time and steps to
    ``target``, final accuracy of the averaged model and the total samples trained."""
    events = read_events(out)
    t0 = min(e["time"] for peer in events for e in peer if e["event"] == "ready")
    curve = mean_eval_curve(events, t0)
    hit = next((t for t, accuracy in curve if accuracy >= target), None)
    ends = [next(e for e in peer if e["event"] == "end") for peer in events]
    ddp = not (out / "summary.json").exists()
    if ddp:  # every rank did every step; rank 0 evaluated the (identical) model
        steps_at = (lambda t: max((e["step"] for e in events[0] if e["event"] == "eval" and e["time"] - t0 <= t),
                                  default=0))
        final, total_steps = ends[0]["test"]["accuracy"], ends[0]["step"] * len(events)
    else:
        step_times = [[e["time"] - t0 for e in peer if e["event"] == "step"] for peer in events]
        steps_at = (lambda t: sum(sum(1 for s in times if s <= t) for times in step_times) / len(step_times))
        summary = json.loads((out / "summary.json").read_text())
        final, total_steps = summary["final_model"]["accuracy"], sum(p["steps"] for p in summary["peers"])
    return {"time_to_target": hit, "steps_to_target": None if hit is None else steps_at(hit),
            "final_accuracy": final, "total_samples": total_steps * batch_size, "curve": curve,
            "wall_seconds": max(e["time"] for e in ends) - t0}


def run_all(args: argparse.Namespace) -> dict:
    results: dict = {}
    for nodes in args.nodes:
        speeds = [1.0] * (nodes - 1) + [args.slow]
        results[str(nodes)] = rows = {}
        for name, extra in variants(args, nodes).items():
            if args.only and args.only not in name:
                continue
            out = args.out / f"n{nodes}-{slug(name)}"
            print(f"N={nodes}: {name} ...", flush=True)
            run_launcher(out, nodes, speeds, args, extra)
            rows[name] = analyse(out, args.target, 32)
        if not args.only:
            out = args.out / f"n{nodes}-ddp"
            print(f"N={nodes}: DDP ...", flush=True)
            run_ddp(out, nodes, speeds, args)
            rows["DDP (gloo all-reduce)"] = analyse(out, args.target, 32)
    if not args.only:
        out = args.out / "single"
        print("one process ...", flush=True)
        run_launcher(out, 1, [1.0], args, [])
        results["1"] = {"one process, all data, full speed": analyse(out, args.target, 32)}
    return results


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:40]


def table(results: dict, target: float) -> str:
    lines = [f"| N | variant | time to {target:.2f} | steps to {target:.2f} (mean per peer) | final accuracy, "
             "averaged model | samples trained | run time |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for nodes, rows in results.items():
        for name, row in rows.items():
            hit = "not reached" if row["time_to_target"] is None else f"{row['time_to_target']:.1f} s"
            steps = "-" if row["steps_to_target"] is None else f"{row['steps_to_target']:.0f}"
            lines.append(f"| {nodes} | {name} | {hit} | {steps} | {row['final_accuracy']:.4f} | "
                         f"{row['total_samples']} | {row['wall_seconds']:.1f} s |")
    return "\n".join(lines)


def plot(results: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [n for n in results if n != "1"]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for axis, nodes in zip(axes[0], panels):
        for name, row in {**results[nodes], **results.get("1", {})}.items():
            if row["curve"]:
                axis.plot(*zip(*row["curve"]), lw=1.2, label=name)
        axis.axhline(target, color="grey", ls="--", lw=0.8)
        axis.set(title=f"N = {nodes}, one peer 4x slower", xlabel="wall time since the first peer was ready (s)",
                 ylabel="test accuracy (mean over peers)", ylim=(0.8, 1.0))
        axis.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=lambda text: [int(n) for n in text.split(",")], default=[4, 8])
    parser.add_argument("--steps", type=int, default=400, help="local steps per peer (and DDP steps)")
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--slow", type=float, default=0.25, help="speed of the last peer")
    parser.add_argument("--round-seconds", type=float, default=0.2)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--only", default="", help="run only the gossip rows whose name contains this "
                                                    "(no DDP and one-process rows), e.g. push-sum")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "straggler")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; remove it or pass another --out")
    began = time.time()
    results = run_all(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args.target, args.out.parent / "straggler.png")
    print(table(results, args.target))
    print(f"\nbench time {time.time() - began:.0f} s; plot {args.out.parent / 'straggler.png'}")


if __name__ == "__main__":
    main()
