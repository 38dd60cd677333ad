"""The built-in ``digits-wide`` task (an MLP 64-2560-2560-10 for slow-link benchmarks), without processes."""

from __future__ import annotations

import math

import torch

from gossip.tasks import TaskContext, build_task
from gossip.tasks.digits import WIDE_HIDDEN, make_model


def test_digits_wide_builds_a_27_mb_model_that_trains_one_step():
    task = build_task("digits-wide", TaskContext(rank=1, world_size=2, seed=0))
    parameters = list(task.model.parameters())
    assert sum(p.numel() for p in parameters) == 64 * 2560 + 2560 + 2560 * 2560 + 2560 + 2560 * 10 + 10
    assert 25e6 < sum(p.numel() * p.element_size() for p in parameters) < 28e6  # float32, about 27 MB
    assert task.trains and task.samples_per_step == 32
    before = [p.detach().clone() for p in parameters]
    loss = task.train_step()
    assert math.isfinite(loss) and 0 < loss < 10  # about ln(10) from a fresh init
    assert all(torch.isfinite(p).all() for p in parameters)
    assert any(not torch.equal(b, p) for b, p in zip(before, parameters, strict=True))
    metrics = task.evaluate()
    assert 0 <= metrics["accuracy"] <= 1 and math.isfinite(metrics["loss"])


def test_digits_wide_starts_from_the_same_weights_on_every_peer():
    a = build_task("digits-wide", TaskContext(rank=0, world_size=2, seed=3)).model.state_dict()
    b = make_model(3, 64, WIDE_HIDDEN).state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
