"""Decentralized DiLoCo with a straggler: does the outer step keep the fast peers busy?

    python bench/outer_straggler.py                 # 8 peers on charlm, one four times slower
    python bench/outer_straggler.py --rounds 4      # a quick look

N peers train the ``charlm`` task at its recipe on one machine, one of them ``--slow`` times as fast
(``--speeds``; every step also takes ``--compute-ms`` of emulated accelerator time scaled by 1 / speed, so
the slow peer's real compute is not the only thing that differs). Each row runs gossip-sync on the ring with the outer
Nesterov step (``--outer-optimizer nesterov``, OpenDiLoCo's lr 0.7 and momentum 0.9) and AdamW at a constant
learning rate after the recipe's warm-up (a decaying schedule needs a step count that time rounds do not fix):

- ``every H steps``: ``--gossip-every H``: every peer mixes after H of its own steps, so the fast peers wait
  at each mix for the slow one;
- ``rounds of S s``: ``--schedule time --round-seconds S``: every peer mixes when the round's time is up,
  after as many steps as fit (the fast peers about H, the slow one a quarter), so nobody waits longer than
  one of the slow peer's steps.

Both rows run until the fast peers have done about ``--rounds`` x H steps. For each: the fast peers' idle
time (their ``wait_seconds``, blocked on neighbours, over their run time, from the end events), the steps
each kind of peer did, the run time, and the validation loss of the averaged model (``model-final.pt``).
Results: ``--out`` (default ``bench/results/outer_straggler``), one directory per row, ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import free_base_port


def rows(args: argparse.Namespace, seconds_per_step: float) -> dict[str, list[str]]:
    outer = ["--outer-optimizer", "nesterov", "--lr-schedule", "constant"]  # (time rounds fix no step count)
    round_seconds = args.h * seconds_per_step
    return {
        f"every {args.h} steps": ["--gossip-every", str(args.h), "--steps", str(args.rounds * args.h), *outer],
        f"rounds of {round_seconds:.1f} s": ["--schedule", "time", "--round-seconds", f"{round_seconds:.2f}",
                                             "--rounds", str(args.rounds), *outer],
    }


def run(out: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    speeds = [1.0] * (args.nodes - 1) + [1.0 / args.slow]
    command = [sys.executable, "-m", "launch", "--task", "charlm", "--mode", "gossip-sync", "--topology", "ring",
               "--nodes", str(args.nodes), "--speeds", ",".join(f"{s:g}" for s in speeds),
               "--compute-ms", str(args.compute_ms),
               "--eval-every", "0", "--seed", str(args.seed), "--out", str(out), "--progress", "off", "--no-plot",
               "--base-port", str(free_base_port(args.nodes)), *extra]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    summary = json.loads((out / "summary.json").read_text())
    peers = summary["peers"]
    fast = peers[:-1]
    return {"loss": summary["loss"], "wall_seconds": summary["wall_seconds"],
            "fast_idle": [p["wait_seconds"] / p["wall_seconds"] for p in fast],
            "fast_steps": [p["steps"] for p in fast], "slow_steps": peers[-1]["steps"],
            "fast_step_seconds": [p["step_seconds"] for p in fast],
            "bytes_sent": summary["bytes_sent"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--slow", type=float, default=4.0, help="the last peer is this many times slower")
    parser.add_argument("--h", type=int, default=50, help="inner steps between outer steps (fast peers)")
    parser.add_argument("--rounds", type=int, default=12, help="outer steps")
    parser.add_argument("--compute-ms", type=float, default=30.0)
    parser.add_argument("--seconds-per-step", type=float, default=0.0,
                        help="a fast peer's seconds per step while all run (0: measure it with a short run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "outer_straggler")
    args = parser.parse_args()
    if args.nodes < 2 or args.slow < 1 or args.h < 1 or args.rounds < 1:
        parser.error("--nodes >= 2, --slow >= 1, --h >= 1 and --rounds >= 1")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; remove it or pass another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    seconds = args.seconds_per_step
    if seconds <= 0:  # the fast peers' seconds per step (waits excluded) with every peer running
        probe = run(args.out / "probe", args, ["--gossip-every", str(args.h), "--steps", str(2 * args.h),
                                               "--lr-schedule", "constant"])
        seconds = sum(probe["fast_step_seconds"]) / len(probe["fast_step_seconds"])
        print(f"a fast peer's step, all running: about {seconds * 1000:.0f} ms", flush=True)
    results = {"args": vars(args) | {"out": str(args.out)}, "seconds_per_step": seconds, "rows": {}}
    lines = ["| row | fast peers idle (mean, max) | steps: fast, slow | run time | validation loss |",
             "| --- | --- | --- | --- | --- |"]
    for name, extra in rows(args, seconds).items():
        print(f"{name} ...", flush=True)
        row = run(args.out / name.replace(" ", "-"), args, extra)
        results["rows"][name] = row
        idle = row["fast_idle"]
        lines.append(f"| {name} | {sum(idle) / len(idle):.1%}, {max(idle):.1%} | "
                     f"{sum(row['fast_steps']) / len(row['fast_steps']):.0f}, {row['slow_steps']} | "
                     f"{row['wall_seconds']:.0f} s | {row['loss']:.4f} |")
    results["machine"] = f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}"
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + "\n".join(lines) + f"\n\nbench time {time.time() - began:.0f} s; {results['machine']}")


if __name__ == "__main__":
    main()
