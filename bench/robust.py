"""The accuracy cost of robust aggregation, and what it buys: digits on N peers with ``--aggregate mean``,
``median`` and ``trimmed-mean``, without a fault and with one ``--byzantine`` peer.

    python bench/robust.py                                  # ring and full, N = 6, 300 steps; about 4 minutes
    python bench/robust.py --topologies torus --steps 150   # a quick look

Every run goes through the real launcher (gossip-sync, fixed deadlines, same seed, shards and
hyper-parameters). The byzantine peer (rank ``--byzantine``) sends uniform garbage in [-scale, scale]
instead of its weights at every round; it passes every wire check, so only aggregation can stop it.
Figures are over the honest peers only (the summary leaves the byzantine peer out): the accuracy of their
averaged model (``model-final.pt``), their mean test accuracy, and their consensus distance; wall time
is the launcher's, start-up included. A run whose peers fail (weights overflow to NaN, their snapshots
are then dropped as non-finite and their neighbours give up after ``--round-timeout``) is shown as
failed. On a ring (3 inputs) and a 6-peer torus (4 inputs) the trimmed mean is the median; on ``full``
(6 inputs) with ``--trim-fraction 0.2`` it averages the middle 4 values against the median's middle 2.
Results: ``bench/results/robust/results.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from straggler import free_port_range  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AGGREGATES = ("mean", "median", "trimmed-mean")


def run_one(out: Path, args: argparse.Namespace, topology: str, aggregate: str, scale: float | None) -> dict:
    command = [sys.executable, "-m", "launch", "--nodes", str(args.nodes), "--topology", topology, "--steps",
               str(args.steps), "--aggregate", aggregate, "--seed", str(args.seed), "--round-timeout",
               str(args.round_timeout), "--out", str(out), "--progress", "off", "--no-plot",
               "--base-port", str(free_port_range(args.nodes)),
               "--allow-divergence"]  # the garbage may ruin a run: that is what the table shows
    if scale is not None:
        command += ["--byzantine", str(args.byzantine), "--byzantine-scale", f"{scale:g}"]
    began = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    row = {"topology": topology, "aggregate": aggregate, "byzantine_scale": scale,
           "wall_seconds": time.monotonic() - began, "exit": proc.returncode}
    if proc.returncode != 0:
        return {**row, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    summary = json.loads((out / "summary.json").read_text())
    return {**row, "final_accuracy": summary["final_model"].get("accuracy"),
            "mean_test_accuracy": summary["mean_test_accuracy"], "consensus_distance": summary["consensus_distance"]}


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = ["| topology | aggregate | fault | honest averaged model | honest mean test acc | consensus distance "
             "| wall s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fault = "none" if r["byzantine_scale"] is None else f"peer {args.byzantine}, scale {r['byzantine_scale']:g}"
        if r["exit"]:
            result = "failed: weights went non-finite, run stopped" if "round-timeout" in r["error"] else r["error"]
            cells = [result, "", ""]
        else:
            cells = [f"{r['final_accuracy']:.4f}", f"{r['mean_test_accuracy']:.4f}", f"{r['consensus_distance']:.3g}"]
        lines.append(f"| {r['topology']} | {r['aggregate']} | {fault} | " + " | ".join(cells)
                     + f" | {r['wall_seconds']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topologies", default="ring,full")
    parser.add_argument("--byzantine", type=int, default=3, help="rank of the peer that sends garbage")
    parser.add_argument("--scales", default="1e30,1e3", help="garbage scales to try, comma-separated")
    parser.add_argument("--round-timeout", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "robust")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for topology in args.topologies.split(","):
        for scale in [None, *map(float, args.scales.split(","))]:
            for aggregate in AGGREGATES:
                name = f"{stamp}-{topology}-{aggregate}-{'none' if scale is None else f'{scale:g}'}"
                rows.append(run_one(args.out / name, args, topology, aggregate, scale))
                print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=2))
    print(table(rows, args))


if __name__ == "__main__":
    main()
