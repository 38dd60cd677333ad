"""Flow control on a link that has no acknowledgements: the neighbour's own messages to us answer ours.

A neighbour that sends to us is stepping, so once it has sent us something since our last message to it,
that message is mixed at its next step. Until then at most ``window`` of our messages wait unanswered on
the link; beyond that we hold the next one back. Push-sum (``gossip/averagers/pushsum.py``) keeps the
share of a held-back message, so a slow neighbour holds at most ``window`` messages of ours and our mass
stays with us instead of piling up unmixed in its mailbox. A neighbour that does not send to us (a
directed graph) cannot answer, and its link is not held back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class FlowWindow:
    def __init__(self, window: int) -> None:
        self.window = window
        self._heard_mark: dict[int, int] = {}  # out-neighbour -> messages we had from it at its last answer
        self._unanswered: Counter[int] = Counter()  # out-neighbour -> our messages since it last sent to us
        self.held_back: Counter[int] = Counter()  # out-neighbour -> messages not sent (flow control)

    def ready(self, dest: int, heard: int, answers_us: bool) -> bool:
        """May we send to ``dest``, from which we have had ``heard`` messages so far? Always until our first
        message to it, and always where it does not send to us."""
        if dest not in self._heard_mark or not answers_us:
            return True
        return heard > self._heard_mark[dest] or self._unanswered[dest] < self.window

    def sent(self, dest: int, heard: int) -> None:
        """A message to ``dest`` left, when we had had ``heard`` messages from it."""
        if heard > self._heard_mark.get(dest, -1):
            self._heard_mark[dest], self._unanswered[dest] = heard, 0
        self._unanswered[dest] += 1

    def hold(self, dests: Iterable[int]) -> None:
        self.held_back.update(dests)

    def statistics(self) -> dict[str, int]:
        return {str(k): n for k, n in sorted(self.held_back.items())}
