"""One process's checkpoint file, as a peer and the parameter server both keep it: saved every ``every``
steps (or versions) unless the state is unfit, and on ``--resume`` the newest usable one restored, or none.

Every step of it reports in one warning and one event of the process's log: ``checkpoint-skipped`` (a state
``gossip/checkpoint.py`` refuses to write: NaN or Inf, a bad counter), ``checkpoint-failed`` (the write
failed, a full disk say: training goes on, the previous checkpoint stays valid), ``checkpoint-rejected``
(a file that does not read or does not fit) and ``resume``. The file format, the atomic write and the checks
are ``gossip/checkpoint.py``'s; what a process saves, how it checks and loads a state, and what it does
without a usable checkpoint are the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gossip import checkpoint
from gossip.errors import CheckpointError
from gossip.metrics import EventLog


@dataclass
class Checkpointer:
    """Saves, refuses and restores one checkpoint file (module docstring)."""

    path: Path
    name: str  # the log lines' prefix: "peer 3", "server"
    clock: str  # what ``every`` counts, in the skip's words and event: "step", "version"
    counters: Mapping[str, str]  # the state's counters (``gossip/checkpoint.py`` kinds)
    events: EventLog
    log: logging.Logger
    every: int = 0  # save when the clock is a multiple of it (0: never)
    # without a usable checkpoint: what the process does instead, in the warning's words; None: it cannot go
    # on, and ``resume`` fails in one line that names ``title`` and each file
    fallback: str | None = None
    title: str = ""

    def due(self, at: int) -> bool:
        """Whether the clock at ``at`` calls for a checkpoint."""
        return bool(self.every) and at % self.every == 0

    def save(self, state: dict[str, Any], at: int) -> None:
        """Write ``state`` (taken at ``at`` of the clock) atomically, the previous checkpoint kept as
        ``.prev.pt``. A state ``checkpoint.refusal`` finds unfit is not written, and a write that fails
        leaves the previous one: one warning and an event each, and no exception."""
        reason = checkpoint.refusal(state, self.counters)
        if reason is not None:
            self.log.warning("%s: checkpoint of %s %d not written: %s; the previous one is kept", self.name,
                             self.clock, at, reason)
            self.events.write("checkpoint-skipped", **{self.clock: at}, file=str(self.path), reason=reason)
            return
        try:
            checkpoint.write(state, self.path)
        except CheckpointError as exc:
            self.log.warning("%s: %s", self.name, exc)
            self.events.write("checkpoint-failed", message=str(exc))

    def resume(self, check: Callable[[Any, Path], Any], load: Callable[[dict[str, Any]], Mapping[str, Any]]
               ) -> dict[str, Any] | None:
        """The newest usable of our checkpoint and its ``.prev.pt`` (``checkpoint.restore``: ``check(state,
        file)`` raises ``CheckpointError`` for one that does not fit, before anything is loaded), put in place
        by ``load(state)``, which returns what the ``resume`` event says of it; None when neither is usable.
        Each rejected file gives one warning and a ``checkpoint-rejected`` event. ``CheckpointError`` (one
        line) when ``load`` fails past the checks, or when there are checkpoints, none is usable and there is
        no ``fallback``."""
        state, used, rejected = checkpoint.restore(self.path, check)
        if state is None and rejected and self.fallback is None:
            raise CheckpointError(f"{self.title} cannot resume: {'; '.join(rejected)}")
        for reason in rejected:
            self.log.warning("%s: %s", self.name, reason)
            self.events.write("checkpoint-rejected", message=reason)
        if state is None:
            if rejected:
                self.log.warning("%s: no usable checkpoint; %s", self.name, self.fallback)
            self.events.write("resume", found=False, rejected=len(rejected))
            return None
        try:
            described = load(state)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # past the checks: still one line
            raise CheckpointError(f"checkpoint {used} does not load: {str(exc).strip().splitlines()[0]}") from exc
        self.events.write("resume", found=True, file=str(used), rejected=len(rejected), **described)
        return state
