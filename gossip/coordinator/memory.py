"""The memory of an asynchronous parameter server with rate compensation: each worker's latest gradient,
and their mean, which the server steps with at every arrival (SAG, Schmidt, Le Roux & Bach, 2017; MIFA,
Gu et al., NeurIPS 2021).

An asynchronous server that applies each gradient as it arrives lets a worker that computes twice as fast
contribute twice the gradients: the model then minimises a mean of the workers' objectives weighted by
their rates, and with data that differs between workers it is a model of the fast workers' data. Stepping
with the mean of every worker's latest gradient instead counts each worker once, whatever its rate. At a
fixed point every stored gradient was taken at the same weights, so their mean is the mean objective's
gradient there: the fixed point is exact, staleness costs no bias, no rate has to be measured, and no
gradient is amplified (weighting a slow worker's gradient by rbar / r_i instead leaves an O(lr) bias, and
its jumps, 3.5x a fast worker's for one four times slower, are what is left at the end;
``bench/rate_fairness.py``). The price is one stored gradient per worker at the server, and a worker that
leaves must take its gradient with it (``forget``), or it would pull the model forever.

Only a server that steps SGD keeps a memory. With AdamW the mean of N gradients, N - 1 of them the same
as in the previous step, is a steady direction that AdamW's normalisation turns into a full step at every
arrival, N times a round where a fresh noisy gradient's would partly cancel: on the language model (4
workers, iid) ps-async ended at 1.455 times ps-sync's loss, against 1.351 with the weights that an AdamW
server uses instead (``rates.py``: each gradient weighted rbar / r_i, at equal speeds the plain rule;
BENCHMARKS.md).

The sum is kept running (a worker's new gradient minus its old one), refreshed from the stored gradients
every ``REFRESH`` updates so that rounding does not accumulate. The mean is over the workers with a stored
gradient: the first updates of a run, or after a server restart, average fewer (the memory is not
checkpointed; it refills with each worker's next gradient).
"""

from __future__ import annotations

import torch

REFRESH = 256  # updates between two sums computed afresh


class GradientMemory:
    def __init__(self, like: list[torch.Tensor]) -> None:
        self.total = [torch.zeros_like(t) for t in like]
        self.latest: dict[int, list[torch.Tensor]] = {}
        self._updates = 0

    def store(self, worker: int, gradient: list[torch.Tensor], scale: float = 1.0) -> None:
        """``scale`` x ``gradient`` (chunks; copied) replaces ``worker``'s stored gradient."""
        old = self.latest.get(worker)
        if old is None:
            old = self.latest[worker] = [torch.zeros_like(t) for t in self.total]
        for total, stored, g in zip(self.total, old, gradient):
            total.sub_(stored)
            stored.copy_(g)
            if scale != 1.0:
                stored.mul_(scale)
            total.add_(stored)
        self._updates += 1
        if self._updates % REFRESH == 0:
            self._refresh()

    def forget(self, worker: int) -> None:
        """A worker left: its gradient no longer counts."""
        old = self.latest.pop(worker, None)
        if old is not None:
            self._refresh()

    def mean_into(self, targets: list[torch.Tensor]) -> None:
        """Write the mean of the stored gradients into ``targets`` (zeros when none is stored)."""
        count = len(self.latest)
        for target, total in zip(targets, self.total):
            if count:
                torch.div(total, count, out=target)
            else:
                target.zero_()

    def _refresh(self) -> None:
        for index, total in enumerate(self.total):
            total.zero_()
            for stored in self.latest.values():
                total.add_(stored[index])
