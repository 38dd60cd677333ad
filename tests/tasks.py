"""User tasks (``package.module:function``) that the multi-process tests run through the launcher."""

from __future__ import annotations

import time

import torch

from gossip.tasks import Task, TaskContext
from gossip.tasks.consensus import Vector
from gossip.tasks.digits import make_task as make_digits


def rank_value(ctx: TaskContext) -> Task:
    """No training; peer r's vector starts filled with the value r."""
    model = Vector(torch.full((ctx.dim,), float(ctx.rank), dtype=torch.float64))
    return Task(model, loss=lambda: torch.zeros(()), evaluate=lambda: {})


def fails_on_rank_2(ctx: TaskContext) -> Task:
    """Digits, except that peer 2 raises in its 5th step: the launcher must say which peer and why."""
    task = make_digits(ctx)
    if ctx.rank != 2:
        return task
    steps = 0
    inner = task.loss

    def loss() -> torch.Tensor:
        nonlocal steps
        steps += 1
        if steps == 5:
            raise RuntimeError("simulated failure in peer 2's training step")
        return inner()

    task.loss = loss
    return task


def slow_digits(ctx: TaskContext) -> Task:
    """Digits that sleep 20 ms a step, so a run lasts long enough to be interrupted."""
    task = make_digits(ctx)
    inner = task.loss

    def loss() -> torch.Tensor:
        time.sleep(0.02)
        return inner()

    task.loss = loss
    return task
