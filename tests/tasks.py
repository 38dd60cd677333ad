"""User tasks (``package.module:function``) that the multi-process tests run through the launcher."""

from __future__ import annotations

import time
from collections.abc import Callable

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

    def fail() -> None:
        raise RuntimeError("simulated failure in peer 2's training step")

    return _before_step(task, 5, fail)


def _before_step(task: Task, step: int, action: Callable[[], None]) -> Task:
    """``task`` with ``action()`` run in its ``step``-th loss computation, before the loss."""
    steps = 0
    inner = task.loss

    def loss() -> torch.Tensor:
        nonlocal steps
        steps += 1
        if steps == step:
            action()
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


ORDER_SEED = 11


def ordered_batch_indices(step: int, rank: int, world_size: int, batch_size: int, total: int) -> torch.Tensor:
    """Worker ``rank``'s batch at ``step``: slice ``rank`` of the step's ``world_size * batch_size`` samples
    of one fixed permutation, so N workers at batch b see exactly what one process at batch N*b sees."""
    order = torch.randperm(total, generator=torch.Generator().manual_seed(ORDER_SEED))
    start = (step * world_size + rank) * batch_size
    return order[torch.arange(start, start + batch_size) % total]


def ordered_digits(ctx: TaskContext) -> Task:
    """Digits with batches fixed by (step, rank): for the parameter-server exactness tests."""
    import torch.nn.functional as F

    from gossip.tasks.digits import evaluator, load_split, make_model

    x_train, y_train, x_test, y_test = load_split()
    model = make_model(ctx.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=ctx.lr, momentum=ctx.momentum)
    step = 0

    def loss() -> torch.Tensor:
        nonlocal step
        index = ordered_batch_indices(step, ctx.rank, ctx.world_size, ctx.batch_size, len(x_train))
        step += 1
        return F.cross_entropy(model(x_train[index]), y_train[index])

    return Task(model, loss, evaluator(model, x_test, y_test), optimizer, samples_per_step=ctx.batch_size)


def _dies_at(task: Task, step: int, code: int) -> Task:
    """``task``, except that the process exits abruptly (as if killed: no goodbye) in its ``step``-th step."""
    import os

    steps = 0
    inner = task.loss

    def loss() -> torch.Tensor:
        nonlocal steps
        steps += 1
        if steps == step:
            os._exit(code)
        return inner()

    task.loss = loss
    return task


def worker_1_dies(ctx: TaskContext) -> Task:
    """Digits, except that worker 1 exits abruptly (exit status 9) at its 30th step."""
    task = make_digits(ctx)
    return _dies_at(task, 30, 9) if ctx.rank == 1 else task


def dies(ctx: TaskContext) -> Task:
    """Digits at 20 ms a step; a peer whose rank is in $GOSSIP_TEST_DYING_RANKS (or which runs with
    $GOSSIP_TEST_DIE set, as under one torchrun agent) dies in its 20th step, exit status 3, no goodbye:
    its neighbours must give it up and finish without it."""
    import os

    task = slow_digits(ctx)
    dying = os.environ.get("GOSSIP_TEST_DIE") == "1" or \
        str(ctx.rank) in os.environ.get("GOSSIP_TEST_DYING_RANKS", "").split(",")
    return _dies_at(task, 20, 3) if dying else task


def constant_gradient(ctx: TaskContext) -> Task:
    """Peer r's vector starts at r and its loss is (r + 1) times the sum of its entries: every gradient of
    peer r is r + 1 in every entry, so if each step counts 1/N, plain SGD moves the network's mean model by
    exactly ``lr`` times the mean of (r + 1) over the peers per step and coordinate."""
    model = Vector(torch.full((ctx.dim,), float(ctx.rank), dtype=torch.float64))
    model.value.requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=ctx.lr, momentum=ctx.momentum)
    return Task(model, loss=lambda: (ctx.rank + 1) * model.value.sum(), evaluate=lambda: {}, optimizer=optimizer)


HOLD_STEP = 10


def held_digits(ctx: TaskContext) -> Task:
    """Digits, except that with $GOSSIP_TEST_RELEASE set, peer 0 stops before its step ``HOLD_STEP``: it
    creates that path + ".held" and waits (at most 90 s) until the path exists. Its neighbours wait for it
    in lockstep, so the run lasts as long as a test needs, with the same models as a run that is not held;
    its event loop goes on receiving meanwhile."""
    import os
    from pathlib import Path

    task = make_digits(ctx)
    release = os.environ.get("GOSSIP_TEST_RELEASE")
    if ctx.rank != 0 or not release:
        return task

    def hold() -> None:
        Path(release + ".held").touch()
        deadline = time.monotonic() + 90
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    return _before_step(task, HOLD_STEP, hold)


def target_vectors(seed: int, world_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``targets``' b_r of every rank (a row each), their mean (the answer) and the rms distance of the b_r
    from it (what ``error`` divides by)."""
    def target(rank: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        return torch.randn(dim, generator=generator, dtype=torch.float64)

    every = torch.stack([target(r) for r in range(world_size)])
    mean = every.mean(0)
    return every, mean, float((every - mean).pow(2).sum(1).mean().sqrt())


def targets(ctx: TaskContext) -> Task:
    """Peer r minimises f_r(x) = 0.5 |x - b_r|^2 with its own target b_r (``ctx.dim`` normal draws seeded by
    the seed and the rank), with exact gradients, from x = 0; the minimiser of the peers' mean objective is
    mean b. ``evaluate`` gives ``error``: |x - mean b| over the rms distance of the b_r from mean b (1: as
    far off as a typical peer's own optimum)."""
    every, mean, spread = target_vectors(ctx.seed, ctx.world_size, ctx.dim)
    own = every[ctx.rank]
    model = Vector(torch.zeros(ctx.dim, dtype=torch.float64))
    model.value.requires_grad_(True)

    def evaluate() -> dict[str, float]:
        return {"error": float((model.value.detach() - mean).norm()) / spread}

    return Task(model, lambda: 0.5 * (model.value - own).pow(2).sum(), evaluate,
                ctx.optimizer.build(model.parameters()))


def wider_on_rank_1(ctx: TaskContext) -> Task:
    """Digits, except that peer 1 builds 32 hidden units where the others build 16: a model that differs."""
    return make_digits(ctx, hidden=(32,) if ctx.rank == 1 else (16,))


def diverges_on_rank_2(ctx: TaskContext) -> Task:
    """Digits, except that peer 2 trains with a learning rate 1e8 times the others': only its weights blow up."""
    task = make_digits(ctx)
    if ctx.rank == 2:
        for group in task.optimizer.param_groups:
            group["lr"] *= 1e8
    return task


def dies_once_on_rank_1(ctx: TaskContext) -> Task:
    """Digits at 10 ms a step; peer 1 exits abruptly (exit status 9) in its 45th step, once: the marker file
    $GOSSIP_TEST_MARK records that it did, so the restarted process trains on."""
    import os
    from pathlib import Path

    task = slow_digits(ctx)
    mark = Path(os.environ["GOSSIP_TEST_MARK"])
    if ctx.rank != 1 or mark.exists():
        return task
    inner, steps = task.loss, 0

    def loss() -> torch.Tensor:
        nonlocal steps
        steps += 1
        if steps == 45:
            mark.touch()
            os._exit(9)
        return inner()

    task.loss = loss
    return task
