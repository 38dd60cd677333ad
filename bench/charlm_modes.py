"""Every mode at its defaults on the real workload: a character-level transformer (``--task charlm``).

    python bench/charlm_modes.py                                   # everything: about 2.5 hours on 2 cores
    python bench/charlm_modes.py --settings 4 --partitions iid     # one row block: about 15 minutes
    python bench/charlm_modes.py --modes gossip-sync,ps-sync --baselines none --settings 4

Each mode runs as a user runs it, ``python -m launch --task charlm --mode M --partition P``, every other
flag at its default (the charlm recipe: AdamW, lr 3e-3 with 5% warm-up and cosine decay, 1,000 steps of 16
sequences of 64 characters per peer), in two settings:

- ``4 equal``: 4 peers (or 4 workers and a server), equal speeds;
- ``8, one at 0.25``: 8 peers, the last one four times slower (``--speeds``: it sleeps three times its own
  measured step). No ``--compute-ms``: the model's own compute is the step, so 8 peers on 2 cores are
  CPU-bound, and the times of this row are those of an oversubscribed machine.

and two partitions: ``iid`` (a seeded round-robin deal of the training windows) and ``by-file`` (each peer
its own run of the standard library's files). Beside them, in the same setting and partition:

- ``DDP``: ``bench/ddp.py --task charlm``, PyTorch DistributedDataParallel with gloo, the same model, shards,
  batches, AdamW and schedule, an all-reduce of the gradients every step (the slow rank slows every step);
- ``one process``: one peer on all the data (``--nodes 1``), N x 1,000 steps of 16 sequences: the same
  samples, processed one batch at a time (the small-batch optimum, at N times the wall time).

Reported per run: the validation loss (nats per character) of the model the run produces (the server's
model for ps-*, the push-sum weighted average of the copies for gossip, DDP's identical copy) after every
peer has processed its 1,000 batches, so at equal samples; its ratio to ps-sync's in the same block; the
time from the first ``ready`` until the evaluated loss first reaches ``--target`` (the server's
evaluations for ps-*, else the mean over peers of each one's latest evaluation, every 100 steps); the
wall time; the bytes every process sent; and the spread of the peers' own copies (consensus distance, and
the largest minus the smallest of their validation losses). Results: ``bench/results/charlm/results.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from straggler import free_port_range, mean_eval_curve, read_events

ROOT = Path(__file__).resolve().parent.parent
MODES = ("gossip-sync", "gossip-async", "ps-sync", "ps-avg", "ps-async", "ps-ssp", "ps-dcasgd")
BASELINES = ("DDP", "one process")
SETTINGS = {"4": ("4 equal", 4, [1.0] * 4), "8": ("8, one at 0.25", 8, [1.0] * 7 + [0.25])}
PARTITIONS = ("iid", "by-file")
STEPS = 1000  # the charlm recipe's --steps (gossip/recipes.py)


def run_launcher(out: Path, mode: str, nodes: int, speeds: list[float], partition: str, steps: int | None = None
                 ) -> None:
    command = [sys.executable, "-m", "launch", "--task", "charlm", "--mode", mode, "--nodes", str(nodes),
               "--partition", partition, "--out", str(out), "--progress", "off", "--no-plot",
               "--base-port", str(free_port_range(nodes + 1))]
    if speeds != [1.0] * nodes:
        command += ["--speeds", ",".join(map(str, speeds))]
    if steps is not None:
        command += ["--steps", str(steps)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=3600)


def run_ddp(out: Path, nodes: int, speeds: list[float], partition: str) -> None:
    command = [sys.executable, str(ROOT / "bench" / "ddp.py"), "--task", "charlm", "--nodes", str(nodes),
               "--speeds", ",".join(map(str, speeds)), "--compute-ms", "0", "--eval-every", "100",
               "--partition", partition, "--port", str(free_port_range(1)), "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=3600)


def loss_curve(out: Path, t0: float) -> list[tuple[float, float]]:
    """(seconds since ``t0``, evaluated validation loss): the server's evaluations when there is a server,
    else the mean over the evaluating peers of each one's latest evaluation, once every one has evaluated."""
    server = out / "server.jsonl"
    if server.exists():
        events = [json.loads(line) for line in server.read_text().splitlines() if line.strip()]
        return sorted((e["time"] - t0, e["loss"]) for e in events if e["event"] == "eval")
    return mean_eval_curve(read_events(out), t0, "loss")


