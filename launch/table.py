"""The summary table a run ends with on stdout, from summary.json's content (``launch/summary.py``): one
row per peer, then the product model's headline metric and the run's other results, one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
        bits = f"{final['bits_per_char']:.3f} bits per character, " if final.get("bits_per_char") is not None else ""
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
    if all(data.get(key) is not None for key in ("name", "files", "bytes", "sha256")):
        lines.append(f"data                     {data['name']}: {data['files']} files, {data['bytes'] / 1e6:.1f} MB, "
                     f"sha256 {data['sha256'][:12]}; --partition {summary['partition']}")
    if data.get("differs"):
        lines.append(f"warning                  peer(s) {', '.join(data['differs'])} trained on other data (another "
                     "hash): give every host the same --data")
    if summary["consensus_distance"] is not None:
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
    sender = "all peers" if "server" not in summary else "workers, server"
    lines.append(f"{f'bytes sent ({sender})':<24} {summary['bytes_sent'] / 1e6:.1f} MB")
    plotted = "summary.png, " if (out / "summary.png").exists() else ""
    lines.append(f"results                  {out}/ (summary.json, {plotted}peer-<rank>.jsonl, model-*.pt)")
    print("\n".join(lines))
