"""The parameter-server algorithms without sockets: update rules checked against values worked out by hand,
and the shared state machine (barriers, soft sync, bounded staleness)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip.config import CoordinatorConfig
from gossip.coordinator.core import Contribution, ServerCore
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.modes import build_core
from gossip.flat import FlatParams


class Recorder:
    """An Update that only remembers what it was given."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.sent_to: list[int] = []

    def apply(self, batch, staleness) -> None:
        self.batches.append([c.worker for c in batch])

    def sent(self, worker: int) -> None:
        self.sent_to.append(worker)


def contribution(worker: int, version: int, clock: int, chunks=None) -> Contribution:
    return Contribution(worker, version, clock, chunks if chunks is not None else [torch.zeros(1)])


# -- DC-ASGD, by hand ---------------------------------------------------------------------------------
def test_dcasgd_constant_step_matches_the_hand_computed_value():
    weights = [torch.tensor([1.0, 2.0, -1.0])]
    dc = DelayCompensation(weights, lam=0.5)
    dc.backup(worker=0)  # W_bak(0) = [1, 2, -1]
    weights[0].copy_(torch.tensor([1.5, 1.0, -1.0]))  # other workers moved W meanwhile
    g = [torch.tensor([2.0, -3.0, 4.0])]
    # g + lambda * g*g * (W - W_bak) = [2 + 0.5*4*0.5, -3 + 0.5*9*(-1), 4 + 0.5*16*0] = [3, -7.5, 4]
    torch.testing.assert_close(dc.compensate(0, g)[0], torch.tensor([3.0, -7.5, 4.0]))
    # the sign matters: a gradient pointing the same way as the drift W - W_bak is enlarged (a flipped
    # sign would give 1.5), and g*g scales it: -7.5 needs 9 = (-3)^2, where |g| would give -4.5
    assert g[0].tolist() == [2.0, -3.0, 4.0]  # the received gradient is not modified in place


def test_dcasgd_keeps_one_backup_per_worker():
    weights = [torch.tensor([0.0, 0.0])]
    dc = DelayCompensation(weights, lam=1.0)
    dc.backup(0)  # worker 0 pulled W = [0, 0]
    weights[0].copy_(torch.tensor([1.0, 1.0]))
    dc.backup(1)  # worker 1 pulled W = [1, 1]
    weights[0].copy_(torch.tensor([2.0, 2.0]))
    g = [torch.tensor([1.0, 2.0])]
    # worker 0: W - bak = [2, 2] -> g + g*g*2 = [3, 10]; worker 1: W - bak = [1, 1] -> [2, 6]
    torch.testing.assert_close(dc.compensate(0, g)[0], torch.tensor([3.0, 10.0]))
    torch.testing.assert_close(dc.compensate(1, g)[0], torch.tensor([2.0, 6.0]))


def test_dcasgd_adaptive_step_matches_the_hand_computed_value():
    weights = [torch.tensor([1.0, 1.0])]
    dc = DelayCompensation(weights, lam=2.0, adaptive=True, momentum=0.5, epsilon=0.0)
    dc.backup(0)
    weights[0].copy_(torch.tensor([2.0, 0.0]))  # W - W_bak = [1, -1]
    g = [torch.tensor([2.0, 4.0])]
    # MS = 0.5*0 + 0.5*g*g = [2, 8]; lambda_t = 2 / sqrt(MS) = [2/sqrt(2), 2/sqrt(8)] = [1.41421, 0.70711]
    # g~ = g + lambda_t * g*g * (W - W_bak) = [2 + 1.41421*4*1, 4 + 0.70711*16*(-1)] = [7.65685, -7.31371]
    torch.testing.assert_close(dc.compensate(0, g)[0], torch.tensor([2 + 4 * 2 ** 0.5, 4 - 16 / 2 ** 0.5]))
    torch.testing.assert_close(dc.mean_square[0], torch.tensor([2.0, 8.0]))
    # a second gradient updates the running mean square: MS = 0.5*[2, 8] + 0.5*[1, 1] = [1.5, 4.5]
    dc.compensate(0, [torch.tensor([1.0, 1.0])])
    torch.testing.assert_close(dc.mean_square[0], torch.tensor([1.5, 4.5]))


