"""Every mode at its defaults: does each one give the model one process would?

    python bench/modes.py                          # 7 modes x 2 settings x 3 seeds, DDP, one process (~12 min)
    python bench/modes.py --seeds 0 --settings 4   # a quick look

Each mode runs as a user runs it, ``python -m launch --mode M --seed S``, with nothing else changed but the
setting of the row:

- ``4 equal``: 4 peers (or 4 workers and a server), equal speeds, digits at the launcher's defaults
  (steps of about 1.5 ms on a CPU core: this row is about accuracy; its times are mostly start-up and
  messaging);
- ``8, one at 0.25``: 8 peers, the last four times slower, each step an emulated accelerator step of
  ``--compute-ms 5`` (scaled by 1 / speed).

Beside them, in the same run and setting: PyTorch DDP (``bench/ddp.py``, gloo all-reduce of the
gradients every step, the same model, shards, batches, learning rate and momentum) and one process on all
the data. Reported per mode and setting, mean over seeds (and the range): the accuracy of the model the
mode produces (``model-final.pt``: the server's for ps-*, the push-sum weighted average of the copies for
gossip; DDP's identical copy), and the time from the first ``ready`` until the evaluated accuracy first
reaches each of ``--targets`` (the server's evaluations for ps-*, otherwise the mean over peers of each
one's latest evaluation, every ``--eval-every`` steps; 300 steps of digits end near 0.95, so the lower
target shows the pace and the higher one whether a mode gets there at all).
Results: ``bench/results/modes/results.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from straggler import free_port_range, mean_eval_curve, read_events, run_ddp

ROOT = Path(__file__).resolve().parent.parent
MODES = ("gossip-sync", "gossip-async", "ps-sync", "ps-avg", "ps-async", "ps-ssp", "ps-dcasgd")
SETTINGS = {  # name -> (nodes, speeds, compute-ms)
    "4": ("4 equal", 4, [1.0] * 4, 0.0),
    "8": ("8, one at 0.25, --compute-ms 5", 8, [1.0] * 7 + [0.25], 5.0),
}


def launch(out: Path, mode: str, seed: int, nodes: int, speeds: list[float], compute_ms: float,
           eval_every: int) -> None:
    command = [sys.executable, "-m", "launch", "--mode", mode, "--seed", str(seed), "--nodes", str(nodes),
               "--out", str(out), "--eval-every", str(eval_every), "--progress", "off",
               "--base-port", str(free_port_range(nodes + 1))]
    if speeds != [1.0] * nodes:
        command += ["--speeds", ",".join(map(str, speeds))]
    if compute_ms:
        command += ["--compute-ms", str(compute_ms)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=900)


def time_to(out: Path, targets: list[float]) -> dict[str, float | None]:
    """Seconds from the first ready event until the evaluated accuracy first reaches each target."""
    peers = read_events(out)
    server = out / "server.jsonl"
    if server.exists():
        peers.append([json.loads(line) for line in server.read_text().splitlines() if line.strip()])
    t0 = min(e["time"] for peer in peers for e in peer if e["event"] == "ready")
    if server.exists():  # the product is the server's model: its own evaluations
        curve = sorted((e["time"] - t0, e["accuracy"]) for e in peers[-1] if e["event"] == "eval")
    else:  # the mean over peers of each one's latest evaluation
        curve = mean_eval_curve(peers, t0)
    return {f"{target:.2f}": next((t for t, accuracy in curve if accuracy >= target), None) for target in targets}


def product_accuracy(out: Path) -> float:
    summary = out / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())["accuracy"]
    rank0 = read_events(out)[0]  # DDP: every rank holds the same model; rank 0 evaluated it
    return next(e for e in rank0 if e["event"] == "end")["test"]["accuracy"]


def run_all(args: argparse.Namespace) -> dict:
    results: dict = {}
    for key in args.settings:
        name, nodes, speeds, compute_ms = SETTINGS[key]
        rows = results[name] = {}
        for row in (*args.modes, *(("DDP (gloo all-reduce)", "one process, all data") if args.baselines else ())):
            runs = []
            for seed in args.seeds:
                out = args.out / f"n{nodes}-{row.split()[0].lower()}-s{seed}"
                print(f"{name}: {row}, seed {seed} ...", flush=True)
                if row.startswith("DDP"):
                    if seed:  # bench/ddp.py trains from seed 0 (its own --seed): one run per setting
                        continue
                    run_ddp(out, nodes, speeds, argparse.Namespace(steps=300, compute_ms=compute_ms,
                                                                   eval_every=args.eval_every))
                elif row.startswith("one process"):
                    launch(out, "gossip-sync", seed, 1, [1.0], compute_ms, args.eval_every)
                else:
                    launch(out, row, seed, nodes, speeds, compute_ms, args.eval_every)
                runs.append({"seed": seed, "accuracy": product_accuracy(out), "time_to": time_to(out, args.targets)})
            rows[row] = runs
    return results


def summarise(runs: list[dict], targets: list[float]) -> list[str]:
    accuracy = [r["accuracy"] for r in runs]
    spread = f" ({min(accuracy):.3f}-{max(accuracy):.3f})" if len(runs) > 1 else ""
    cells = [f"{statistics.mean(accuracy):.4f}{spread}"]
    for target in targets:
        reached = [r["time_to"][f"{target:.2f}"] for r in runs if r["time_to"][f"{target:.2f}"] is not None]
        hit = f"{statistics.mean(reached):.2f} s" if reached else "not reached"
        cells.append(hit + (f" ({len(reached)} of {len(runs)} seeds)" if reached and len(reached) < len(runs) else ""))
    return cells


def table(results: dict, targets: list[float]) -> str:
    lines = ["| setting | mode | final accuracy, product model (range) | "
             + " | ".join(f"time to {t:.2f}" for t in targets) + " |", "| --- " * (3 + len(targets)) + "|"]
    for setting, rows in results.items():
        for row, runs in rows.items():
            lines.append(f"| {setting} | {row} | " + " | ".join(summarise(runs, targets)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",")], default=[0, 1, 2])
    parser.add_argument("--settings", type=lambda text: text.split(","), default=list(SETTINGS),
                        help="4 (4 equal peers), 8 (8 peers, one at speed 0.25, --compute-ms 5), or both")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES))
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                        help="also run DDP and one process")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--targets", type=lambda text: [float(t) for t in text.split(",")], default=[0.93, 0.95])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "modes")
    args = parser.parse_args()
    for name, given, known in (("--settings", args.settings, SETTINGS), ("--modes", args.modes, MODES)):
        if unknown := [s for s in given if s not in known]:
            parser.error(f"{name} {','.join(unknown)}: choose from {', '.join(known)}")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; remove it or pass another --out")
    began = time.time()
    results = run_all(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"machine: {platform.machine()}, {platform.processor() or platform.system()}; "
          f"{time.time() - began:.0f} s in all")
    print(table(results, args.targets))


if __name__ == "__main__":
    main()
