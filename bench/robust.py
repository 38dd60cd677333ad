"""The accuracy cost of robust aggregation, and what it buys: digits on N peers with ``--aggregate mean``,
``median`` and ``trimmed-mean``, without a fault and with one ``--byzantine`` peer; and the same for the
parameter-server modes (``--servers``), with the time an update takes at the server.

    python bench/robust.py                                  # ring and full, N = 6, 300 steps; about 4 minutes
    python bench/robust.py --topologies torus --steps 150   # a quick look
    python bench/robust.py --topologies '' --servers ps-sync,ps-avg,diloco,ps-async   # the server modes only

Every run goes through the real launcher (gossip-sync, fixed deadlines, same seed, shards and
hyper-parameters). The byzantine peer (rank ``--byzantine``) sends uniform garbage in [-scale, scale]
instead of its weights at every round; it passes every wire check, so only aggregation can stop it.
Figures are over the honest peers only (the summary leaves the byzantine peer out): the accuracy of their
averaged model (``model-final.pt``), their mean test accuracy, and their consensus distance; wall time
is the launcher's, start-up included. A run whose peers fail (weights overflow to NaN, their snapshots
are then dropped as non-finite and their neighbours give up after ``--round-timeout``) is shown as
failed. On a ring (3 inputs) and a 6-peer torus (4 inputs) the trimmed mean is the median; on ``full``
(6 inputs) with ``--trim-fraction 0.2`` it averages the middle 4 values against the median's middle 2.

The server modes (``--servers``: ps-sync, ps-avg, diloco = ps-avg with ``--outer-optimizer nesterov``,
ps-async) run with ``--server-workers`` workers (5: the trimmed mean then averages the middle 3 of each
version's 5 contributions, the median takes the middle one), each rule that applies to the mode
(``SERVER_RULES``), without a fault and with worker ``--byzantine`` sending garbage of each of
``--server-scales`` (1e30: garbage; 0.01: random directions of about an honest gradient's norm, which no
norm bound can tell from one). Reported: the server's model's test accuracy and loss, the norm bound's
counts (clipped, dropped, unjudged), and the launcher's wall time; a run the server stopped (its model
blew up) shows the server's reason. Then, in this process, the time one update takes at the server on a
model of ``--update-params`` parameters (best of 5, one thread): each rule against the mean of the same
mode, the figure that grows with the model where the digits runs' wall times are start-up and noise.
Results: ``bench/results/robust/results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from straggler import free_port_range  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AGGREGATES = ("mean", "median", "trimmed-mean")
SERVER_FLAGS = {"ps-sync": ["--mode", "ps-sync"], "ps-avg": ["--mode", "ps-avg"],
                "diloco": ["--mode", "ps-avg", "--outer-optimizer", "nesterov"], "ps-async": ["--mode", "ps-async"]}
SERVER_RULES = {"ps-sync": ("mean", "median", "trimmed-mean", "norm-clip"), "ps-avg": AGGREGATES,
                "diloco": ("mean", "median"), "ps-async": ("mean", "norm-clip")}


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


def run_server(out: Path, args: argparse.Namespace, server: str, aggregate: str, scale: float | None) -> dict:
    workers = args.server_workers
    command = [sys.executable, "-m", "launch", "--nodes", str(workers), *SERVER_FLAGS[server], "--steps",
               str(args.steps), "--aggregate", aggregate, "--seed", str(args.seed), "--out", str(out), "--progress",
               "off", "--no-plot", "--base-port", str(free_port_range(workers + 1)), "--allow-divergence"]
    if scale is not None:
        command += ["--byzantine", str(args.byzantine), "--byzantine-scale", f"{scale:g}"]
    began = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    row = {"server": server, "aggregate": aggregate, "byzantine_scale": scale,
           "wall_seconds": time.monotonic() - began, "exit": proc.returncode}
    if proc.returncode != 0:
        return {**row, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines() if line.strip()]
    end = next(e for e in events if e["event"] == "end")
    return {**row, "accuracy": summary["accuracy"], "loss": summary["loss"], "norm_bound": end.get("norm_bound")}


def server_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = ["| mode | aggregate | fault | server's test acc | test loss | clipped / dropped / unjudged | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        fault = "none" if r["byzantine_scale"] is None else f"worker {args.byzantine}, scale {r['byzantine_scale']:g}"
        if r["exit"]:
            reason = r["error"].split("server: ", 1)[-1].split(" [full log")[0]
            cells = [f"stopped: {reason}", "", ""]
        else:
            bound = r["norm_bound"]
            counts = "" if bound is None else f"{bound['clipped']} / {bound['dropped']} / {bound['unjudged']}"
            cells = [f"{r['accuracy']:.4f}", f"{r['loss']:.4g}", counts]
        lines.append(f"| {r['server']} | {r['aggregate']} | {fault} | " + " | ".join(cells)
                     + f" | {r['wall_seconds']:.1f} |")
    return "\n".join(lines)


def update_times(params: int, workers: int, repeats: int = 5) -> list[dict]:
    """Seconds one server update takes on a model of ``params`` float32 parameters (8 MiB chunks), best of
    ``repeats``: ps-sync and ps-avg on ``workers`` contributions, ps-async on one (the norm bound judged)."""
    import torch
    from torch import nn

    from gossip.config import CoordinatorConfig
    from gossip.coordinator.core import Contribution
    from gossip.coordinator.modes import build_core
    from gossip.flat import FlatParams

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for server, rules in SERVER_RULES.items():
        if server == "diloco":
            continue  # the outer step's aggregation is ps-avg's; its optimizer step is the same for every rule
        batch = workers if server in ("ps-sync", "ps-avg") else 1
        times = {}
        for aggregate in rules:
            model = nn.Module()
            model.w = nn.Parameter(torch.zeros(params))
            flat = FlatParams(model, 8 << 20)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            mode = "ps-avg" if server == "ps-avg" else server
            core = build_core(mode, CoordinatorConfig(), flat, optimizer, workers, aggregate=aggregate)
            inputs = [Contribution(w, 0, 1, [torch.randn(v.shape, generator=generator) for v in flat.views()])
                      for w in range(workers)]
            for contribution in inputs:  # the norm bound's warm-up, so that each update below is judged
                core.update.apply([contribution], [0], 1)
            best = math.inf
            for repeat in range(repeats):
                chosen = inputs[:batch] if batch > 1 else [inputs[repeat % workers]]
                began = time.perf_counter()
                core.update.apply(chosen, [0] * len(chosen), 2 + repeat)
                best = min(best, time.perf_counter() - began)
            times[aggregate] = best
        for aggregate, seconds in times.items():
            rows.append({"server": server, "aggregate": aggregate, "contributions": batch, "params": params,
                         "seconds": seconds, "ratio_to_mean": seconds / times["mean"]})
    return rows


def update_table(rows: list[dict]) -> str:
    lines = ["| mode | aggregate | contributions per update | ms per update | x the mean's |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['server']} | {r['aggregate']} | {r['contributions']} | {1000 * r['seconds']:.1f} | "
              f"{r['ratio_to_mean']:.2f} |" for r in rows]
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
    parser.add_argument("--servers", default="", help="server modes to run too, comma-separated: "
                                                      + ", ".join(SERVER_FLAGS))
    parser.add_argument("--server-workers", type=int, default=5)
    parser.add_argument("--server-scales", default="1e30,0.01", help="garbage scales for the server modes")
    parser.add_argument("--update-params", type=int, default=1 << 22, help="model size of the update timings")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "robust")
    args = parser.parse_args()
    began = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows, server_rows, timings = [], [], []
    for topology in filter(None, args.topologies.split(",")):
        for scale in [None, *map(float, args.scales.split(","))]:
            for aggregate in AGGREGATES:
                name = f"{stamp}-{topology}-{aggregate}-{'none' if scale is None else f'{scale:g}'}"
                rows.append(run_one(args.out / name, args, topology, aggregate, scale))
                print(json.dumps(rows[-1]), flush=True)
    for server in filter(None, args.servers.split(",")):
        for scale in [None, *map(float, args.server_scales.split(","))]:
            for aggregate in SERVER_RULES[server]:
                name = f"{stamp}-{server}-{aggregate}-{'none' if scale is None else f'{scale:g}'}"
                server_rows.append(run_server(args.out / name, args, server, aggregate, scale))
                print(json.dumps(server_rows[-1]), flush=True)
    if args.servers:
        timings = update_times(args.update_params, args.server_workers)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    (args.out / "results.json").write_text(json.dumps({"command": sys.argv, "date": stamp, "machine": machine,
                                                       "seconds": time.monotonic() - began, "rows": rows,
                                                       "server_rows": server_rows, "update_times": timings},
                                                      indent=2))
    for part in (table(rows, args) if rows else "", server_table(server_rows, args) if server_rows else "",
                 update_table(timings) if timings else ""):
        if part:
            print(part + "\n")
    print(f"{time.monotonic() - began:.0f} s; {machine}")


if __name__ == "__main__":
    main()
