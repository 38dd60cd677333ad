"""After a run: ``summary.json``, ``model-final.pt`` (the exact average of the peers' final models),
``summary.png``, and the summary table on stdout.

The run's product is ``model-final.pt``: the server's model in the ps-* modes, the push-sum weighted
average of the peers' models in the gossip modes. Its test accuracy is the headline (``accuracy`` in
summary.json, the first line of the results); the mean over the peers' own copies is secondary. A product
model that holds NaN or Inf, has blown up (``gossip/health.py``) or has a non-finite test loss is refused:
summary.json records the error and the launcher exits non-zero with one line saying so.

``python -m launch.summary DIR`` does the same for a run whose peers were started on their own (on several
hosts, or under torchrun): copy every host's output directory into DIR first."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gossip.config import RunConfig
from gossip.errors import ConfigError, Diverged, GossipError
from gossip.exit import exit_now
from gossip.health import model_problem
from gossip.recipes import recipe
from gossip.tasks import Task, build_task, context_for
from launch.events import read_events


def average_state_dicts(states: list[dict[str, torch.Tensor]],
                        weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating tensors (accumulated in float64), weighted by ``weights`` (push-sum
    weights: the network's model is sum_i w_i z_i / sum_i w_i) when given; other entries from the first."""
    w = torch.tensor(weights or [1.0] * len(states), dtype=torch.float64)
    w = w / w.sum()
    averaged = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            stacked = torch.stack([s[name].to(torch.float64) for s in states])
            total = torch.tensordot(w, stacked, dims=1)
            averaged[name] = total.to(first.dtype)
        else:
            averaged[name] = first.clone()
    return averaged


def consensus_distance(vectors: np.ndarray) -> float:
    """sqrt(mean_i |x_i - mean x|^2) over the rows of ``vectors``."""
    centred = vectors - vectors.mean(axis=0, keepdims=True)
    return float(np.sqrt((centred ** 2).sum(axis=1).mean()))


def flat_vector(state: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1).to(torch.float64) for t in state.values() if t.is_floating_point()]).numpy()


def consensus_trace(out: Path, ranks: list[int], numel: int) -> tuple[list[dict[str, float]], float, float]:
    """Distance per round from the sampled traces (scaled up when coordinates were sampled), and the
    largest drift of the (push-sum weighted) mean from its starting value, over the rounds every peer
    recorded, and its drift after the last round. Under adaptive deadlines the peers record a round at
    different moments, with mass in flight between them, so only the final drift must be ~0 there."""
    traces, weights = [], []
    for rank in ranks:
        with np.load(out / f"trace-{rank}.npz") as data:  # an NpzFile re-reads an array on every access
            traces.append({int(r): row for r, row in zip(data["rounds"], data["values"])})
            weights.append(dict(zip(map(int, data["rounds"]), data["weights"])))
    common = sorted(set.intersection(*(set(t) for t in traces)))
    scale = math.sqrt(numel / len(traces[0][common[0]]))
    rows, drift, mean0 = [], 0.0, None
    for round in common:
        stacked = np.stack([t[round] for t in traces]).astype(np.float64)
        mass = np.array([w[round] for w in weights])
        mean = mass @ stacked / mass.sum()  # push-sum: the conserved mean is weighted
        mean0 = mean if mean0 is None else mean0
        final_drift = float(np.linalg.norm(mean - mean0)) * scale
        drift = max(drift, final_drift)
        rows.append({"round": round, "distance": consensus_distance(stacked) * scale})
    return rows, drift, final_drift


