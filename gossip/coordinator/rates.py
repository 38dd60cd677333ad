"""Rate compensation for an asynchronous server whose optimizer is AdamW: each gradient weighted by
rbar / r_i, its worker's rate relative to the mean (``memory.py`` says why AdamW does not get the memory).

Weighting worker i's gradient by rbar / r_i (r_i: its contributions per second, rbar: their mean) makes
every worker's gradients move the model alike per unit of time; the fixed point is then the minimiser of
the plain mean, with the O(lr) bias of a constant-step asynchronous method (``bench/rate_fairness.py``:
0.114 and 0.021 at lr and lr / 4 with one worker of six 4x slower, where the rate-weighted rule stays at
0.14). The weight is the worker's mean time between contributions over its last ``SPAN`` (from its hello
for the first) times R, the server's contributions per second per active worker over its last ``WINDOW``
arrivals: rbar / r_i for a worker at a steady rate. Over a run the intervals telescope, so a worker's
weights add up to R times the time it took part however its pace varied, and averaging over ``SPAN``
intervals keeps one gradient that came after a pause (or that ps-ssp's bound held back) from counting
several times over on its own. Both measurements are the server's, never a worker's claim. Each weight is
bounded to [1 / ``MAX_RATE_FACTOR``, ``MAX_RATE_FACTOR``], and is 1 until ``MIN_ARRIVALS`` have arrived.
With equal speeds every weight is about 1, so the rule is the plain one.
"""

from __future__ import annotations

from collections import deque

from gossip.progress import MAX_RATE_FACTOR

WINDOW = 128  # arrivals R is measured over
SPAN = 8  # a worker's intervals its weight averages
MIN_ARRIVALS = 8


class ArrivalRates:
    def __init__(self, workers: int) -> None:
        self._times: list[deque[float]] = [deque(maxlen=SPAN + 1) for _ in range(workers)]  # hello, arrivals
        self._arrivals: deque[float] = deque(maxlen=WINDOW)  # when the latest contributions arrived

    def joined(self, worker: int, now: float) -> None:
        """A hello (first, or after a restart): its intervals count from here."""
        self._times[worker].clear()
        self._times[worker].append(now)

    def arrived(self, worker: int, now: float, active: int) -> float:
        """A contribution of ``worker`` at ``now``, with ``active`` workers in the run: its weight."""
        times = self._times[worker]
        times.append(now)
        self._arrivals.append(now)
        rate = self.mean_rate(active)
        if len(times) < 2 or rate is None:
            return 1.0
        interval = (times[-1] - times[0]) / (len(times) - 1)
        return min(MAX_RATE_FACTOR, max(1.0 / MAX_RATE_FACTOR, interval * rate))

    def mean_rate(self, active: int) -> float | None:
        """R: contributions per second per active worker over the window (None: too few yet)."""
        if len(self._arrivals) < MIN_ARRIVALS or active < 1:
            return None
        span = self._arrivals[-1] - self._arrivals[0]
        return (len(self._arrivals) - 1) / active / span if span > 0 else None
