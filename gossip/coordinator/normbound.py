"""``--aggregate norm-clip``: a bound on the L2 norm of each gradient a parameter server applies, relative
to the norms of the gradients it applied recently.

An asynchronous server (ps-async, ps-ssp, ps-dcasgd) applies one gradient per update, so a coordinate-wise
median has nothing to choose from: what can still be judged is the gradient's size. This is adaptive norm
clipping as federated learning uses it against corrupted and outlying updates (Andrew, Thakkar et al.,
"Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, without its noise, as TensorFlow
Federated's ``robust_aggregator`` applies it: clip moderately large updates to a norm that tracks a
quantile of recent norms, and zero out extremely large ones). Here the quantile is the median, computed
exactly over recent norms rather than estimated online, and every worker has one vote in it:

- the reference r is the median over the workers of the median of each worker's last ``WINDOW`` recorded
  norms (for an even count, the lower of the two middle values). A worker that sends more often than the
  others, or sends only garbage, still moves r no further than one worker's vote: with fewer than half of
  the workers wrong, r lies between two honest workers' norms;
- a gradient of norm at most ``CLIP`` x r is applied as it is; one up to ``DROP`` x r is scaled down to
  ``CLIP`` x r (clipped, so an honest gradient from a noisy batch keeps its direction); one beyond
  ``DROP`` x r is dropped (no gradient is that large: it is garbage, e.g. ``--byzantine``'s);
- every judged gradient records min(norm, ``CLIP`` x r) as its worker's latest norm, so r follows the
  honest norms as they shrink during training, and when they all grow, r grows with them, by a factor of
  at most ``CLIP`` each time half of the workers' windows have been refilled: after every norm jumped 50
  times, gradients are dropped, then clipped, and back within bounds after 11 gradients per worker
  (``tests/test_ps_aggregate.py``);
- until ``MIN_INPUTS`` (3) workers have recorded a norm, there is no reference one bad worker cannot
  set: such a gradient's norm is recorded and the gradient is not applied (``unjudged``; 3 gradients at
  the start of a run, and again after a server restart, as the norms are not checkpointed).

The constants: on digits (sequential SGD at the server optimizer ps-async uses with 4 workers, 1,200
gradients), a gradient's norm over this reference had p99 2.7 and maximum 3.4, so ``CLIP`` = 3 clips
about 0.4 % of honest gradients, and ``DROP`` = 10 drops none. What a bad worker can still do: send a
wrong direction of norm up to ``CLIP`` x r at its share of the updates (bounded damage, not none; the
coordinate-wise median of ps-sync removes it). The norm covers the parameters' gradients only: float
buffers (BatchNorm statistics) are values, not gradients, and the server takes them from the gradients it
applies (not from an unjudged or dropped one) as it does without the bound.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from gossip.aggregate import MIN_INPUTS

CLIP = 3.0
DROP = 10.0
WINDOW = 8  # recorded norms per worker


class NormBound:
    def __init__(self) -> None:
        self.recent: dict[int, deque[float]] = {}
        self.counts: Counter[str] = Counter()  # "clipped", "dropped", "unjudged"
        self.last_reference: float | None = None

    def reference(self) -> float | None:
        """r (module docstring), or None while fewer than ``MIN_INPUTS`` workers have recorded a norm."""
        if len(self.recent) < MIN_INPUTS:
            return None
        return lower_median([lower_median(list(norms)) for norms in self.recent.values()])

    def factor(self, worker: int, norm: float) -> float:
        """What to multiply ``worker``'s gradient of L2 norm ``norm`` by before applying it: 1 (within
        bounds), ``CLIP`` x r / norm (clipped) or 0 (dropped, or unjudged); records its norm."""
        if not math.isfinite(norm) or norm < 0:  # the wire lets no non-finite value through; a guard all the same
            self.counts["dropped"] += 1
            return 0.0
        reference = self.reference()
        if reference is None:
            self._record(worker, norm)
            self.counts["unjudged"] += 1
            return 0.0
        self.last_reference = reference
        bound = CLIP * reference
        self._record(worker, min(norm, bound))
        if norm <= bound:
            return 1.0
        if norm > DROP * reference:
            self.counts["dropped"] += 1
            return 0.0
        self.counts["clipped"] += 1
        return bound / norm

    def _record(self, worker: int, norm: float) -> None:
        self.recent.setdefault(worker, deque(maxlen=WINDOW)).append(norm)

    def statistics(self) -> dict:
        """What the server's end event reports."""
        return {"clipped": self.counts["clipped"], "dropped": self.counts["dropped"],
                "unjudged": self.counts["unjudged"], "reference": self.last_reference}


def lower_median(values: list[float]) -> float:
    """The middle value of ``values``, for an even count the lower of the two middle ones."""
    return sorted(values)[(len(values) - 1) // 2]
