"""One live progress display in the launcher, fed by the peers' event logs.

On a terminal: a table with one row per peer, redrawn in place (rich). Otherwise: one plain line every
few seconds. Never one bar per process writing over each other.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.events import EventTail


@dataclass
class PeerState:
    status: str = "starting"
    step: int = 0
    round: int = 0
    loss: float | None = None
    accuracy: float | None = None  # the latest evaluation's headline metric: accuracy, or loss (charlm)
    bytes_sent: int = 0
    speed: float = 0.0
    wait_seconds: float = 0.0

    def apply(self, event: dict[str, Any], headline: str = "accuracy") -> None:
        kind = event.get("event")
        if kind == "ready":
            self.status = "running"
        elif kind == "step":
            for name in ("step", "round", "loss", "bytes_sent", "speed", "wait_seconds"):
                if name == "loss" or event.get(name) is not None:  # null: a non-finite value (gossip/metrics.py)
                    setattr(self, name, event.get(name, getattr(self, name)))
        elif kind == "eval":
            self.accuracy = event.get(headline, self.accuracy)
        elif kind == "end":
            self.status = "done"
            self.round = event.get("rounds", self.round)
            self.accuracy = event.get("test", {}).get(headline, self.accuracy)
        elif kind in ("error", "stopped"):
            self.status = kind


class Progress:
    def __init__(self, out: Path, nodes: int, steps: int, mode: str, rounds: int = 0,
                 headline: str = "accuracy") -> None:
        """``rounds`` > 0: the run lasts that many rounds (schedule "time"), which is then the progress shown;
        ``headline``: the evaluated metric shown, "accuracy" or (charlm) the validation "loss"."""
        self.headline = headline
        self.label = {"accuracy": "test acc", "loss": "val loss"}[headline]
        self.tails = [EventTail(out / f"peer-{rank}.jsonl") for rank in range(nodes)]
        self.peers = [PeerState() for _ in range(nodes)]
        self.steps = steps
        self.rounds = rounds
        self.started = time.monotonic()
        if mode == "auto":
            mode = "live" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self._live = None
        self._last_line = 0.0

    def __enter__(self) -> Progress:
        if self.mode == "live":
            from rich.live import Live

            self._live = Live(self._table(), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.update()
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc_info)

    def update(self) -> None:
        for tail, peer in zip(self.tails, self.peers):
            for event in tail.read_new():
                peer.apply(event, self.headline)
        if self._live is not None:
            self._live.update(self._table())
        elif self.mode == "plain" and time.monotonic() - self._last_line >= 5:
            self._last_line = time.monotonic()
            print(self._line(), flush=True)

    def _line(self) -> str:
        unit, total = ("round", self.rounds) if self.rounds else ("step", self.steps)
        done = [getattr(p, unit) for p in self.peers]
        losses = [p.loss for p in self.peers if p.loss is not None]
        accs = [p.accuracy for p in self.peers if p.accuracy is not None]
        running = sum(p.status == "running" for p in self.peers)
        parts = [f"[{time.monotonic() - self.started:7.1f} s]", f"{unit} {min(done)}-{max(done)}/{total}",
                 f"{running}/{len(self.peers)} running"]
        if losses:
            parts.append(f"loss {sum(losses) / len(losses):.4f}")
        if accs:
            parts.append(f"{self.label} {sum(accs) / len(accs):.3f}")
        return " | ".join(parts)

    def _table(self):
        from rich import box
        from rich.table import Table

        table = Table(title=f"gossip peers, {time.monotonic() - self.started:.1f} s", title_justify="left",
                      box=box.SIMPLE_HEAD, padding=(0, 1))
        for column in ("peer", "status", "step", "round", "loss", self.label, "smp/s", "wait s", "sent MB"):
            table.add_column(column, justify="right", no_wrap=True)
        for rank, p in enumerate(self.peers):
            step, round = (str(p.step), f"{p.round}/{self.rounds}") if self.rounds else (f"{p.step}/{self.steps}",
                                                                                      str(p.round))
            table.add_row(str(rank), p.status, step, round,
                          "-" if p.loss is None else f"{p.loss:.4f}",
                          "-" if p.accuracy is None else f"{p.accuracy:.3f}", f"{p.speed:.0f}",
                          f"{p.wait_seconds:.1f}", f"{p.bytes_sent / 1e6:.1f}")
        return table
