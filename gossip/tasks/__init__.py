"""Tasks: what a peer trains. Built-in: ``digits`` and ``consensus``; or ``package.module:function``.

A user task is a function ``make_task(ctx: TaskContext) -> Task``. It is called once in every peer
process with that peer's ``ctx`` and must build the same model on every peer (seed it with ``ctx.seed``)
and train on the peer's own shard (use ``ctx.rank`` and ``ctx.world_size``)::

    def make_task(ctx: TaskContext) -> Task:
        model = MyNet()                                   # same initial weights on every peer
        opt = torch.optim.SGD(model.parameters(), lr=ctx.lr, momentum=ctx.momentum)
        batches = my_shard_batches(ctx.rank, ctx.world_size, ctx.batch_size, seed=ctx.seed)
        def train_step() -> float:                        # one local step; returns the loss
            x, y = next(batches)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        def evaluate() -> dict[str, float]:               # held-out metrics of the model as it is now
            ...
            return {"accuracy": acc, "loss": test_loss}
        return Task(model, train_step, evaluate, samples_per_step=ctx.batch_size)

``evaluate`` may return any floats; ``accuracy`` and ``loss`` are shown in the summary when present.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from gossip.errors import TaskError


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


@dataclass
class Task:
    model: nn.Module
    train_step: Callable[[], float]
    evaluate: Callable[[], dict[str, float]]
    samples_per_step: int = 0
    trains: bool = True  # False for tasks that only mix (consensus)


BUILTIN = {"digits": "gossip.tasks.digits:make_task", "consensus": "gossip.tasks.consensus:make_task"}


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


def build_task(spec: str, ctx: TaskContext) -> Task:
    task = load_task(spec)(ctx)
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r} returned {type(task).__name__}; it must return gossip.tasks.Task")
    return task
