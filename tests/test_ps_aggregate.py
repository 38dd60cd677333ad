"""Robust aggregation at the parameter server, without sockets: ps-sync's and ps-avg's coordinate-wise
median and trimmed mean of one version's contributions equal torch's, the mean is the update it always
was, bit for bit, and the asynchronous modes' norm bound (``--aggregate norm-clip``) clips, drops and
learns its reference as ``gossip/coordinator/normbound.py`` says."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from torch import nn

from gossip.averagers.neighbours import byzantine_garbage
from gossip.config import CoordinatorConfig
from gossip.coordinator.core import Contribution
from gossip.coordinator.modes import build_core
from gossip.coordinator.normbound import CLIP, DROP, WINDOW, NormBound
from gossip.coordinator.sgd import parameter_norm
from gossip.flat import FlatParams
from gossip.health import model_problem

WORKERS = 5


def server(mode: str, aggregate: str = "mean", workers: int = WORKERS, lr: float = 1.0, model: nn.Module | None = None,
           memory: bool = False, **settings):
    """A server core for ``mode`` on a small model (plain SGD with ``lr``, no momentum), every worker joined."""
    torch.manual_seed(0)
    model = model if model is not None else nn.Linear(6, 4)
    flat = FlatParams(model, 64)  # 64-byte chunks: the 28 weights come in several frames
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    core = build_core(mode, CoordinatorConfig(**settings), flat, optimizer, workers, memory=memory,
                      aggregate=aggregate, trim_fraction=0.2)
    for worker in range(workers):
        core.join(worker)
    return core, flat


def weights(flat: FlatParams) -> torch.Tensor:
    return torch.cat([view.clone() for view in flat.views()])


def cut(flat: FlatParams, vector: torch.Tensor) -> list[torch.Tensor]:
    """``vector`` cut into chunks like the flat buffers, as a worker sends it."""
    return [vector[sum(v.numel() for v in list(flat.views())[:i]):][:view.numel()].clone()
            for i, view in enumerate(flat.views())]


def integer_rows(flat: FlatParams, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` vectors of small integers: every sum of them is exact, so two ways of averaging agree
    bit for bit whenever they divide the same sum by the same count."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(-50, 50, (flat.numel,), generator=generator).float() for _ in range(count)]


def submit_round(core, flat: FlatParams, rows: list[torch.Tensor]) -> None:
    for worker, row in enumerate(rows):
        core.submit(Contribution(worker, core.version, core.version + 1, cut(flat, row)))


@pytest.mark.parametrize("aggregate", ["median", "trimmed-mean"])
def test_ps_sync_steps_with_torchs_median_or_trimmed_mean_of_the_batch(aggregate):
    core, flat = server("ps-sync", aggregate)
    for seed in range(3):
        rows = integer_rows(flat, WORKERS, seed)
        before = weights(flat)
        submit_round(core, flat, rows)
        stacked = torch.stack(rows)
        # 5 workers: the median keeps the middle value, the trimmed mean (0.2 x 5 = 1 from each end) three
        expected = stacked.median(dim=0).values if aggregate == "median" else \
            stacked.sort(dim=0).values[1:4].mean(dim=0)
        assert torch.equal(weights(flat), before - expected)  # SGD with lr 1 and no momentum: W - g
    assert core.version == 3


@pytest.mark.parametrize("aggregate", ["median", "trimmed-mean"])
def test_with_four_workers_both_rules_average_the_middle_two(aggregate):
    core, flat = server("ps-sync", aggregate, workers=4)
    rows = integer_rows(flat, 4, seed=7)
    before = weights(flat)
    submit_round(core, flat, rows)
    assert torch.equal(weights(flat), before - torch.stack(rows).sort(dim=0).values[1:3].mean(dim=0))


def test_ps_sync_with_the_mean_is_the_update_it_always_was_bit_for_bit():
    core, flat = server("ps-sync", "mean", lr=0.1)
    generator = torch.Generator().manual_seed(3)
    expected = weights(flat)
    for _ in range(3):
        rows = [torch.randn(flat.numel, generator=generator) for _ in range(WORKERS)]
        submit_round(core, flat, rows)
        gradient = torch.zeros(flat.numel)
        for row in rows:  # the server's own sum, in arrival order, each term scaled by 1 / N
            gradient.add_(row, alpha=1.0 / WORKERS)
        expected.add_(gradient, alpha=-0.1)
        assert torch.equal(weights(flat), expected)


def test_one_byzantine_worker_cannot_move_the_median_beyond_the_honest_gradients():
    core, flat = server("ps-sync", "median", workers=4)
    rows = integer_rows(flat, 3, seed=11)
    garbage = torch.cat(byzantine_garbage([torch.zeros(flat.numel)], 1e30, seed=0))
    before = weights(flat)
    submit_round(core, flat, [*rows, garbage])
    step = before - weights(flat)
    honest = torch.stack(rows)
    assert bool(((honest.min(0).values <= step) & (step <= honest.max(0).values)).all())


@pytest.mark.parametrize("aggregate", ["median", "trimmed-mean"])
def test_ps_avg_takes_torchs_median_of_the_workers_weights(aggregate):
    core, flat = server("ps-avg", aggregate)
    rows = integer_rows(flat, WORKERS, seed=5)
    submit_round(core, flat, rows)
    stacked = torch.stack(rows)
    expected = stacked.median(dim=0).values if aggregate == "median" else stacked.sort(dim=0).values[1:4].mean(0)
    assert torch.equal(weights(flat), expected)


def test_diloco_steps_with_the_change_to_the_median_and_buffers_take_the_median():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    core, flat = server("ps-avg", "median", model=model, lr=0.5, outer_optimizer="sgd", outer_lr=0.5)
    rows = integer_rows(flat, WORKERS, seed=9)
    before = weights(flat)
    submit_round(core, flat, rows)
    median = torch.stack(rows).median(dim=0).values
    parameters = sum(p.numel() for p in model.parameters())  # parameters first, then BatchNorm's buffers
    after = weights(flat)
    torch.testing.assert_close(after[:parameters], before[:parameters] - 0.5 * (before - median)[:parameters],
                               rtol=0, atol=1e-6)
    assert torch.equal(after[parameters:], median[parameters:])  # running mean and variance


# -- the norm bound ---------------------------------------------------------------------------------
def test_the_first_three_workers_norms_are_recorded_and_their_gradients_not_applied():
    bound = NormBound()
    assert [bound.factor(w, 1.0) for w in (0, 0, 1)] == [0.0, 0.0, 0.0]  # two workers: no reference yet
    assert bound.reference() is None
    assert bound.factor(2, 1.0) == 0.0  # the third worker's norm completes the reference
    assert bound.reference() == 1.0 and bound.factor(3, 1.5) == 1.0
    assert bound.statistics() == {"clipped": 0, "dropped": 0, "unjudged": 4, "reference": 1.0}


def test_within_the_bound_applied_beyond_clipped_far_beyond_dropped():
    bound = NormBound()
    for worker, norm in enumerate((1.0, 2.0, 3.0, 4.0)):
        bound._record(worker, norm)
    assert bound.reference() == 2.0  # the lower of the two middle workers' norms
    assert bound.factor(0, CLIP * 2.0) == 1.0
    assert bound.factor(1, 12.0) == pytest.approx(CLIP * 2.0 / 12.0)  # scaled down to 3 x 2 = 6
    assert bound.factor(2, DROP * 2.0 * 1.01) == 0.0
    assert bound.statistics() == {"clipped": 1, "dropped": 1, "unjudged": 0, "reference": 2.0}
    # the clipped and the dropped gradient recorded the bound, not their own norms
    assert list(bound.recent[1])[-1] == list(bound.recent[2])[-1] == CLIP * 2.0


def test_a_worker_that_floods_the_server_with_garbage_has_one_vote_in_the_reference():
    bound = NormBound()
    for _ in range(WINDOW):
        for worker in range(3):
            bound.factor(worker, 1.0 + 0.1 * worker)
    for _ in range(100):  # worker 3 sends a hundred huge gradients in a row: each dropped
        assert bound.factor(3, 1e30) == 0.0
    assert bound.reference() == pytest.approx(1.1)  # the honest workers' norms, 1.0, 1.1 and 1.2
    for _ in range(100):  # and tiny ones only pull its own vote down
        bound.factor(3, 1e-9)
    assert bound.reference() == pytest.approx(1.0)


def test_when_every_norm_grows_the_reference_follows_by_a_factor_clip_at_most():
    bound = NormBound()
    for worker in range(4):
        bound.factor(worker, 1.0)
    references, rounds = [1.0], []
    for _ in range(3 * WINDOW):  # every worker's gradients are suddenly 50 x larger: first dropped, then back
        rounds.append([bound.factor(worker, 50.0) for worker in range(4)])
        references.append(bound.reference())
    assert rounds[0] == [0.0] * 4 and rounds[WINDOW] == [pytest.approx(CLIP * 9 / 50)] * 4
    assert rounds[11:] == [[1.0] * 4] * (3 * WINDOW - 11) and references[-1] == 50.0
    assert all(b <= CLIP * a for a, b in pairwise(references))


def test_the_norm_leaves_buffers_out_and_stays_finite_for_garbage_near_the_largest_float():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    flat = FlatParams(model, 64)
    parameters = sum(p.numel() for p in model.parameters())
    gradient = torch.zeros(flat.numel)
    gradient[:parameters] = 2.0
    gradient[parameters:] = 1e6  # BatchNorm's running statistics travel with the gradient
    assert parameter_norm(flat, cut(flat, gradient)) == pytest.approx(2.0 * math.sqrt(parameters))
    garbage = torch.full((flat.numel,), 3e37)  # a tenth of float32's largest: squares overflow float32
    assert parameter_norm(flat, cut(flat, garbage)) == pytest.approx(3e37 * math.sqrt(parameters))


@pytest.mark.parametrize("mode,memory,settings", [
    ("ps-async", True, {}), ("ps-async", False, {"staleness_lr": True}), ("ps-dcasgd", True, {"dc_lambda": 0.5}),
    ("ps-ssp", False, {"staleness_bound": 2}),
])
def test_an_asynchronous_server_with_norm_clip_drops_garbage_clips_large_gradients_and_is_the_mean_within_bounds(
        mode, memory, settings):
    workers = 4
    clipped, flat = server(mode, "norm-clip", workers=workers, lr=0.1, memory=memory, **settings)
    plain, plain_flat = server(mode, "mean", workers=workers, lr=0.1, memory=memory, **settings)
    generator = torch.Generator().manual_seed(4)

    def both(worker: int, vector: torch.Tensor) -> None:
        for core, target in ((clipped, flat), (plain, plain_flat)):
            core.submit(Contribution(worker, core.version, core.version + 1, cut(target, vector)))

    for worker in range(3):  # the warm-up: recorded, not applied
        clipped.submit(Contribution(worker % workers, clipped.version, 1, cut(flat, torch.ones(flat.numel))))
    assert torch.equal(weights(flat), weights(plain_flat))
    for step in range(8):  # gradients of similar norms: the bound changes nothing, bit for bit
        both(step % workers, torch.randn(flat.numel, generator=generator))
        assert torch.equal(weights(flat), weights(plain_flat))
    before = weights(flat)
    both(workers - 1, torch.cat(byzantine_garbage([torch.zeros(flat.numel)], 1e30, seed=1)))
    assert torch.equal(weights(flat), before)  # dropped (the mean server took it: its weights are ruined)
    assert model_problem(plain_flat.segments) is not None  # blown up, or NaN where DC-ASGD squared it
    reference = clipped.update.bound.reference()
    large = torch.randn(flat.numel, generator=generator)
    large *= 5 * reference / float(large.norm())  # between CLIP and DROP times the reference: clipped
    clipped.submit(Contribution(0, clipped.version, 1, cut(flat, large)))
    step = weights(flat) - before
    if not memory:  # the step is lr x the clipped gradient, of norm CLIP x the reference
        torch.testing.assert_close(step, -0.1 * large * CLIP / 5, rtol=1e-4, atol=1e-6)
    assert clipped.update.bound.statistics()["clipped"] == 1 and clipped.update.bound.counts["dropped"] == 1


def test_ps_sync_with_norm_clip_steps_with_the_mean_of_the_gradients_it_did_not_drop():
    core, flat = server("ps-sync", "norm-clip", workers=4, lr=1.0)
    submit_round(core, flat, integer_rows(flat, 4, seed=1))  # the first three are unjudged: the fourth alone
    rows = integer_rows(flat, 3, seed=2)
    before = weights(flat)
    submit_round(core, flat, [*rows, torch.cat(byzantine_garbage([torch.zeros(flat.numel)], 1e30, seed=3))])
    torch.testing.assert_close(weights(flat), before - torch.stack(rows).mean(0), rtol=0, atol=1e-5)
    assert core.update.bound.statistics()["dropped"] == 1 and core.update.bound.counts["unjudged"] == 3
