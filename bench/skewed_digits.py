"""Every peer's data counts alike: the asynchronous modes on skewed data, with and without a slow peer.

    python bench/skewed_digits.py                     # 2 settings x 9 runs x 3 seeds (about 8 minutes)
    python bench/skewed_digits.py --seeds 0           # a quick look

Digits split ``--partition dirichlet:0.1`` over 6 peers (most of a peer's samples are of one or two
classes), each step an emulated accelerator step of ``--compute-ms 5``, at the launcher's defaults
otherwise; two settings: equal speeds, and the last peer four times slower (``--speeds 1,1,1,1,1,0.25``).
Each asynchronous mode runs at its defaults (rate compensation on) and with ``--rate-compensation off``
(the rate-weighted rule of before), beside ps-sync (every worker's gradient in every step: the reference)
in the same run. Reported: the accuracy of the model each run produces (``model-final.pt``), mean over the
seeds (and the range), and the steps the slow peer took. Results: ``bench/results/skewed_digits/``.
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

from straggler import free_port_range

ROOT = Path(__file__).resolve().parent.parent
NODES = 6
SETTINGS = {"equal": [1.0] * NODES, "slow": [1.0] * (NODES - 1) + [0.25]}
RUNS = [("ps-sync", "on"), *((mode, comp) for mode in ("gossip-async", "ps-async", "ps-ssp", "ps-dcasgd")
                             for comp in ("on", "off"))]


def launch(out: Path, mode: str, compensation: str, seed: int, speeds: list[float], compute_ms: float) -> dict:
    command = [sys.executable, "-m", "launch", "--mode", mode, "--seed", str(seed), "--nodes", str(NODES),
               "--partition", "dirichlet:0.1", "--compute-ms", str(compute_ms), "--out", str(out),
               "--progress", "off", "--base-port", str(free_port_range(NODES + 1))]
    if speeds != [1.0] * NODES:
        command += ["--speeds", ",".join(map(str, speeds))]
    if compensation != "on":
        command += ["--rate-compensation", compensation]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    return {"accuracy": summary["final_model"]["accuracy"],
            "steps": [peer["steps"] for peer in summary["peers"]], "wall_seconds": summary["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=lambda text: [int(s) for s in text.split(",")], default=[0, 1, 2])
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "skewed_digits")
    args = parser.parse_args()
    results: dict[str, dict[str, list[dict]]] = {}
    for setting, speeds in SETTINGS.items():
        for mode, compensation in RUNS:
            key = f"{mode}" + ("" if compensation == "on" else ", --rate-compensation off")
            for seed in args.seeds:
                out = args.out / setting / f"{mode}-{compensation}-{seed}"
                result = launch(out, mode, compensation, seed, speeds, args.compute_ms)
                results.setdefault(key, {}).setdefault(setting, []).append(result)
                print(f"{setting:6} {key:40} seed {seed}: accuracy {result['accuracy']:.3f}, steps "
                      f"{result['steps']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{subprocess.run(['nproc'], capture_output=True, text=True, check=False).stdout.strip()} CPUs", "seeds": args.seeds,
        "compute_ms": args.compute_ms, "results": results}, indent=2))

    def cell(runs: list[dict]) -> str:
        accuracies = [r["accuracy"] for r in runs]
        return f"{statistics.mean(accuracies):.3f} ({min(accuracies):.3f}-{max(accuracies):.3f})"

    print(f"\n| mode | equal speeds | last peer 4x slower | slow peer's steps (of {300}) |")
    print("| --- | --- | --- | --- |")
    for key, by_setting in results.items():
        slow_steps = statistics.mean(r["steps"][-1] for r in by_setting["slow"])
        print(f"| {key} | {cell(by_setting['equal'])} | {cell(by_setting['slow'])} | {slow_steps:.0f} |")


if __name__ == "__main__":
    main()
