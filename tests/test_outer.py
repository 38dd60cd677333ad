"""ps-avg's outer step (DiLoCo): the closed form, the reduction to plain averaging, and its saved state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gossip.config import CoordinatorConfig, GossipConfig, RunConfig
from gossip.coordinator.averaging import OuterStep, ParameterAverage
from gossip.coordinator.core import Contribution
from gossip.coordinator.modes import build_core, outer_optimizer
from gossip.errors import ConfigError
from gossip.flat import FlatParams

WORKERS = 3


def model_and_flat(seed: int = 0) -> tuple[nn.Module, FlatParams]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    return model, FlatParams(model, 1 << 20)


def worker_weights(flat: FlatParams, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Each worker's weights after its local steps: the server's plus a random change."""
    return [[view + torch.randn(view.shape, generator=generator, dtype=view.dtype) for view in flat.views()]
            for _ in range(WORKERS)]


def core_for(flat: FlatParams, model: nn.Module, **settings):
    settings = CoordinatorConfig(**settings)
    optimizer = outer_optimizer(settings).build(model.parameters())
    core = build_core("ps-avg", settings, flat, optimizer, WORKERS)
    for worker in range(WORKERS):
        core.join(worker)
    return core


def one_round(core, weights: list[list[torch.Tensor]]) -> None:
    for worker, chunks in enumerate(weights):
        core.submit(Contribution(worker, core.version, core.version + 1, chunks))


def flat_copy(flat: FlatParams) -> torch.Tensor:
    return torch.cat([view.clone() for view in flat.views()])