def peer_result(rank: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    end = next((e for e in events if e["event"] == "end"), {})
    ready = next((e for e in events if e["event"] == "ready"), {})
    test = end.get("test", {})
    return {"rank": rank, "steps": end.get("step"), "rounds": end.get("rounds"), "shard": ready.get("shard"),
            "test_accuracy": test.get("accuracy"),
            "test_loss": test.get("loss"), "test": test, "wall_seconds": end.get("wall_seconds"),
            "bytes_sent": end.get("bytes_sent"), "bytes_received": end.get("bytes_received"),
            "wait_seconds": end.get("wait_seconds"), "samples_per_second": end.get("speed"),
            "step_seconds": end.get("step_seconds"), "neighbour_speeds": end.get("neighbour_speeds"),
            "staleness": end.get("staleness"), "dropped": end.get("dropped"), "weight": end.get("weight"),
            "deadline_misses": end.get("deadline_misses"), "late_mixed": end.get("late_mixed"),
            "stragglers": end.get("stragglers"), "max_rss_mb": end.get("max_rss_mb"), "routes": end.get("routes")}


def chronic_stragglers(peers: list[dict[str, Any]]) -> dict[str, list[int]]:
    """{straggler rank: ranks of the neighbours that reported it as chronic}."""
    reported: dict[str, list[int]] = {}
    for p in peers:
        for straggler in p.get("stragglers") or []:
            reported.setdefault(str(straggler), []).append(p["rank"])
    return dict(sorted(reported.items(), key=lambda item: int(item[0])))


def summarise(cfg: RunConfig, out: Path, wall_seconds: float, plot: bool = True,
              failed: list[str] | None = None) -> dict[str, Any]:
    """``failed`` names the processes that died for good (``--keep-going``): they are left out of the
    averages, the consensus distance and ``model-final.pt``; so are the ``--byzantine`` peers (fault
    injection), whose own models stay honest: what a run measures is what their garbage did to the others."""
    events = [read_events(out / f"peer-{rank}.jsonl") for rank in range(cfg.nodes)]
    peers = [peer_result(rank, ev) for rank, ev in enumerate(events)]
    byzantine = set(cfg.gossip.byzantine)
    finished = [rank for rank in range(cfg.nodes) if (out / f"model-{rank}.pt").exists() and rank not in byzantine]
    states = [torch.load(out / f"model-{rank}.pt", weights_only=True) for rank in finished]
    vectors = np.stack([flat_vector(s) for s in states])
    trace, drift, final_drift = consensus_trace(out, finished, vectors.shape[1])
    server = server_result(out) if cfg.gossip.parameter_server else None
    weights = [peers[rank]["weight"] if peers[rank]["weight"] is not None else 1.0 for rank in finished]
    task = build_task(cfg.task, context_for(cfg, 0))
    untrained = task.evaluate() if task.trains else {}  # every peer's model before its first step
    if server:
        product, final_metrics = torch.load(out / "model-final.pt", weights_only=True), server.get("test") or {}
    else:
        product = average_state_dicts(states, weights)
        final_metrics = evaluate_average(task, product, out)
    problem = product_problem(product, final_metrics)
    learned_nothing = None if problem else divergence(final_metrics, untrained, task.chance)
    accuracies = [p["test_accuracy"] for p in peers
                  if p["test_accuracy"] is not None and p["rank"] not in byzantine]
    losses = [p["test_loss"] for p in peers if p["test_loss"] is not None and p["rank"] not in byzantine]
    summary = {
        "mode": cfg.gossip.mode, "topology": None if cfg.gossip.parameter_server else cfg.gossip.topology,
        "nodes": cfg.nodes, "task": cfg.task,
        "steps": cfg.steps, "schedule": cfg.gossip.schedule, "rounds": cfg.total_rounds,
        "seed": cfg.gossip.seed, "wall_seconds": wall_seconds, "headline": recipe(cfg.task).headline,
        "accuracy": final_metrics.get("accuracy"),  # of the product model, model-final.pt
        "loss": final_metrics.get("loss"),  # its test (charlm: validation) loss
        "error": None, "data": dataset(events), "partition": cfg.partition, "optimizer": training(cfg),
        "peers": peers,
        "chronic_stragglers": chronic_stragglers(peers),
        "mean_test_accuracy": sum(accuracies) / len(accuracies) if accuracies else None,
        "mean_test_loss": sum(losses) / len(losses) if losses else None,
        "final_model": final_metrics, "consensus_distance": consensus_distance(vectors),
        "consensus_trace": trace, "mean_drift": drift, "final_mean_drift": final_drift, "spectral": spectral(cfg),
        "bytes_sent": sum(p["bytes_sent"] or 0 for p in peers), "failed": failed or [],
        "aggregate": cfg.gossip.aggregate, "byzantine": sorted(byzantine),
        "untrained_model": untrained, "diverged": learned_nothing,
    }
    if server:
        summary["server"] = server
    which = "the server's model" if server else "the peers' averaged model"
    if problem:
        summary["error"] = f"{which} (model-final.pt) is not a usable model: {problem}; {remedy(cfg, server)}"
    elif learned_nothing and not cfg.allow_divergence:
        summary["error"] = (f"the run diverged: {which} (model-final.pt) learned nothing: {learned_nothing}; "
                            f"{remedy(cfg, server)}, or pass --allow-divergence")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if summary["error"]:
        raise Diverged(summary["error"])
    if plot:
        from launch.plot import plot_run  # matplotlib costs about 2 s; only when asked for

        plot_run(out, events, trace, out / "summary.png", summary["headline"])
    print_table(summary, out)
    if learned_nothing:  # allowed (--allow-divergence), and still worth a line
        print(f"warning: the run diverged: {which} learned nothing: {learned_nothing}", file=sys.stderr)
    return summary


def dataset(events: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """What the peers trained on (the task's ``dataset``: name, size, hash), as the first peer reported it;
    ``differs`` lists the peers (rank: hash) whose data hash is another (hosts with another corpus)."""
    reported = [next((e.get("dataset") or {} for e in peer if e["event"] == "ready"), None) for peer in events]
    first = next((d for d in reported if d is not None), {})
    differs = {str(rank): d.get("sha256") for rank, d in enumerate(reported)
               if d is not None and d.get("sha256") != first.get("sha256")}
    return {**first, "differs": differs} if differs else first


def training(cfg: RunConfig) -> dict[str, Any]:
    """Each peer's optimizer and schedule, as resolved from the flags and the task's recipe."""
    return {"name": cfg.optimizer, "lr": cfg.lr, "schedule": cfg.lr_schedule, "warmup_steps": cfg.warmup_steps,
            "min_lr": cfg.min_lr, "weight_decay": cfg.weight_decay, "batch_size": cfg.batch_size,
            **({"betas": list(cfg.betas)} if cfg.optimizer == "adamw" else {"momentum": cfg.momentum})}


def remedy(cfg: RunConfig, server: dict[str, Any] | None) -> str:
    """What to change when the run's product model is unusable or learned nothing: keep the garbage of the
    --byzantine peers out of the mean, or else take smaller steps."""
    if cfg.gossip.byzantine and cfg.gossip.aggregate == "mean":
        return "the --byzantine peers' garbage reached the plain mean: use --aggregate median or trimmed-mean"
    return f"lower --lr (now {cfg.lr:g}){' or set --server-lr' if server and server.get('optimizer') else ''}"


def product_problem(state: dict[str, torch.Tensor], metrics: dict[str, Any]) -> str | None:
    """What makes the run's product model unusable, or None: non-finite or blown-up weights, or a
    non-finite test loss."""
    problem = model_problem(state.values())
    loss = metrics.get("loss")
    if problem is None and loss is not None and not math.isfinite(loss):
        problem = f"its test loss is {loss}"
    return problem


# A product model at most this far above chance has learned nothing: digits' untrained models measure
# 0.106-0.164 against chance 0.101 (seeds 0-2), and a model of one class is chance exactly
CHANCE_MARGIN = 0.02


def divergence(final: dict[str, Any], untrained: dict[str, Any], chance: float | None) -> str | None:
    """Why the run's product model learned nothing, in words, or None: its test loss is no lower than the
    untrained model's (any task), or its test accuracy is within ``CHANCE_MARGIN`` of ``chance`` (a task
    that measures accuracy). A model that blew up is ``product_problem``'s."""
    loss, before = final.get("loss"), untrained.get("loss")
    if loss is not None and before is not None and loss >= before:
        return f"its test loss {loss:.4g} is no lower than the untrained model's {before:.4g}"
    accuracy = final.get("accuracy")
    if chance is not None and accuracy is not None and accuracy <= chance + CHANCE_MARGIN:
        return (f"its test accuracy {accuracy:.3f} is chance (always guessing the commonest label scores "
                f"{chance:.3f})")
    return None


def evaluate_average(task: Task, final: dict[str, torch.Tensor], out: Path) -> dict[str, float]:
    """Write ``model-final.pt``, the exact (push-sum weighted) average of the peers' models, and return its
    test metrics (on ``task``'s model, which it loads)."""
    torch.save(final, out / "model-final.pt")
    if not task.trains:
        return {}
    task.model.load_state_dict(final)
    return task.evaluate()


def server_result(out: Path) -> dict[str, Any]:
    """The parameter server's end event: versions, updates, staleness histogram and its model's metrics
    (the server already wrote ``model-final.pt``)."""
    events = read_events(out / "server.jsonl")
    end = next((e for e in events if e["event"] == "end"), {})
    ready = next((e for e in events if e["event"] == "ready"), {})
    return {"optimizer": ready.get("optimizer"),
            **{key: end.get(key) for key in ("versions", "updates", "staleness", "test", "wall_seconds",
                                             "bytes_sent", "bytes_received", "dropped")}}


def spectral(cfg: RunConfig) -> dict[str, Any]:
    if cfg.nodes < 2 or cfg.gossip.parameter_server:
        return {}
    topology = cfg.gossip.build_topology()
    return {"slem": topology.slem(0), "contraction": topology.contraction(0), "directed": topology.directed,
            "time_varying": topology.time_varying}


def _cell(value: float | None, width: int, spec: str = "") -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


# (column title, width, key in a peer's test metrics, format) by the task's headline metric
METRIC_COLUMNS = {"accuracy": [("test acc", 8, "accuracy", ".4f"), ("test loss", 9, "loss", ".4f")],
                  "loss": [("val loss", 8, "loss", ".4f"), ("bits/chr", 8, "bits_per_char", ".3f"),
                           ("next acc", 8, "accuracy", ".4f")]}


def print_table(summary: dict[str, Any], out: Path) -> None:
    metrics = METRIC_COLUMNS[summary.get("headline", "accuracy")]
    columns = [("peer", 4), ("steps", 6), ("rounds", 6), *((title, width) for title, width, _, _ in metrics),
               ("waited s", 8), ("sent MB", 8), ("recv MB", 8)]
    shape = "a parameter server" if "server" in summary else summary["topology"]
    lines = [f"\n{summary['mode']} on {shape}, {summary['nodes']} peers, task {summary['task']}",
             " ".join(name.rjust(width) for name, width in columns)]
    for p in summary["peers"]:
        test = p.get("test") or {}
        values = [(p["rank"], ""), (p["steps"], ""), (p["rounds"], ""),
                  *((test.get(key), spec) for _, _, key, spec in metrics), (p["wait_seconds"], ".2f"),
                  ((p["bytes_sent"] or 0) / 1e6, ".2f"), ((p["bytes_received"] or 0) / 1e6, ".2f")]
        lines.append(" ".join(_cell(v, width, spec) for (v, spec), (_, width) in zip(values, columns)))
    which = "the server's model" if "server" in summary else "the peers' push-sum weighted average"
    final = summary.get("final_model") or {}
    if summary.get("headline") == "loss" and summary["loss"] is not None:
        bits = f"{final['bits_per_char']:.3f} bits per character, " if "bits_per_char" in final else ""
        accuracy = f"next-character accuracy {summary['accuracy']:.4f}; " if summary["accuracy"] is not None else ""
        lines.append(f"validation loss          {summary['loss']:.4f} nats ({bits}{accuracy}{which}, model-final.pt)")
        if summary["mean_test_loss"] is not None:
            lines.append(f"mean validation loss     {summary['mean_test_loss']:.4f}  (over the peers' own copies)")
    else:
        if summary["accuracy"] is not None:
            lines.append(f"accuracy                 {summary['accuracy']:.4f}  ({which}, model-final.pt)")
        if summary["mean_test_accuracy"] is not None:
            lines.append(f"mean test accuracy       {summary['mean_test_accuracy']:.4f}  (over the peers' own copies)")
    if "server" in summary:
        server = summary["server"]
        if server.get("optimizer"):
            optimizer = server["optimizer"]
            name, mu = {"adamw": ("AdamW", "beta1"), "nesterov": ("Nesterov SGD", "momentum")}.get(
                optimizer.get("name"), ("SGD", "momentum"))
            lines.append(f"server optimizer         {name} lr {optimizer['lr']:.4g}, {mu} {optimizer['momentum']:.4g} "
                         f"({optimizer['rule']})")
        lines.append(f"server updates           {server['updates']} (staleness histogram {server['staleness']})")
    data = summary.get("data") or {}
    if "sha256" in data:
        lines.append(f"data                     {data['name']}: {data['files']} files, {data['bytes'] / 1e6:.1f} MB, "
                     f"sha256 {data['sha256'][:12]}; --partition {summary['partition']}")
    if data.get("differs"):
        lines.append(f"warning                  peer(s) {', '.join(data['differs'])} trained on other data (another "
                     "hash): give every host the same --data")
    lines.append(f"consensus distance       {summary['consensus_distance']:.3e}")
    dropped = {p["rank"]: p["dropped"] for p in summary["peers"] if p.get("dropped")}
    if dropped:
        lines.append(f"dropped messages         {dropped} (by peer, by reason; see peer-<rank>.log)")
    if summary["byzantine"]:
        lines.append(f"byzantine (left out)     {', '.join(map(str, summary['byzantine']))} (sent garbage; "
                     f"--aggregate {summary['aggregate']})")
    if summary["failed"]:
        lines.append(f"died and left out        {', '.join(summary['failed'])}")
    for straggler, reporters in summary["chronic_stragglers"].items():
        lines.append(f"chronic straggler        peer {straggler} (missed its deadlines at peer(s) "
                     f"{', '.join(map(str, reporters))}; its messages were mixed late)")
    taus = [(int(t), n) for p in summary["peers"] for t, n in (p["staleness"] or {}).items()]
    if taus:
        mean_tau = sum(t * n for t, n in taus) / sum(n for _, n in taus)
        lines.append(f"staleness (own steps)    mean {mean_tau:.2f}, max {max(t for t, _ in taus)} "
                     f"(histograms per peer in summary.json)")
    lines.append(f"wall time                {summary['wall_seconds']:.1f} s")
    lines.append(f"bytes sent (all peers)   {summary['bytes_sent'] / 1e6:.1f} MB")
    plotted = "summary.png, " if (out / "summary.png").exists() else ""
    lines.append(f"results                  {out}/ (summary.json, {plotted}peer-<rank>.jsonl, model-*.pt)")
    print("\n".join(lines))


def wall_seconds_from_events(out: Path, nodes: int) -> float:
    """From the first peer's start to the last peer's end, by the peers' own clocks."""
    events = [e for rank in range(nodes) for e in read_events(out / f"peer-{rank}.jsonl")]
    starts = [e["time"] for e in events if e["event"] == "start"]
    ends = [e["time"] for e in events if e["event"] == "end"]
    return max(ends) - min(starts) if starts and ends else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.summary",
                                     description="Summarise a run whose peers' files were collected into DIR.")
    parser.add_argument("out", type=Path, metavar="DIR", help="holds config.json and every peer's files")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="write summary.png")
    parser.add_argument("--allow-divergence", action="store_true", help="exit 0 even when the run's model learned "
                        "nothing (test accuracy at chance, or loss no lower than untrained)")
    args = parser.parse_args(argv)
    try:
        cfg = RunConfig.from_dict(json.loads((args.out / "config.json").read_text()))
        if args.allow_divergence:
            cfg = dataclasses.replace(cfg, allow_divergence=True)
        missing = [f"{kind}-{rank}.{ext}" for rank in range(cfg.nodes) for kind, ext in
                   (("peer", "jsonl"), ("model", "pt"), ("trace", "npz")) if not (args.out / f"{kind}-{rank}.{ext}").exists()]
        if missing:
            raise ConfigError(f"{args.out} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; copy "
                              "every host's output directory into it (e.g. rsync -a HOST:DIR/ DIR/)")
        summarise(cfg, args.out, wall_seconds_from_events(args.out, cfg.nodes), plot=args.plot)
    except Diverged as exc:
        print(f"python -m launch.summary: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError, GossipError) as exc:
        print(f"python -m launch.summary: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_now(main())
