"""The consensus task: no training at all. Each peer starts from its own seeded random vector (float64)
and only mixes, so the run measures averaging itself: the consensus distance per round should contract
by the mixing matrix's second-largest eigenvalue modulus, and the mean should not move."""

from __future__ import annotations

import torch
from torch import nn

from gossip.tasks import Task, TaskContext


class Vector(nn.Module):
    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.value = nn.Parameter(values, requires_grad=False)


def initial_vector(rank: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    return torch.randn(dim, generator=generator, dtype=torch.float64)


def make_task(ctx: TaskContext) -> Task:
    model = Vector(initial_vector(ctx.rank, ctx.dim, ctx.seed))
    return Task(model, loss=lambda: torch.zeros(()), evaluate=lambda: {})
