"""The optimizers and learning-rate schedules that ``--optimizer`` and ``--lr-schedule`` name.

``OptimizerSpec.build`` makes a ``torch.optim`` optimizer: SGD with momentum, or AdamW (Loshchilov & Hutter,
2019) whose decoupled weight decay applies to matrices only (weights of linear layers and embeddings), not
to biases and normalisation gains, as GPT-2 and nanoGPT train; with ``peers`` > 1 (a peer of N whose AdamW
steps are averaged: ``--second-moment``), ``SwarmAdamW`` (``gossip/swarm_adamw.py``), normalised for the
mean of the N peers' gradients. ``Schedule`` is the learning rate as a closed
form of the step (or, on a parameter server, of the version), so that nothing but the step counter, which
checkpoints hold, is needed to resume it:

    warm-up   lr * t / W                                          for t <= W
    constant  lr
    cosine    min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2     p = (t - W) / (T - W), capped at 1
    linear    min_lr + (lr - min_lr) * (1 - p)

for the t-th update (t from 1) of a run of T updates with W of warm-up. A peer schedules by its own local
step; the parameter server by its version (``gossip/coordinator/modes.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gossip.config import RunConfig
from gossip.errors import ConfigError
from gossip.swarm_adamw import SwarmAdamW

BASE_LR = "base_lr"  # the key in each param group that holds the lr the schedule scales (saved with its state)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "sgd"  # gossip.config.OPTIMIZERS
    lr: float = 0.05
    momentum: float = 0.9  # SGD
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    weight_decay: float = 0.0
    peers: int = 1  # AdamW: > 1, the second moment of the mean of this many peers' gradients (swarm_adamw.py)

    def build(self, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        params = [p for p in parameters if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if self.name in ("sgd", "nesterov"):  # nesterov: ps-avg's outer step (gossip/coordinator/averaging.py)
            return torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, nesterov=self.name == "nesterov")
        if self.name == "adamw" and self.peers > 1:
            return SwarmAdamW(groups, lr=self.lr, betas=self.betas, peers=self.peers)
        if self.name == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        raise ConfigError(f"unknown optimizer {self.name!r}; choose sgd or adamw")


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"  # gossip.config.LR_SCHEDULES
    total: int = 0  # T: updates in the whole run
    warmup: int = 0  # W
    min_ratio: float = 0.0  # min_lr / lr

    @property
    def trivial(self) -> bool:
        """The lr never changes."""
        return self.kind == "constant" and not self.warmup

    def factor(self, t: int) -> float:
        """The learning rate of the ``t``-th update (from 1) as a fraction of the peak."""
        if t <= self.warmup:
            return t / self.warmup
        if self.kind == "constant":
            return 1.0
        span = self.total - self.warmup
        progress = min(1.0, (t - self.warmup) / span) if span > 0 else 1.0
        shape = (1.0 + math.cos(math.pi * progress)) / 2.0 if self.kind == "cosine" else 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape

    def apply(self, optimizer: torch.optim.Optimizer, t: int) -> float:
        """Set every param group's lr for the ``t``-th update: its base lr (the lr it had when first scheduled)
        times ``factor(t)``. Returns the first group's lr."""
        scale = self.factor(t)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault(BASE_LR, group["lr"]) * scale
        return optimizer.param_groups[0]["lr"]


def run_schedule(cfg: RunConfig) -> Schedule:
    """The schedule of a run's flags over its ``--steps`` (a server carries it over to versions)."""
    return Schedule(cfg.lr_schedule, cfg.steps, cfg.warmup_steps, cfg.min_lr / cfg.lr)
