"""Gradient updates through the server's optimizer: ps-sync (SSGD), ps-async (ASGD, optionally with a
staleness-scaled learning rate and soft synchronisation), ps-ssp and ps-dcasgd.

A batch's gradients are averaged, each first delay-compensated (DC-ASGD) and scaled by 1 / max(1, tau)
when ``staleness_lr`` is set (a learning rate set separately for each update from its staleness), then
written into the parameters' ``.grad`` and stepped with the server's optimizer (SGD with momentum, or
AdamW: its moments accumulate the compensated gradients g~, exactly as they accumulate plain gradients, so
compensation and momentum compose like any gradient correction), at the learning rate its schedule gives
the version the batch produces (``gossip/optim.py Schedule``).
With rate compensation (the asynchronous modes' default) a server stepping SGD keeps each such gradient
in place of its worker's previous one and steps with the mean of every worker's latest (``memory``,
``memory.py``); one stepping AdamW scales each by its worker's rate weight rbar / r_i (``Contribution.weight``,
``rates.py``). Compensation and staleness scaling act on a gradient once, when it arrives.
Buffers (BatchNorm statistics) are not trained: the server takes the mean of the values workers report.
"""

from __future__ import annotations

import torch

from gossip.coordinator.core import Contribution
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.memory import GradientMemory
from gossip.flat import FlatParams
from gossip.optim import Schedule


class GradientStep:
    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer, staleness_lr: bool = False,
                 compensation: DelayCompensation | None = None, schedule: Schedule = Schedule(),
                 memory: bool = False) -> None:
        self.flat = flat
        self.optimizer = optimizer
        self.staleness_lr = staleness_lr
        self.compensation = compensation
        self.schedule = schedule
        self.gradients = flat.point_gradients_into()  # writing here is what the optimizer steps with
        self.memory = GradientMemory(self.gradients) if memory else None  # rate compensation (memory.py)

    def apply(self, batch: list[Contribution], staleness: list[int], version: int) -> float:
        """Step to ``version`` with the batch's gradients; returns the learning rate the schedule gave it."""
        lr = self.schedule.apply(self.optimizer, version)
        for target in self.gradients:
            target.zero_()
        for contribution, tau in zip(batch, staleness):
            gradient = contribution.chunks
            if self.compensation is not None:
                gradient = self.compensation.compensate(contribution.worker, gradient)
            scale = 1.0 / max(1, tau) if self.staleness_lr else 1.0
            if self.memory is not None:
                self.memory.store(contribution.worker, gradient, scale)
                continue
            for target, g in zip(self.gradients, gradient):
                target.add_(g, alpha=scale * contribution.weight / len(batch))
        if self.memory is not None:  # every worker's latest gradient counts once
            self.memory.mean_into(self.gradients)
        average_buffers(self.flat, batch)
        self.optimizer.step()
        return lr

    def sent(self, worker: int) -> None:
        if self.compensation is not None:
            self.compensation.backup(worker)

    def left(self, worker: int) -> None:
        if self.memory is not None:
            self.memory.forget(worker)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "compensation": self.compensation.state_dict() if self.compensation is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.compensation is not None and state["compensation"] is not None:
            self.compensation.load_state_dict(state["compensation"])


def average_buffers(flat: FlatParams, batch: list[Contribution]) -> None:
    """Set each buffer (BatchNorm statistics) to the mean of the values in ``batch``."""
    for place in flat.buffers:
        values = [_slice(flat, c.chunks, place.segment, place.start, place.stop) for c in batch]
        flat.segments[place.segment][place.start:place.stop].copy_(torch.stack(values).mean(0))


def _slice(flat: FlatParams, chunks: list[torch.Tensor], segment: int, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of ``segment`` from tensors cut by ``flat.plan``."""
    parts = [chunk[max(start, a) - a:min(stop, b) - a]
             for chunk, (s, a, b) in zip(chunks, flat.plan) if s == segment and a < stop and b > start]
    return torch.cat(parts)
