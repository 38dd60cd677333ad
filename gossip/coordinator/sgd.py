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

With ``--aggregate median`` or ``trimmed-mean`` (ps-sync) the batch's gradients, buffers included, are
combined coordinate-wise instead (``gossip/aggregate.py``); with ``--aggregate norm-clip`` each gradient
is first scaled by what its norm allows (``normbound.py``: 1, less when clipped, 0 when dropped), before
delay compensation, staleness scaling and the memory, and the mean is over the gradients not dropped; a
batch of dropped gradients leaves the weights, the memory and the optimizer's state as they were.
With ``--aggregate mean`` none of this runs: the update is the one above, bit for bit.
"""

from __future__ import annotations

import math

import torch

from gossip.aggregate import aggregate_into_
from gossip.config import COORDINATE_WISE
from gossip.coordinator.core import Contribution
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.memory import GradientMemory
from gossip.coordinator.normbound import NormBound
from gossip.flat import FlatParams
from gossip.optim import Schedule


class GradientStep:
    def __init__(self, flat: FlatParams, optimizer: torch.optim.Optimizer, staleness_lr: bool = False,
                 compensation: DelayCompensation | None = None, schedule: Schedule = Schedule(),
                 memory: bool = False, aggregate: str = "mean", trim_fraction: float = 0.2) -> None:
        self.flat = flat
        self.aggregate, self.trim_fraction = aggregate, trim_fraction
        self.bound = NormBound() if aggregate == "norm-clip" else None
        self.optimizer = optimizer
        self.staleness_lr = staleness_lr
        self.compensation = compensation
        self.schedule = schedule
        self.gradients = flat.point_gradients_into()  # writing here is what the optimizer steps with
        self.memory = GradientMemory(self.gradients) if memory else None  # rate compensation (memory.py)

    def apply(self, batch: list[Contribution], staleness: list[int], version: int) -> float:
        """Step to ``version`` with the batch's gradients; returns the learning rate the schedule gave it."""
        lr = self.schedule.apply(self.optimizer, version)
        if self.aggregate in COORDINATE_WISE:
            aggregate_into_(self.gradients, [c.chunks for c in batch], self.aggregate, self.trim_fraction)
            average_buffers(self.flat, [self.gradients])  # the buffers' aggregate, from the same pass
            self.optimizer.step()
            return lr
        for target in self.gradients:
            target.zero_()
        factors = [1.0] * len(batch) if self.bound is None else \
            [self.bound.factor(c.worker, parameter_norm(self.flat, c.chunks)) for c in batch]
        kept = [(c, tau, f) for c, tau, f in zip(batch, staleness, factors) if f > 0.0]
        if not kept:  # every gradient dropped or unjudged: the version changes nothing (no momentum step either)
            return lr
        for contribution, tau, factor in kept:
            gradient = contribution.chunks
            if self.compensation is not None:
                if factor != 1.0:  # clipped before compensation, whose g * g would square garbage
                    gradient, factor = [g * factor for g in gradient], 1.0
                gradient = self.compensation.compensate(contribution.worker, gradient)
            scale = (1.0 / max(1, tau) if self.staleness_lr else 1.0) * factor
            if self.memory is not None:
                self.memory.store(contribution.worker, gradient, scale)
                continue
            for target, g in zip(self.gradients, gradient):
                target.add_(g, alpha=scale * contribution.weight / len(kept))
        if self.memory is not None:  # every worker's latest gradient counts once
            self.memory.mean_into(self.gradients)
        average_buffers(self.flat, [c.chunks for c, _, _ in kept])
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


def average_buffers(flat: FlatParams, models: list[list[torch.Tensor]]) -> None:
    """Set each buffer (BatchNorm statistics) to the mean of its values in ``models`` (chunks cut by
    ``flat.plan``, e.g. the contributions' ``chunks``)."""
    for place in flat.buffers:
        values = [torch.cat(_parts(flat, chunks, place.segment, place.start, place.stop)) for chunks in models]
        flat.segments[place.segment][place.start:place.stop].copy_(torch.stack(values).mean(0))


def parameter_norm(flat: FlatParams, chunks: list[torch.Tensor]) -> float:
    """The L2 norm of the parameters' part of ``chunks`` (a gradient as workers send it; buffers hold values,
    not gradients). A sum of squares that overflows its dtype (garbage near the largest float) is taken
    again in float64, so the norm is finite for every finite input."""
    if flat.buffers:
        parts = [part for place in flat.parameters
                 for part in _parts(flat, chunks, place.segment, place.start, place.stop)]
    else:
        parts = chunks
    total = 0.0
    for part in parts:
        norm = float(torch.linalg.vector_norm(part))
        if not math.isfinite(norm):
            norm = float(torch.linalg.vector_norm(part, dtype=torch.float64))
        total += norm * norm
    return math.sqrt(total)


def _parts(flat: FlatParams, chunks: list[torch.Tensor], segment: int, start: int, stop: int) -> list[torch.Tensor]:
    """Elements [start, stop) of ``segment`` from tensors cut by ``flat.plan``, as views of the chunks."""
    return [chunk[max(start, a) - a:min(stop, b) - a]
            for chunk, (s, a, b) in zip(chunks, flat.plan) if s == segment and a < stop and b > start]
