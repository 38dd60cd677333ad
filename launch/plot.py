"""``summary.png``: training loss and the evaluated headline metric (test accuracy, or charlm's validation
loss) against wall-clock time per peer, and the consensus distance per round on a log axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TITLES = {"accuracy": ("test accuracy", "accuracy"), "loss": ("validation loss", "nats per character")}


def plot_run(out: Path, events: list[list[dict[str, Any]]], trace: list[dict[str, float]], path: Path,
             headline: str = "accuracy") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    starts = [next((e["time"] for e in ev if e["event"] == "ready" and "time" in e), None) for ev in events]
    t0 = min((s for s in starts if s is not None), default=0.0)
    fig, (ax_loss, ax_acc, ax_cons) = plt.subplots(1, 3, figsize=(15, 4.2))
    for rank, ev in enumerate(events):  # checked events (launch/events.py): a time and a value, or left out
        steps = [e for e in ev if e["event"] == "step" and "time" in e and e.get("loss") is not None]
        evals = [e for e in ev if e["event"] == "eval" and "time" in e and e.get(headline) is not None]
        if steps:
            ax_loss.plot([e["time"] - t0 for e in steps], [e["loss"] for e in steps], lw=0.8, label=f"peer {rank}")
        if evals:
            ax_acc.plot([e["time"] - t0 for e in evals], [e[headline] for e in evals], marker=".", lw=1,
                        label=f"peer {rank}")
    ax_loss.set(title="training loss", xlabel="wall time since start (s)", ylabel="loss")
    title, unit = TITLES[headline]
    ax_acc.set(title=title, xlabel="wall time since start (s)", ylabel=unit)
    positive = [(row["round"], row["distance"]) for row in trace if row["distance"] > 0]
    if positive:
        ax_cons.semilogy(*zip(*positive), marker=".", lw=1)
    ax_cons.set(title="consensus distance", xlabel="round", ylabel="sqrt(mean |x_i - mean x|^2)")
    for axis in (ax_loss, ax_acc):
        if axis.lines and len(events) <= 16:
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
