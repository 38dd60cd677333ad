"""A user's own AdamW and learning-rate scheduler work unchanged under ``gossip.attach``.

Peers are threads of this process on real loopback sockets. Alone, a peer trains bit for bit as the same
loop without ``attach``; with a neighbour, every peer's steps between two mixes are those of that loop, and
each mix replaces the weights by the two peers' mean, leaving the optimizer's moments and the scheduler's
step alone (AdamW's state and the scheduler stay the user's, local to each peer): the run equals, bit for
bit, both loops in one thread with the mean taken by hand.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import gossip
from tests.conftest import endpoints, run_peers

pytestmark = pytest.mark.timeout(60)

STEPS, EVERY = 12, 4


def architecture() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


with torch.random.fork_rng():  # drawn once: peers are threads, and seeding the global generator in each races
    torch.manual_seed(0)
    INITIAL = architecture().state_dict()


def make_model() -> torch.nn.Module:
    model = architecture()
    model.load_state_dict(INITIAL)
    return model


def batches(rank: int):
    generator = torch.Generator().manual_seed(100 + rank)  # each peer its own data
    while True:
        yield torch.randn(32, 8, generator=generator), torch.randint(0, 3, (32,), generator=generator)


def make_optimizer(model: torch.nn.Module, schedule: str):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if schedule == "one-cycle":
        return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-2, total_steps=STEPS)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS, eta_min=1e-3)


def train(rank: int, averager, schedule: str) -> list[dict[str, torch.Tensor]]:
    """The user's loop, with ``averager(model)`` attached when given; the weights after every step."""
    model = make_model()
    optimizer, scheduler = make_optimizer(model, schedule)
    stream, trajectory = batches(rank), []
    with averager(model) if averager else contextlib.nullcontext() as attached:
        for step in range(1, STEPS + 1):
            inputs, targets = next(stream)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            scheduler.step()
            if attached is not None:
                attached.step(samples=len(inputs))
            trajectory.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return trajectory


@pytest.mark.parametrize("schedule", ("one-cycle", "cosine"))
def test_alone_a_peer_trains_bit_for_bit_as_without_gossip(schedule):
    (ep,) = endpoints(1)
    attached = train(0, lambda m: gossip.attach(m, rank=0, world_size=1, endpoints=(ep,)), schedule)
    plain = train(0, None, schedule)
    for step, (a, b) in enumerate(zip(attached, plain), 1):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)


def test_between_mixes_each_peer_steps_as_its_own_loop_and_a_mix_is_the_mean():
    eps = endpoints(2)

    def peer(rank: int):
        return train(rank, lambda m: gossip.attach(m, rank=rank, world_size=2, endpoints=tuple(eps), topology="full",
                                                  gossip_every=EVERY, overlap=False), "cosine")

    gossiped = run_peers(2, peer)
    alone = [train(rank, None, "cosine") for rank in range(2)]
    for rank in range(2):  # before the first mix: each peer is its own single process, bit for bit
        for step in range(EVERY - 1):
            for name, tensor in gossiped[rank][step].items():
                assert torch.equal(tensor, alone[rank][step][name]), (rank, step, name)
    reference = mean_every(EVERY)  # both loops in one thread, their weights set to the mean every EVERY steps
    for rank in range(2):
        for name, tensor in gossiped[rank][-1].items():
            assert torch.equal(tensor, reference[rank][name]), (rank, name)


def mean_every(every: int) -> list[dict[str, torch.Tensor]]:
    """Both peers' loops in lockstep in one thread, each peer's weights set to the mean every ``every`` steps."""
    models = [make_model() for _ in range(2)]
    optimizers = [make_optimizer(model, "cosine") for model in models]
    streams = [batches(rank) for rank in range(2)]
    for step in range(1, STEPS + 1):
        for model, (optimizer, scheduler), stream in zip(models, optimizers, streams):
            inputs, targets = next(stream)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            scheduler.step()
        if step % every == 0:
            with torch.no_grad():
                for a, b in zip(*(model.parameters() for model in models)):
                    mean = (a + b) / 2
                    a.copy_(mean)
                    b.copy_(mean)
    return [{k: v.detach().clone() for k, v in model.state_dict().items()} for model in models]
