"""What the parameter server sends its workers: its weights as they are (compressed ps-avg: the change of
its public weights to those a worker holds, ``pseudograd.py Answers``), "end" with the weights to those the
run's end stops, and an acknowledgement to a hello from a worker whose contribution it holds. Every answer
names the step it answers and is logged (``reply`` or ``end-sent``, with the worker's clock and its lead
over the slowest worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gossip.config import GossipConfig
from gossip.coordinator.core import ServerCore
from gossip.coordinator.pseudograd import Answers
from gossip.flat import FlatParams
from gossip.link import Link
from gossip.metrics import EventLog
from gossip.net.wire import Header, encode, params_header


@dataclass
class Replies:
    config: GossipConfig
    rank: int
    flat: FlatParams
    core: ServerCore
    transport: Link
    events: EventLog
    answered: Callable[[int, float], None]  # (worker, when): it has our answer (its silence counts from then)
    answers: Answers | None = field(default=None, init=False)  # compressed ps-avg: our public weights, once serving

    def start(self) -> None:
        """Serving begins: compressed ps-avg's public copy starts as the weights (after a resume, those loaded)."""
        if self.config.compression.compress != "none":
            self.answers = Answers(self.flat, self.config.compression.compress, self.core.version)

    def contribution(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """A contribution's chunks as the core takes them (compressed ps-avg: decoded against our public weights)."""
        return chunks if self.answers is None else self.answers.decode_contribution(chunks)

    def send(self, workers: list[int], ending: list[int], whole: bool = False) -> None:
        """The current weights to ``workers`` (compressed ps-avg: the change of our public weights to those
        that hold their previous version, unless ``whole``), and to ``ending`` with "end"."""
        if not workers and not ending:
            return
        now = time.monotonic()
        if self.answers is not None:
            self.answers.advance(self.core.version)
        # one copy of the weights for those sent them as they are (compressed ps-avg: only "end")
        snapshot = self.flat.snapshot() if ending or self.answers is None else []
        for kind, whom in (("weights", workers), ("end", ending)):
            for worker in whom:  # each header names the step it answers
                sent, payload = (kind, snapshot) if kind == "end" or self.answers is None else \
                    self.answers.answer(worker, whole)
                clock = self.core.clocks[worker]
                header = params_header(sent, self.rank, self.flat.layout, self.flat.chunk_bytes,
                                       round=self.core.version, step=clock)
                self.answered(worker, now)
                self.events.write("reply" if kind == "weights" else "end-sent", worker=worker,
                                  version=self.core.version, clock=clock, lead=self.core.lead(worker))
                self.transport.post([worker], encode(header, payload), latest_only=False,
                                    timeout=self.config.timeouts.send_timeout)

    def acknowledge(self, worker: int) -> None:
        """Answer a hello from a worker whose contribution we hold: we are alive, its answer is coming."""
        ack = encode(Header(kind="hello", sender=self.rank, round=self.core.version, step=self.core.clocks[worker]))
        self.transport.post([worker], ack, latest_only=False, timeout=self.config.timeouts.send_timeout)
