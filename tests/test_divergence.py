"""A run whose model learned nothing fails with one line unless ``--allow-divergence``: its test loss is no
lower than the untrained model's, or (a task that measures accuracy) its accuracy is chance."""

from __future__ import annotations

import json

import pytest

from gossip.config import GossipConfig, RunConfig
from launch.summary import CHANCE_MARGIN, divergence, remedy
from launch.summary import main as summary_main

UNTRAINED = {"accuracy": 0.106, "loss": 2.312}


@pytest.mark.parametrize("final,chance,expected", [
    ({"accuracy": 0.93, "loss": 0.25}, 0.101, None),
    ({"accuracy": 0.100, "loss": 86.3}, 0.101, "its test loss 86.3 is no lower than the untrained model's 2.312"),
    ({"accuracy": 0.101, "loss": 2.3026}, 0.101, "its test accuracy 0.101 is chance (always guessing the commonest "
                                                 "label scores 0.101)"),
    ({"accuracy": 0.101 + CHANCE_MARGIN + 0.001, "loss": 2.2}, 0.101, None),
    ({"accuracy": 0.101, "loss": 2.3026}, None, None),  # no chance: loss only (charlm's accuracy starts there)
    ({"loss": 2.312}, None, "its test loss 2.312 is no lower than the untrained model's 2.312"),
    ({}, 0.101, None),  # a task that evaluates nothing
])
def test_learning_nothing_is_a_loss_no_lower_than_untrained_or_chance_accuracy(final, chance, expected):
    assert divergence(final, UNTRAINED, chance) == expected


def test_the_remedy_names_the_cause():
    assert remedy(RunConfig(lr=100), None) == "lower --lr (now 100)"
    assert remedy(RunConfig(lr=100), {"optimizer": {"lr": 1.0}}) == "lower --lr (now 100) or set --server-lr"
    garbage = RunConfig(gossip=GossipConfig.of(world_size=4, byzantine=(3,)))
    assert remedy(garbage, None) == ("the --byzantine peers' garbage reached the plain mean: use --aggregate median "
                                     "or trimmed-mean")
    asynchronous = RunConfig(gossip=GossipConfig.of(world_size=4, mode="ps-async", byzantine=(3,)))
    assert remedy(asynchronous, None) == ("the --byzantine peers' garbage reached the plain mean: use --aggregate "
                                          "norm-clip")  # (one gradient per update has no median)


@pytest.mark.timeout(150)
def test_a_run_at_chance_fails_unless_divergence_is_allowed(launch_run):
    run = launch_run("--lr", "100", "--steps", "60", expect_ok=False)
    assert run.returncode == 1
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("gossip-launch: error: the run diverged: the peers' averaged model (model-final.pt) "
                           "learned nothing: its test") and "lower --lr (now 100), or pass --allow-divergence" in line
    assert run.summary["diverged"] and run.summary["error"] and run.summary["untrained_model"]["loss"] > 2
    # the same verdict when the files are summarised on their own (peers started by hand or under torchrun)
    assert summary_main([str(run.out), "--no-plot"]) == 1
    assert summary_main([str(run.out), "--no-plot", "--allow-divergence"]) == 0
    allowed = launch_run("--lr", "100", "--steps", "60", "--allow-divergence", name="allowed")
    assert allowed.returncode == 0
    assert allowed.stderr.strip().splitlines()[-1].startswith("warning: the run diverged: the peers' averaged model")
    summary = json.loads((allowed.out / "summary.json").read_text())
    assert summary["diverged"] == run.summary["diverged"] and summary["error"] is None
