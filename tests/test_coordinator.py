"""The parameter-server algorithms without sockets: update rules checked against values worked out by hand,
and the shared state machine (barriers, soft sync, bounded staleness)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip.config import CoordinatorConfig
from gossip.coordinator.core import Contribution, ServerCore
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.modes import build_core, server_optimizer
from gossip.optim import OptimizerSpec
from gossip.errors import ConfigError
from gossip.flat import FlatParams
from gossip.health import BLOWN_UP_NORM, model_problem



def sgd(lr: float, momentum: float) -> OptimizerSpec:
    return OptimizerSpec("sgd", lr, momentum)


class Recorder:
    """An Update that only remembers what it was given."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.sent_to: list[int] = []

    def apply(self, batch, staleness, version) -> None:
        self.batches.append([c.worker for c in batch])

    def sent(self, worker: int) -> None:
        self.sent_to.append(worker)

    def left(self, worker: int) -> None:
        pass


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


# -- the server's optimizer: what "auto" does with --lr and --momentum --------------------------------------
def test_default_server_optimizer_compensates_the_momentum_of_asynchrony_and_keeps_the_step():
    auto = CoordinatorConfig()
    for mode in ("ps-async", "ps-ssp", "ps-dcasgd"):
        # 4 workers: asynchrony acts as momentum 1 - 1/4, so 0.9 - 0.75 = 0.15 is left explicit; the lr keeps
        # the long-run step per gradient, lr / (1 - mu), at ps-sync's for one of N gradients: 0.05 / 0.1 / 4
        four = server_optimizer(mode, sgd(0.05, 0.9), 4, auto)
        assert four.momentum == pytest.approx(0.15) and four.lr == pytest.approx(0.05 * 0.85 / (0.1 * 4))
        eight = server_optimizer(mode, sgd(0.05, 0.9), 8, auto)
        assert eight.momentum == pytest.approx(0.025) and eight.lr == pytest.approx(0.05 * 0.975 / 0.8)
        assert "updates in flight" in four.rule and "max(0, 0.9 - (1 - 1/4))" in four.rule
        for workers in (2, 3, 4, 8, 16):
            chosen = server_optimizer(mode, sgd(0.05, 0.9), workers, auto)
            assert chosen.lr / (1 - chosen.momentum) * workers == pytest.approx(0.05 / (1 - 0.9))
    # more workers than momentum to compensate: momentum-free, DC-ASGD's server update, at lr / ((1 - mu) N)
    many = server_optimizer("ps-async", sgd(0.05, 0.9), 16, auto)
    assert many.momentum == 0.0 and many.lr == pytest.approx(0.05 / (0.1 * 16))
    assert server_optimizer("ps-async", sgd(0.1, 0.0), 4, auto).lr == pytest.approx(0.025)  # no momentum: lr / N
    # no asynchrony left (one worker, or soft sync over all N): exactly the synchronous optimizer
    for workers, soft_sync in ((1, 1), (4, 4), (8, 8)):
        same = server_optimizer("ps-async", sgd(0.05, 0.9), workers, CoordinatorConfig(soft_sync=soft_sync))
        assert (same.lr, same.momentum) == pytest.approx((0.05, 0.9))
    halves = server_optimizer("ps-async", sgd(0.05, 0.9), 8, CoordinatorConfig(soft_sync=2))  # k = 4 in flight
    assert (halves.lr, halves.momentum) == pytest.approx((four.lr, four.momentum))
    # ps-sync (and ps-avg, whose server has no optimizer) keep --lr and --momentum
    sync = server_optimizer("ps-sync", sgd(0.05, 0.9), 8, auto)
    assert (sync.lr, sync.momentum) == (0.05, 0.9)


def test_explicit_server_lr_and_momentum_win():
    both = server_optimizer("ps-async", sgd(0.05, 0.9), 4, CoordinatorConfig(server_lr=0.3, server_momentum=0.0))
    assert (both.lr, both.momentum) == (0.3, 0.0) and "--server-lr" in both.rule
    # an explicit momentum alone keeps the matched long-run step; an explicit lr alone keeps auto momentum
    mu = server_optimizer("ps-dcasgd", sgd(0.05, 0.9), 4, CoordinatorConfig(server_momentum="0.5"))
    assert mu.momentum == 0.5 and mu.lr == pytest.approx(0.05 * 0.5 / (0.1 * 4))
    lr = server_optimizer("ps-ssp", sgd(0.05, 0.9), 4, CoordinatorConfig(server_lr="0.2"))
    assert lr.lr == 0.2 and lr.momentum == pytest.approx(0.15)
    sync = server_optimizer("ps-sync", sgd(0.05, 0.9), 4, CoordinatorConfig(server_momentum=0.0))
    assert (sync.lr, sync.momentum) == (0.05, 0.0)


def test_server_settings_are_auto_or_numbers():
    assert CoordinatorConfig(server_lr=" AUTO ").server_lr == "auto"
    assert CoordinatorConfig(server_lr="0.25", server_momentum=0).server_lr == 0.25
    for settings in ({"server_lr": "fast"}, {"server_lr": 0}, {"server_lr": float("nan")}, {"server_momentum": 1},
                     {"server_momentum": "-0.1"}, {"server_momentum": True}):
        with pytest.raises(ConfigError):
            CoordinatorConfig(**settings)


def test_the_model_health_check_finds_nan_inf_and_blown_up_weights():
    healthy = [torch.randn(100, 10), torch.zeros(3), torch.arange(5)]  # integer tensors are skipped
    assert model_problem(healthy) is None
    assert model_problem([torch.tensor([1.0, float("nan")])]) == "its weights hold NaN or Inf"
    assert model_problem([torch.tensor([1.0]), torch.tensor([-float("inf")])]) == "its weights hold NaN or Inf"
    assert "blown up" in model_problem([torch.full((4,), BLOWN_UP_NORM)])
    assert "blown up" in model_problem([torch.full((1000,), 1e25)])  # squares overflow float32: still found
    assert model_problem([torch.full((4,), 1e5)]) is None
    assert model_problem([torch.tensor([300.0, 1.0], dtype=torch.float16)]) is None  # 300^2 overflows fp16
    assert model_problem([torch.tensor([float("nan")], dtype=torch.bfloat16)]) == "its weights hold NaN or Inf"


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
