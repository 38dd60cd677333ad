"""The parameter server's checkpoint: its weights, ``ServerCore``'s state and the workers that joined, saved
every ``--checkpoint-every`` versions through ``gossip/checkpointer.py``, and on ``--resume`` checked to fit
this server (model, counters, workers, the mode's update state and DC-ASGD's backups) before anything is
loaded. A server has no neighbours to take a model from: without a usable checkpoint it cannot resume.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gossip import checkpoint
from gossip.checkpointer import Checkpointer
from gossip.coordinator.core import ServerCore
from gossip.coordinator.roster import Roster
from gossip.device import cpu_state
from gossip.metrics import EventLog
from gossip.tasks import Task

log = logging.getLogger("gossip.server")
# The counters of the server's checkpoint (``gossip/checkpoint.py`` kinds)
CHECKPOINT_COUNTERS = {"joined": checkpoint.COUNTS, "core.contributed": checkpoint.COUNT,
                       "core.version": checkpoint.COUNT, "core.updates": checkpoint.COUNT,
                       "core.clocks": checkpoint.COUNTS, "core.active": checkpoint.COUNTS,
                       "core.staleness": checkpoint.COUNT_MAP}


class ServerCheckpoint:
    def __init__(self, out: Path, every: int, events: EventLog, task: Task, core: ServerCore, roster: Roster,
                 mode: str) -> None:
        self.task = task
        self.core = core
        self.roster = roster
        self.mode = mode
        self.file = Checkpointer(out / "checkpoint-server.pt", "server", "version", CHECKPOINT_COUNTERS,
                                 events, log, every, title="the parameter server")

    def due(self, version: int) -> bool:
        return self.file.due(version)

    def save(self) -> None:
        """The weights and the core's state, atomically, the previous checkpoint kept as ``.prev.pt``; a
        state with NaN or Inf or a bad counter is not written (one warning, a ``checkpoint-skipped`` event)."""
        state = {"model": cpu_state(self.task.model), "core": self.core.state_dict(),
                 "joined": sorted(self.roster.joined)}
        self.file.save(state, self.core.version)

    def validate(self, state: object, path: Path) -> None:
        """``CheckpointError`` (one line: the file and what is wrong) unless ``state``, read from ``path``,
        fits this server (checked before anything is loaded)."""
        problem = self._problem(state)
        if problem is not None:
            raise checkpoint.unusable(path, problem)

    def resume(self) -> None:
        """Continue from our newest usable checkpoint (that one, else the ``.prev.pt`` before it, each
        checked before anything is loaded), if there is one; workers re-join and get its weights. With
        checkpoints and none usable, fail in one line naming each file and what is wrong."""
        self.file.resume(self.validate, self._load)

    def _problem(self, state: object) -> str | None:
        update = self.core.update
        optimizer = getattr(update, "optimizer", None)
        problem = checkpoint.fit_problem(
            state, keys=("model", "core", "joined"), counters=CHECKPOINT_COUNTERS,
            model=self.task.model.state_dict(), optimizers={"core.update.optimizer": optimizer} if optimizer else {})
        if problem is not None:
            return problem
        core, workers = state["core"], self.roster.workers
        if len(core["clocks"]) != workers:
            return f"'core.clocks' has {len(core['clocks'])} entries for {workers} workers"
        if any(worker >= workers for worker in [*core["active"], *state["joined"]]):
            return f"it names workers beyond this run's {workers}"
        if not isinstance(core["update"], dict) or set(core["update"]) != set(update.state_dict()):
            return f"'core.update' does not fit --mode {self.mode}"
        compensation = getattr(update, "compensation", None)
        if compensation is not None:
            saved = core["update"]["compensation"]
            if not (isinstance(saved, dict) and isinstance(saved.get("backups"), dict)
                    and all(checkpoint.is_count(w) and w < workers for w in saved["backups"])):
                return "'core.update.compensation' holds no backups per worker"
            for worker, backup in saved["backups"].items():
                problem = checkpoint.tensors_fit_problem(backup, compensation.weights,
                                                         f"the DC-ASGD backup of worker {worker}")
                if problem is not None:
                    return problem
            return checkpoint.tensors_fit_problem(saved.get("mean_square"), compensation.mean_square,
                                                  "'core.update.compensation.mean_square'")
        return None

    def _load(self, state: dict) -> dict:
        """Put a checked checkpoint's weights, core and workers in place; what the ``resume`` event says."""
        self.task.model.load_state_dict(state["model"])
        self.core.load_state_dict(state["core"])
        self.roster.joined = set(state["joined"])
        return {"version": self.core.version}
