"""Every mode on a GPU: the charlm task trained by peers whose weights live on CUDA, as a GPU user starts
them, and the torchrun example with its model on the GPU.

    python bench/cuda.py [--nodes 4] [--steps 300] [--out runs/cuda] [--device cpu]

Each row is ``python -m launch --task charlm --device cuda ...`` with one mode's settings; a row passes
when the run exits 0, every peer (and the server) reported a CUDA device in its ``ready`` event, and the
product model's validation loss is finite and below the untrained model's (ln 96, about 4.56 nats: the
uniform guess over the task's characters). The torchrun row starts ``examples/charlm_torchrun.py`` on
``--nodes`` processes and reads each peer's final line. CPU runs of the same rows are the test suite's;
this script is for a machine with a GPU, and exits 2 on one without (``--device cpu`` runs its rows on the
CPU, to try the script itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
UNTRAINED = math.log(96)
ROWS = {
    "gossip-sync": [],  # (its default: the exponential graph without overlap)
    "gossip-sync, ring with overlap": ["--topology", "ring"],
    "gossip-sync, int8 (CHOCO)": ["--compress", "int8"],
    "gossip-sync, outer Nesterov every 10": ["--gossip-every", "10", "--outer-optimizer", "nesterov"],
    "gossip-async": ["--mode", "gossip-async"],
    "ps-sync": ["--mode", "ps-sync"],
    "ps-async": ["--mode", "ps-async"],
    "ps-avg, DiLoCo int8": ["--mode", "ps-avg", "--local-steps", "10", "--outer-optimizer", "nesterov",
                            "--compress", "int8"],
}


def launch_row(name: str, extra: list[str], args: argparse.Namespace, port: int) -> dict:
    out = Path(args.out) / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    command = [sys.executable, "-m", "launch", "--task", "charlm", "--device", args.device, "--nodes", str(args.nodes),
               "--steps", str(args.steps), "--base-port", str(port), "--out", str(out), "--progress", "off",
               "--no-plot", *extra]
    began = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    row = {"row": name, "status": done.returncode, "seconds": round(time.monotonic() - began, 1)}
    devices = set()
    for events in out.glob("*.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "ready" and "device" in event:
                devices.add(event["device"])
    row["devices"] = sorted(devices)
    summary = out / "summary.json"
    row["loss"] = json.loads(summary.read_text()).get("loss") if summary.exists() else None
    row["passed"] = (done.returncode == 0 and bool(devices) and all(d.startswith(args.device) for d in devices)
                     and row["loss"] is not None and math.isfinite(row["loss"]) and row["loss"] < UNTRAINED)
    if not row["passed"]:
        row["error"] = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return row


def torchrun_row(args: argparse.Namespace, port: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nodes),
               "examples/charlm_torchrun.py", "--steps", str(args.steps), "--base-port", str(port), "--device",
               args.device]
    began = time.monotonic()
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # keep what is there
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": path})
    losses = [float(m) for m in re.findall(r"validation loss ([0-9.]+) nats", done.stdout)]
    passed = done.returncode == 0 and len(losses) == args.nodes and all(loss < UNTRAINED for loss in losses)
    row = {"row": "torchrun example", "status": done.returncode, "seconds": round(time.monotonic() - began, 1),
           "devices": [args.device], "loss": sum(losses) / len(losses) if losses else None, "passed": passed}
    if not passed:
        row["error"] = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--base-port", type=int, default=41000)
    parser.add_argument("--out", default="runs/cuda")
    parser.add_argument("--json", default="", help="also write the rows to this file")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/cuda.py: torch sees no GPU on this machine; run it where torch.cuda.is_available() is True")
        return 2
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, {args.nodes} peers, {args.steps} steps")
    rows = []
    for index, (name, extra) in enumerate(ROWS.items()):
        rows.append(launch_row(name, extra, args, args.base_port + 20 * index))
        print(json.dumps(rows[-1]), flush=True)
    rows.append(torchrun_row(args, args.base_port + 20 * len(ROWS)))
    print(json.dumps(rows[-1]), flush=True)
    print("\n| row | validation loss | devices | seconds | passed |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        passed = "yes" if r["passed"] else "NO"
        print(f"| {r['row']} | {loss} | {', '.join(r['devices'])} | {r['seconds']} | {passed} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
