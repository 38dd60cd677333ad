"""Optimizers, learning-rate schedules and the training recipes "auto" resolves to, without processes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gossip.config import CoordinatorConfig, RunConfig
from gossip.coordinator.modes import server_optimizer
from gossip.optim import BASE_LR, OptimizerSpec, Schedule, run_schedule
from launch.flags import FLAGS, field_values, flag_argv


def test_warm_up_then_cosine_to_the_floor_in_closed_form():
    schedule = Schedule("cosine", total=100, warmup=10, min_ratio=0.1)
    assert [schedule.factor(t) for t in (1, 5, 10)] == [0.1, 0.5, 1.0]
    assert schedule.factor(55) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert schedule.factor(100) == pytest.approx(0.1) and schedule.factor(250) == pytest.approx(0.1)
    for t in range(11, 101):
        p = (t - 10) / 90
        assert schedule.factor(t) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * p)) / 2, abs=1e-15)


def test_linear_and_constant():
    linear = Schedule("linear", total=20, warmup=0, min_ratio=0.0)
    assert [linear.factor(t) for t in (1, 10, 20)] == pytest.approx([0.95, 0.5, 0.0])
    assert Schedule("constant", total=20, warmup=4).factor(2) == 0.5
    assert Schedule("constant", total=20, warmup=4).factor(19) == 1.0
    assert Schedule().trivial and not Schedule("constant", warmup=1).trivial and not Schedule("linear").trivial


def test_apply_scales_each_groups_own_lr_and_the_base_survives_a_checkpoint():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "lr": 0.01}, {"params": [model.bias], "lr": 0.002}])
    schedule = Schedule("linear", total=10, warmup=0)
    schedule.apply(optimizer, 5)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.005, 0.001])
    state = optimizer.state_dict()
    fresh = torch.optim.AdamW([{"params": [model.weight], "lr": 0.5}, {"params": [model.bias], "lr": 0.5}])
    fresh.load_state_dict(state)  # a resumed peer: the base lr comes back with the optimizer state
    schedule.apply(fresh, 6)
    assert [g[BASE_LR] for g in fresh.param_groups] == [0.01, 0.002]
    assert [g["lr"] for g in fresh.param_groups] == pytest.approx([0.004, 0.0008])


def test_adamw_decays_matrices_only():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    optimizer = OptimizerSpec("adamw", lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1).build(model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, plain = optimizer.param_groups
    assert {p.dim() for p in decayed["params"]} == {2} and decayed["weight_decay"] == 0.1
    assert {p.dim() for p in plain["params"]} == {1} and plain["weight_decay"] == 0.0
    assert decayed["betas"] == (0.8, 0.99)
    sgd = OptimizerSpec("sgd", lr=0.1, momentum=0.5).build(model.parameters())
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.5


def test_the_server_schedules_by_version_and_keeps_the_auto_rule():
    schedule = Schedule("cosine", total=300, warmup=15, min_ratio=0.1)
    adamw = OptimizerSpec("adamw", lr=3e-3, betas=(0.9, 0.999), weight_decay=0.1)
    sync = server_optimizer("ps-sync", adamw, 4, CoordinatorConfig(), schedule)
    assert (sync.lr, sync.momentum, sync.schedule) == (3e-3, 0.9, schedule)
    # 4 updates in flight: beta1 loses the momentum asynchrony adds; AdamW's step per update is lr / k
    asynchronous = server_optimizer("ps-async", adamw, 4, CoordinatorConfig(), schedule)
    assert asynchronous.lr == pytest.approx(3e-3 / 4) and asynchronous.momentum == pytest.approx(0.15)
    assert (asynchronous.schedule.total, asynchronous.schedule.warmup) == (1200, 60)  # the same share of gradients
    assert asynchronous.schedule.min_ratio == 0.1 and asynchronous.beta2 == 0.999
    halves = server_optimizer("ps-ssp", adamw, 8, CoordinatorConfig(soft_sync=2), schedule)  # k = 4
    assert halves.lr == pytest.approx(3e-3 / 4) and halves.schedule.total == 1200
    built = asynchronous.build(torch.nn.Linear(2, 2).parameters())
    assert isinstance(built, torch.optim.AdamW) and built.param_groups[0]["betas"] == pytest.approx((0.15, 0.999))
    given = server_optimizer("ps-async", adamw, 4, CoordinatorConfig(server_lr=1e-4, server_momentum=0.5))
    assert (given.lr, given.momentum) == (1e-4, 0.5)


def test_auto_is_the_tasks_recipe_and_an_explicit_value_wins():
    digits = RunConfig()
    assert (digits.optimizer, digits.lr, digits.steps, digits.batch_size, digits.lr_schedule) == \
        ("sgd", 0.05, 300, 32, "constant")
    charlm = RunConfig(task="charlm")
    assert (charlm.optimizer, charlm.lr, charlm.steps, charlm.batch_size, charlm.weight_decay) == \
        ("adamw", 3e-3, 1000, 16, 0.1)
    assert (charlm.lr_schedule, charlm.warmup_steps, charlm.min_lr) == ("cosine", 50, pytest.approx(3e-4))
    shorter = RunConfig(task="charlm", steps="200", lr="1e-3")  # strings, as the flags give them
    assert (shorter.steps, shorter.warmup_steps, shorter.lr, shorter.min_lr) == (200, 10, 1e-3, pytest.approx(1e-4))
    other = RunConfig(task="digits", optimizer="adamw")  # another optimizer than the recipe's: its usual lr
    assert (other.lr, other.weight_decay) == (1e-3, 0.01)
    assert run_schedule(charlm) == Schedule("cosine", 1000, 50, pytest.approx(0.1))


def test_a_resolved_config_round_trips_and_its_flags_leave_out_what_auto_gives():
    cfg = RunConfig(task="charlm", steps=200, lr=1e-3, nodes=2, gossip=dataclasses.replace(RunConfig().gossip,
                                                                                           world_size=2))
    assert RunConfig.from_dict(__import__("json").loads(cfg.to_json())) == cfg
    argv = flag_argv(field_values(cfg), FLAGS)
    assert argv[argv.index("--steps") + 1] == "200" and argv[argv.index("--lr") + 1] == "0.001"
    assert not {"--warmup-steps", "--min-lr", "--optimizer", "--batch-size", "--weight-decay"} & set(argv), argv