def make_server(mode: str, **settings) -> tuple[ServerCore, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    flat = FlatParams(model, 1 << 20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    return build_core(mode, CoordinatorConfig(**settings), flat, optimizer, workers=3), model


def replay(core: ServerCore, sequence) -> None:
    """Joins, then (worker, version it pulled, clock, gradient) in arrival order."""
    for worker in range(core.workers):
        core.join(worker)
    for worker, version, clock, gradient in sequence:
        core.submit(contribution(worker, version, clock, [gradient]))


def gradient_sequence(length: int = 12):
    generator = torch.Generator().manual_seed(5)
    # worker w pulls version v and its gradient arrives some updates later: staleness 0..2
    return [(i % 3, max(0, i - i % 3), i // 3 + 1, torch.randn(8, generator=generator)) for i in range(length)]


def test_asgd_equals_dcasgd_with_lambda_zero():
    asgd, asgd_model = make_server("ps-async")
    dc, dc_model = make_server("ps-dcasgd", dc_lambda=0.0)
    sequence = gradient_sequence()
    replay(asgd, sequence)
    replay(dc, sequence)
    assert asgd.version == dc.version == len(sequence)
    for a, b in zip(asgd_model.parameters(), dc_model.parameters()):
        assert torch.equal(a, b)
    other, other_model = make_server("ps-dcasgd", dc_lambda=0.5)  # and a real lambda changes the result
    replay(other, sequence)
    assert not all(torch.equal(a, b) for a, b in zip(asgd_model.parameters(), other_model.parameters()))


def test_server_applies_the_mean_gradient_with_its_optimizer():
    core, model = make_server("ps-sync")
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    grads = [torch.full((8,), float(w + 1)) for w in range(3)]  # mean 2
    for worker in range(3):
        core.join(worker)
    replies = [core.submit(contribution(w, 0, 1, [grads[w]])) for w in range(3)]
    assert replies == [[], [], [0, 1, 2]] and core.version == 1  # the barrier releases everyone at once
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(after, before - 0.1 * 2.0)


def test_staleness_scaled_learning_rate_divides_by_staleness():
    core, model = make_server("ps-async", staleness_lr=True)
    replay(core, [])
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    core.submit(contribution(0, 0, 1, [torch.ones(8)]))  # staleness 0 -> scale 1
    core.submit(contribution(1, 0, 1, [torch.ones(8)]))  # staleness 1 -> scale 1
    core.submit(contribution(2, 0, 1, [torch.ones(8)]))  # staleness 2 -> scale 1/2
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(after, before - 0.1 * (1 + 1 + 0.5))
    assert dict(core.staleness) == {0: 1, 1: 1, 2: 1}


# -- the shared state machine -----------------------------------------------------------------------------
def test_soft_sync_applies_exactly_s_contributions_while_enough_workers_remain():
    recorder = Recorder()
    core = ServerCore(4, recorder, batch_size=2)
    for i in range(10):
        core.submit(contribution(i % 4, 0, i // 4 + 1))
    assert recorder.batches == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    for worker in (0, 1, 2):
        core.leave(worker)
    core.submit(contribution(3, 5, 9))  # one worker left: it is not kept waiting for a partner
    assert recorder.batches[-1] == [3]


def test_ssp_holds_a_worker_too_far_ahead_until_the_slowest_catches_up():
    recorder = Recorder()
    core = ServerCore(2, recorder, batch_size=1, staleness_bound=1)
    assert core.submit(contribution(0, 0, 1)) == [0]  # lead 1: allowed
    assert core.submit(contribution(0, 1, 2)) == []  # lead 2 > 1: held
    assert 0 in core.held and not core.may_proceed(0)
    assert core.submit(contribution(1, 0, 1)) == [0, 1]  # the slow worker catches up: both go on
    assert core.lead(0) == 1


def test_a_finished_worker_no_longer_holds_anyone_back():
    core = ServerCore(2, Recorder(), batch_size=1, staleness_bound=0)
    assert core.submit(contribution(0, 0, 1)) == []
    assert core.leave(1) == [0]


def test_sync_barrier_waits_for_every_worker():
    recorder = Recorder()
    core = ServerCore(3, recorder, batch_size=3)
    assert core.submit(contribution(0, 0, 1)) == [] and core.submit(contribution(2, 0, 1)) == []
    assert core.submit(contribution(1, 0, 1)) == [0, 1, 2]
    assert recorder.batches == [[0, 2, 1]] and recorder.sent_to == [0, 1, 2]
