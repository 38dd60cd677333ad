"""The outer step of decentralized DiLoCo (gossip/averagers/outer.py), pure: its closed form round after
round, the plain gossip it reduces to, the server's outer step it equals when every peer holds the same mean,
and its state in a checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip.api import gossip_outer
from gossip.averagers.outer import OuterStep
from gossip.config import CoordinatorConfig
from gossip.errors import CheckpointError
from gossip.flat import FlatParams


def flat_of(values: list[float]) -> FlatParams:
    model = nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return FlatParams(model, 1 << 20)


def weights(flat: FlatParams) -> torch.Tensor:
    return flat.segments[0].clone()


def test_outer_sgd_with_lr_1_and_no_momentum_is_plain_gossip_and_builds_no_outer_step():
    for settings in ({}, {"outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}):
        assert gossip_outer(CoordinatorConfig(**settings)) is None
    assert gossip_outer(CoordinatorConfig(outer_optimizer="nesterov")) == ("nesterov", 0.7, 0.9)
    assert gossip_outer(None) is None


@pytest.mark.parametrize("name", ["nesterov", "sgd"])
def test_the_outer_step_follows_its_closed_form_round_after_round(name):
    lr, mu = 0.7, 0.9
    start = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    flat = FlatParams(nn.Linear(3, 1, bias=False).double(), 1 << 20)
    flat.segments[0].copy_(start)
    outer = OuterStep(flat, name, lr, mu)
    anchor, momentum = start.clone(), torch.zeros(3, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        mixed = anchor + torch.randn(3, generator=generator, dtype=torch.float64)  # inner steps, then the mix
        flat.segments[0].copy_(mixed)
        outer.apply_()
        delta = anchor - mixed
        momentum = mu * momentum + delta
        anchor = anchor - lr * (delta + mu * momentum if name == "nesterov" else momentum)
        torch.testing.assert_close(weights(flat), anchor, rtol=0, atol=1e-12)
        torch.testing.assert_close(outer.anchor[0], anchor, rtol=0, atol=1e-12)


def test_with_every_peer_at_the_same_mean_it_is_the_servers_outer_step():
    """DiLoCo: the server steps torch's SGD (Nesterov) with the workers' mean change as the gradient. Peers
    that start from the same anchor and mix to the exact mean (a complete graph) take the same step."""
    start = [0.3, -1.2, 2.0]
    workers = [torch.tensor([0.1, -1.0, 2.5]), torch.tensor([0.7, -1.6, 1.0]), torch.tensor([0.0, -0.5, 2.2])]
    mean = torch.stack(workers).mean(0)
    server = nn.Parameter(torch.tensor(start))
    optimizer = torch.optim.SGD([server], lr=0.7, momentum=0.9, nesterov=True)
    peers = [flat_of(start) for _ in workers]
    outers = [OuterStep(flat, "nesterov", 0.7, 0.9) for flat in peers]
    for round in range(3):
        server.grad = server.detach() - mean - round * 0.1
        optimizer.step()
        for flat, outer in zip(peers, outers):
            flat.segments[0].copy_(mean + round * 0.1)
            outer.apply_()
            torch.testing.assert_close(weights(flat), server.detach(), rtol=0, atol=1e-6)
        mean = server.detach() - torch.tensor([0.05, -0.02, 0.01])  # the next round's mean change


def test_the_outer_state_survives_a_checkpoint_and_one_that_does_not_fit_is_one_line():
    flat = flat_of([1.0, 2.0])
    outer = OuterStep(flat, "nesterov", 0.7, 0.9)
    flat.segments[0].copy_(torch.tensor([0.5, 2.5]))
    outer.apply_()
    state = outer.state_dict()
    again = OuterStep(flat_of([9.0, 9.0]), "nesterov", 0.7, 0.9)
    again.load_state_dict(state)
    assert torch.equal(again.anchor[0], outer.anchor[0]) and torch.equal(again.buffers[0], outer.buffers[0])
    assert again.steps == 1
    with pytest.raises(CheckpointError, match=r"^the checkpoint's outer anchor does not fit this model's 1 flat"):
        OuterStep(flat_of([1.0, 2.0, 3.0]), "nesterov", 0.7, 0.9).load_state_dict(state)
    state["momentum"][0][0] = float("nan")
    with pytest.raises(CheckpointError, match="^the checkpoint's outer momentum holds NaN or Inf$"):
        again.load_state_dict(state)


def test_outer_sgd_1_0_computed_out_is_the_mix_to_float_rounding():
    flat = flat_of([1.0, 2.0, -0.5])
    outer = OuterStep(flat, "sgd", 1.0, 0.0)
    mixed = torch.tensor([0.25, 1.75, -0.125])
    flat.segments[0].copy_(mixed)
    outer.apply_()
    torch.testing.assert_close(weights(flat), mixed, rtol=0, atol=1e-6)
    assert torch.equal(outer.anchor[0], weights(flat)) and outer.buffers == []


# -- real runs --------------------------------------------------------------------------------------------

def _ends(run, nodes: int) -> list[dict]:
    return [next(e for e in run.events(rank) if e["event"] == "end") for rank in range(nodes)]


def test_the_outer_step_keeps_every_weight_1_and_the_networks_mean_on_the_consensus_task(launch_run):
    """No inner steps: what the outer step does to the mean is all that could move it, and over the lockstep
    mix (W doubly stochastic, every weight 1) the peers' pseudo-gradients cancel: the mean holds."""
    run = launch_run("--task", "consensus", "--steps", "60", "--outer-optimizer", "nesterov")
    summary = run.summary
    assert summary["final_mean_drift"] < 1e-9 and summary["consensus_distance"] < 1e-6, summary
    assert [end["weight"] for end in _ends(run, 4)] == [1.0] * 4


def test_a_restarted_peer_resumes_its_outer_anchor_and_momentum(launch_run, tmp_path, monkeypatch):
    """Peer 1 dies after its checkpoint of step 40 (8 mixes, 8 outer steps) and is restarted: it resumes the
    anchor and momentum saved there, and counts its outer steps on from 8, one per mix it then takes."""
    monkeypatch.setenv("GOSSIP_TEST_MARK", str(tmp_path / "died"))
    run = launch_run("--steps", "200", "--gossip-every", "5", "--checkpoint-every", "20", "--max-restarts", "1",
                     "--outer-optimizer", "nesterov", "--task", "tests.tasks:dies_once_on_rank_1", nodes=3)
    assert "peer 1 failed (exit 9)" in run.stderr and "restarted it with --resume (1 of 1)" in run.stderr
    events = run.events(1)
    resumed = next(e for e in events if e["event"] == "resume")
    rejoined = [e for e in events if e["event"] == "ready"][-1]
    assert resumed["found"] and resumed["step"] == 40 and resumed["outer_steps"] == 8, resumed
    ends = _ends(run, 3)
    assert [end["outer_steps"] for end in ends] == [40, 8 + 40 - rejoined["round"], 40], (rejoined, ends)
    state = torch.load(run.out / "checkpoint-1.pt", weights_only=True)
    assert [a.shape for a in state["outer"]["anchor"]] == [s.shape for s in state["outer"]["momentum"]]
