"""What the parameter server does after each batch it applied, before anyone is sent the weights: an
``update`` event (its version, workers and their staleness), an ``eval`` every ``--eval-every`` versions, a
checkpoint when one is due, and the check that the weights are still a model (``gossip/health.py``):
``Diverged``, with the flags to change for this mode, once they hold NaN or Inf or have blown up.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossip.config import RunConfig, robust_rules
from gossip.coordinator.averaging import ParameterAverage
from gossip.coordinator.core import ServerCore
from gossip.coordinator.modes import SENDS_WEIGHTS, ServerOptimizer
from gossip.coordinator.server_checkpoint import ServerCheckpoint
from gossip.errors import Diverged
from gossip.flat import FlatParams
from gossip.health import model_problem
from gossip.metrics import EventLog
from gossip.tasks import Task


def steps_an_optimizer(core: ServerCore) -> bool:
    """Every gradient mode, and ps-avg with an outer optimizer; plain averaging has none."""
    return not isinstance(core.update, ParameterAverage)


@dataclass
class AppliedUpdates:
    cfg: RunConfig
    core: ServerCore
    flat: FlatParams
    task: Task
    optimizer: ServerOptimizer
    events: EventLog
    checkpoints: ServerCheckpoint

    def record(self) -> None:
        """Check, log, evaluate and checkpoint the batches the core applied since the last call."""
        if self.core.applied:
            self._check_weights(self.core.applied[-1].version)
        for applied in self.core.applied:
            self.events.write("update", version=applied.version, workers=applied.workers,
                              staleness=applied.staleness, active=len(self.core.active), lr=applied.lr)
            if self.cfg.eval_every and applied.version % self.cfg.eval_every == 0:
                self.events.write("eval", version=applied.version, contributions=self.core.contributed,
                                  **self.task.evaluate())
            if self.checkpoints.due(applied.version):
                self.checkpoints.save()
        self.core.applied = []

    def _check_weights(self, version: int) -> None:
        """Stop, before anyone is sent them, when the weights an update produced are no longer a model."""
        problem = model_problem(self.flat.segments)
        if problem is None:
            return
        config = self.cfg.gossip
        if config.robust.byzantine and config.robust.aggregate == "mean":
            advice = ("the --byzantine workers' garbage reached the plain mean: use --aggregate "
                      f"{robust_rules(config.mode)}")
        elif not steps_an_optimizer(self.core):
            advice = f"lower --lr (now {self.cfg.lr:g}) or --local-steps"
        elif config.mode in SENDS_WEIGHTS:
            advice = (f"lower --lr (now {self.cfg.lr:g}), --local-steps or --outer-lr (now {self.optimizer.lr:.4g}, "
                      f"momentum {self.optimizer.momentum:.4g})")
        else:
            advice = (f"lower --lr (now {self.cfg.lr:g}; the server stepped with peak lr {self.optimizer.lr:.4g}, "
                      f"momentum {self.optimizer.momentum:.4g}) or set --server-lr")
        raise Diverged(f"the server's model diverged at version {version}: {problem}; {advice}")