def test_the_default_outer_step_is_the_plain_average_and_outer_sgd_1_0_equals_it_to_rounding():
    model, flat = model_and_flat()
    assert isinstance(core_for(flat, model).update, ParameterAverage)  # the defaults: one fused pass
    assert isinstance(core_for(flat, model, outer_optimizer="nesterov").update, OuterStep)
    assert isinstance(core_for(flat, model, outer_lr=0.5).update, OuterStep)
    averaged_model, averaged = model_and_flat()
    stepped_model, stepped = model_and_flat()
    plain = core_for(averaged, averaged_model)
    outer = OuterStep(stepped, torch.optim.SGD(stepped_model.parameters(), lr=1.0, momentum=0.0))
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        weights = worker_weights(averaged, generator)
        one_round(plain, weights)
        outer.apply([Contribution(w, 0, 1, c) for w, c in enumerate(weights)], [0] * WORKERS, 1)
        mean = [sum(chunks) / WORKERS for chunks in zip(*weights)]
        torch.testing.assert_close(flat_copy(averaged), torch.cat(mean), rtol=0, atol=1e-12)
        torch.testing.assert_close(flat_copy(stepped), flat_copy(averaged), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, lr, mu", [("nesterov", 0.7, 0.9), ("sgd", 0.5, 0.8), ("nesterov", 1.3, 0.5)])
def test_the_outer_step_follows_its_closed_form_round_after_round(name, lr, mu):
    model, flat = model_and_flat()
    settings = {"outer_optimizer": name, "outer_lr": lr, "outer_momentum": mu}
    core = core_for(flat, model, **settings)
    parameters = [p.numel() for p in model.parameters()]  # parameters first, then BatchNorm's buffers
    cut = sum(parameters)
    theta = flat_copy(flat)
    momentum = torch.zeros(cut, dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    for _ in range(5):
        weights = worker_weights(flat, generator)
        one_round(core, weights)
        mean = torch.cat([sum(chunks) / WORKERS for chunks in zip(*weights)])
        delta = theta[:cut] - mean[:cut]
        momentum = mu * momentum + delta  # m <- mu m + delta (PyTorch's first step: m = delta)
        step = delta + mu * momentum if name == "nesterov" else momentum
        theta = torch.cat([theta[:cut] - lr * step, mean[cut:]])  # buffers: the workers' mean
        torch.testing.assert_close(flat_copy(flat), theta, rtol=0, atol=1e-12)
    assert core.applied[-1].lr == lr


def test_the_outer_momentum_survives_a_checkpoint():
    generator = torch.Generator().manual_seed(3)
    rounds = [worker_weights(model_and_flat()[1], generator) for _ in range(4)]
    model, flat = model_and_flat()
    core = core_for(flat, model, outer_optimizer="nesterov")
    for weights in rounds[:2]:
        one_round(core, weights)
    saved, saved_weights = copy.deepcopy(core.state_dict()), flat_copy(flat)  # as written to disk
    assert saved["update"]["optimizer"]["state"]  # the momentum buffers are in it
    restored_model, restored_flat = model_and_flat(seed=9)
    restored = core_for(restored_flat, restored_model, outer_optimizer="nesterov")
    restored.load_state_dict(saved)
    with torch.no_grad():
        for view, value in zip(restored_flat.views(), saved_weights.split([v.numel() for v in flat.views()])):
            view.copy_(value)
    forgotten_model, forgotten_flat = model_and_flat(seed=9)  # the same weights, no momentum
    forgotten = core_for(forgotten_flat, forgotten_model, outer_optimizer="nesterov")
    with torch.no_grad():
        for view, value in zip(forgotten_flat.views(), saved_weights.split([v.numel() for v in flat.views()])):
            view.copy_(value)
    for weights in rounds[2:]:
        one_round(core, weights)
        one_round(restored, weights)
        one_round(forgotten, weights)
    torch.testing.assert_close(flat_copy(restored_flat), flat_copy(flat), rtol=0, atol=0)
    assert not torch.allclose(flat_copy(forgotten_flat), flat_copy(flat))  # the momentum mattered


def test_outer_settings_resolve_and_bad_ones_get_one_line():
    assert (outer_optimizer(CoordinatorConfig()).lr, outer_optimizer(CoordinatorConfig()).momentum) == (1.0, 0.0)
    nesterov = outer_optimizer(CoordinatorConfig(outer_optimizer="nesterov"))
    assert (nesterov.name, nesterov.lr, nesterov.momentum) == ("nesterov", 0.7, 0.9)  # OpenDiLoCo's
    mine = outer_optimizer(CoordinatorConfig(outer_optimizer="nesterov", outer_lr="0.5", outer_momentum=0.8))
    assert (mine.lr, mine.momentum) == (0.5, 0.8) and "DiLoCo" in mine.rule
    for settings, words in (({"outer_optimizer": "adam"}, "--outer-optimizer must be one of sgd, nesterov"),
                            ({"outer_lr": 0}, "--outer-lr must be auto or a number > 0"),
                            ({"outer_lr": float("inf")}, "--outer-lr"),
                            ({"outer_momentum": 1.0}, "--outer-momentum must be auto or a number in [0, 1)"),
                            ({"outer_optimizer": "nesterov", "outer_momentum": 0}, "needs --outer-momentum > 0")):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)")):
            CoordinatorConfig(**settings)
    for mode in ("ps-sync", "gossip-async", "ps-async"):
        with pytest.raises(ConfigError, match=f"--outer-optimizer sets the outer step of ps-avg's server or of each "
                                              f"gossip-sync peer, and --mode {mode} has none"):
            RunConfig(nodes=2, gossip=GossipConfig.of(world_size=2, mode=mode),
                      coordinator=CoordinatorConfig(outer_optimizer="nesterov"))
    for mode in ("gossip-sync", "ps-avg"):  # an outer step on compressed messages: DiLoCo's, with and without server
        RunConfig(nodes=4, gossip=GossipConfig.of(world_size=4, mode=mode, compress="int8"),
                  coordinator=CoordinatorConfig(outer_optimizer="nesterov"))
    with pytest.raises(ConfigError, match="ps-avg's server steps with --outer-lr"):
        RunConfig(nodes=2, gossip=GossipConfig.of(world_size=2, mode="ps-avg"),
                  coordinator=CoordinatorConfig(server_lr=1))
