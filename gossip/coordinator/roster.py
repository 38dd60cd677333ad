"""The parameter server's record of its workers and its checks on them: who joined and who said bye, when
each was last heard from, the plausibility checks that drop a contribution or bye that cannot be the
worker's own (counted by reason: the ``implausible`` of the server's end event), and which of the workers
it waits for have been silent for a whole timeout.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from gossip.config import GossipConfig
from gossip.coordinator.core import ServerCore
from gossip.errors import PeerTimeout
from gossip.net.wire import Message

log = logging.getLogger("gossip.server")


class Roster:
    def __init__(self, config: GossipConfig, workers: int, core: ServerCore, missing_worker: str) -> None:
        """``missing_worker``: ``--missing-worker``, what a worker's silence does once all have joined."""
        self.config = config
        self.workers = workers
        self.core = core
        self.missing_worker = missing_worker
        self.joined: set[int] = set()
        self.finished: set[int] = set()  # said bye
        self.started = time.monotonic()
        self.last_heard: dict[int, float] = {}  # worker -> its last message, or our last answer to it
        self.dropped: Counter[str] = Counter()  # implausible contributions (the transport counts the rest)

    def heard(self, worker: int, at: float | None = None) -> None:
        """``worker`` sent a message, or (``at``) had our answer: its silence counts from then."""
        self.last_heard[worker] = time.monotonic() if at is None else at

    def holds_contribution_of(self, worker: int) -> bool:
        return worker in self._waiting()

    def plausible(self, message: Message) -> bool:
        """A worker waits for our answer before its next contribution, and cannot have computed on a
        version we never sent: anything else is a replay or a lie, dropped and counted."""
        worker, version = message.header.sender, message.header.version
        # (a compressed change is one from our weights of its version: only the current one is still ours)
        stale = self.config.compression.compress != "none" and version < self.core.version
        reason = ("not-joined" if worker not in self.joined else "duplicate" if worker in self._waiting()
                  else "version" if version > self.core.version or stale else None)
        if reason is None:
            return True
        self.dropped[reason] += 1
        log.warning("server dropped a contribution from worker %d (%s): version %d, ours %d", worker, reason,
                    version, self.core.version)
        return False

    def plausible_bye(self, message: Message) -> bool:
        """A worker says bye once it has our answer to its last contribution, naming its step, which that
        contribution carried: a bye that does not fit is someone else's, dropped and counted."""
        worker, step = message.header.sender, message.header.step
        reason = ("not-joined" if worker not in self.joined else "bye-waiting" if worker in self._waiting()
                  else "bye-step" if step != self.core.clocks[worker] else None)
        if reason is None:
            return True
        self.dropped[reason] += 1
        log.warning("server dropped a bye from worker %d (%s): step %d, its last contribution's %s", worker,
                    reason, step, self.core.clocks[worker])
        return False

    def wait_seconds(self) -> float:
        timeouts = self.config.timeouts
        return timeouts.startup_timeout if len(self.joined) < self.workers else timeouts.round_timeout

    def gone(self) -> list[int]:
        """Workers we wait for that sent nothing for a whole timeout, which the server goes on without
        (``--missing-worker continue``, as soft synchronisation does); ``PeerTimeout`` naming them instead
        under ``--missing-worker fail`` or while not every worker has joined."""
        now, limit = time.monotonic(), self.wait_seconds()
        waiting_on = sorted(self.core.active - self._waiting())
        silent = [w for w in waiting_on if now - self.last_heard.get(w, self.started) > limit]
        if silent and (self.missing_worker == "fail" or len(self.joined) < self.workers):
            raise PeerTimeout(self._silence(silent))
        return silent

    def _silence(self, silent: list[int]) -> str:
        missing = sorted(set(range(self.workers)) - self.joined)
        if missing:
            return (f"the parameter server heard nothing from worker(s) {', '.join(map(str, missing))} within "
                    f"{self.config.timeouts.startup_timeout:g} s (--startup-timeout)")
        return (f"the parameter server heard nothing from worker(s) {', '.join(map(str, silent))} for "
                f"{self.config.timeouts.round_timeout:g} s (--round-timeout) while waiting for them "
                f"(--missing-worker continue goes on without them)")

    def _waiting(self) -> set[int]:
        """Workers whose contribution the core holds back or has yet to apply: they wait for our answer."""
        return {c.worker for c in self.core.pending} | self.core.held