def analyse(out: Path, target: float) -> dict:
    events = read_events(out)
    t0 = min(e["time"] for peer in events for e in peer if e["event"] == "ready")
    ends = [next(e for e in peer if e["event"] == "end") for peer in events]
    curve = loss_curve(out, t0)
    row = {"time_to_target": next((t for t, loss in curve if loss <= target), None), "curve": curve,
           "wall_seconds": max(e["time"] for e in ends) - t0}
    summary_path = out / "summary.json"
    if not summary_path.exists():  # DDP: rank 0 evaluated the identical model
        return {**row, "loss": ends[0]["test"]["loss"], "bytes_sent": None, "consensus_distance": 0.0,
                "loss_spread": 0.0}
    summary = json.loads(summary_path.read_text())
    own = [p["test_loss"] for p in summary["peers"] if p["test_loss"] is not None]
    sent = summary["bytes_sent"]  # every process's, the server's included
    return {**row, "loss": summary["loss"], "bytes_sent": sent, "consensus_distance": summary["consensus_distance"],
            "loss_spread": max(own) - min(own) if own else None, "server": summary.get("server")}


def run_all(args: argparse.Namespace) -> dict:
    results: dict = {}
    for key in args.settings:
        name, nodes, speeds = SETTINGS[key]
        for partition in args.partitions:
            block = results[f"{name}, {partition}"] = {}
            for row in (*args.modes, *args.baselines):
                out = args.out / f"n{nodes}-{partition}-{row.replace(' ', '-')}"
                print(f"{name}, {partition}: {row} ...", flush=True)
                began = time.time()
                if row == "DDP":
                    run_ddp(out, nodes, speeds, partition)
                elif row == "one process":
                    run_launcher(out, "gossip-sync", 1, [1.0], "iid", steps=nodes * STEPS)
                else:
                    run_launcher(out, row, nodes, speeds, partition)
                block[row] = {**analyse(out, args.target), "bench_seconds": time.time() - began}
                (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return results


def cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(results: dict, target: float) -> str:
    lines = [f"| setting, partition | mode | validation loss | / ps-sync | time to {target:g} | wall time | sent MB | "
             "consensus distance | spread of the copies' losses |", "| --- " * 9 + "|"]
    for block, rows in results.items():
        reference = (rows.get("ps-sync") or {}).get("loss")
        for row, r in rows.items():
            ratio = r["loss"] / reference if reference else None
            sent = None if r["bytes_sent"] is None else r["bytes_sent"] / 1e6
            reached = "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.0f} s"
            lines.append(f"| {block} | {row} | {r['loss']:.4f} | {cell(ratio, '.3f')} | {reached} | "
                         f"{r['wall_seconds']:.0f} s | {cell(sent, ',.0f')} | {r['consensus_distance']:.3g} | "
                         f"{cell(r['loss_spread'], '.4f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", type=lambda text: text.split(","), default=list(SETTINGS),
                        help="4 (4 equal peers), 8 (8 peers, one at speed 0.25), or both")
    parser.add_argument("--partitions", type=lambda text: text.split(","), default=list(PARTITIONS))
    parser.add_argument("--modes", type=lambda text: [m for m in text.split(",") if m], default=list(MODES))
    parser.add_argument("--baselines", type=lambda text: [] if text == "none" else text.split(","),
                        default=list(BASELINES), help="DDP, one process (comma-separated), or none")
    parser.add_argument("--target", type=float, default=1.6, help="validation loss for the time-to-target column")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "charlm")
    args = parser.parse_args()
    for flag, given, known in (("--settings", args.settings, SETTINGS), ("--partitions", args.partitions, PARTITIONS),
                               ("--modes", args.modes, MODES), ("--baselines", args.baselines, BASELINES)):
        if unknown := [s for s in given if s not in known]:
            parser.error(f"{flag} {','.join(unknown)}: choose from {', '.join(known)}")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; remove it or pass another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    results = run_all(args)
    print(f"machine: {platform.machine()}, {platform.processor() or platform.system()}; "
          f"{time.time() - began:.0f} s in all")
    print(table(results, args.target))


if __name__ == "__main__":
    main()
