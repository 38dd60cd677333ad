"""How long a synchronous peer waits for each neighbour, learned from that neighbour's arrivals and pace.

A neighbour's *lateness* in a round is how long after the start of our wait its message arrived (0 when it
was already there). For each neighbour we keep the last ``window`` latenesses and wait for it at most

    deadline = min(round_timeout, max(floor, median + k * MAD))

seconds, MAD being the median absolute deviation: a robust "usual lateness plus k times its usual spread",
so that one hiccup neither sets the deadline nor stretches it, while a neighbour that is merely out of
phase (it started later, or was held up once) is waited for once and is back in phase afterwards.

Lateness alone cannot tell a neighbour that is out of phase from one that is slower: once we wait for a
slower one, its lateness settles at the gap between our paces and waiting looks normal. So the deadline is
also speed-aware: each message carries its sender's own pace (seconds per step, waits excluded) and steps
per round, and a neighbour whose seconds per round exceed ours by more than ``pace_tolerance`` (a share of
ours) is not waited for at all. Waiting for it would pace us to it; nothing is lost by not waiting, because
the averager is push-sum (``averagers/sync.py``): a message that misses its round is mixed when it arrives.

Until a neighbour has ``MIN_OBSERVATIONS`` latenesses and has told us its pace, we wait for it up to
``round_timeout`` as the fixed mode does; peers start at different moments, and waiting in the first
rounds aligns their phases. A neighbour that missed its deadline in more than ``straggler_fraction`` of its
last ``window`` rounds is a chronic straggler: reported once in the log and listed in ``statistics()``
(end event, summary).
"""

from __future__ import annotations

import logging
import statistics as stats
from collections import Counter, deque

log = logging.getLogger("gossip.deadlines")
MIN_OBSERVATIONS = 3


class ArrivalDeadlines:
    def __init__(self, rank: int, k: float, floor: float, window: int, straggler_fraction: float,
                 pace_tolerance: float) -> None:
        self.rank = rank
        self.k, self.floor, self.window = k, floor, window
        self.straggler_fraction, self.pace_tolerance = straggler_fraction, pace_tolerance
        self._lateness: dict[int, deque[float]] = {}
        self._missed: dict[int, deque[bool]] = {}
        self.misses: Counter[int] = Counter()
        self.waited: Counter[int] = Counter()
        self.stragglers: set[int] = set()

    def deadline(self, sender: int, ceiling: float, own_pace: float | None, sender_pace: float | None) -> float:
        """Seconds after the start of our wait beyond which we stop waiting for ``sender``; paces are
        seconds per round (None while unknown)."""
        seen = self._lateness.get(sender)
        if seen is None or len(seen) < MIN_OBSERVATIONS or not own_pace or sender_pace is None:
            return ceiling
        if sender_pace > (1 + self.pace_tolerance) * own_pace:
            return 0.0
        median = stats.median(seen)
        mad = stats.median(abs(x - median) for x in seen)
        return min(ceiling, max(self.floor, median + self.k * mad))

    def observe(self, sender: int, lateness: float) -> None:
        """Record one arrival ``lateness`` seconds after we started waiting for it (0 if it was there)."""
        self._lateness.setdefault(sender, deque(maxlen=self.window)).append(max(0.0, lateness))

    def settle(self, sender: int, missed: bool) -> None:
        """Record whether ``sender`` missed this round's deadline; report it once when that is chronic."""
        history = self._missed.setdefault(sender, deque(maxlen=self.window))
        history.append(missed)
        self.waited[sender] += 1
        self.misses[sender] += missed
        chronic = len(history) == self.window and sum(history) > self.straggler_fraction * self.window
        if chronic and sender not in self.stragglers:
            self.stragglers.add(sender)
            log.warning("peer %d: neighbour %d missed its deadline in %d of the last %d rounds; it is a chronic "
                        "straggler (its messages are mixed when they arrive, not waited for)",
                        self.rank, sender, sum(history), self.window)

    def statistics(self) -> dict:
        return {"deadline_misses": {str(j): self.misses[j] for j in sorted(self.waited)},
                "rounds_waited": {str(j): self.waited[j] for j in sorted(self.waited)},
                "stragglers": sorted(self.stragglers)}
