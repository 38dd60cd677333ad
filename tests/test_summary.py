"""The summary headlines the model a run produces and refuses one that is not a model (NaN, Inf, blown up)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from launch.summary import dataset, product_problem
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


def test_product_problem_names_nan_weights_and_a_non_finite_loss():
    healthy = {"w": torch.ones(3), "steps": torch.tensor(7)}
    assert product_problem(healthy, {"accuracy": 0.9, "loss": 0.2}) is None
    assert product_problem(healthy, {}) is None  # a task without a test set (consensus)
    assert product_problem({"w": torch.tensor([0.0, math.nan])}, {"loss": 0.2}) == "its weights hold NaN or Inf"
    assert product_problem(healthy, {"loss": math.inf}) == "its test loss is inf"
    assert "blown up" in product_problem({"w": torch.full((2,), 1e20)}, {"loss": 1.0})


def test_the_data_is_the_first_peers_and_peers_with_other_data_are_named():
    def ready(sha: str) -> list[dict]:
        return [{"event": "start"}, {"event": "ready", "dataset": {"name": "text", "sha256": sha}}]

    assert dataset([ready("a"), ready("a")]) == {"name": "text", "sha256": "a"}
    assert dataset([[{"event": "start"}], ready("a"), ready("b"), ready("a")])["differs"] == {"2": "b"}
    assert dataset([[], []]) == {}


def test_gossip_summary_headlines_the_averaged_model_and_refuses_a_nan_one(launch_run):
    run = launch_run("--steps", "5", "--eval-every", "0", nodes=2)
    summary = run.summary
    assert summary["accuracy"] == summary["final_model"]["accuracy"] and summary["error"] is None
    results = run.stdout[run.stdout.index("\n   1 ") + 1:].splitlines()[1]  # the line after the last peer's
    assert results.startswith("accuracy") and "push-sum weighted average, model-final.pt" in results, run.stdout
    assert "mean test accuracy" in run.stdout

    state = torch.load(run.out / "model-1.pt", weights_only=True)
    first = next(name for name, tensor in state.items() if tensor.is_floating_point())
    state[first].view(-1)[0] = math.nan  # one NaN in one peer's model poisons the average
    torch.save(state, run.out / "model-1.pt")
    proc = subprocess.run([sys.executable, "-m", "launch.summary", str(run.out), "--no-plot"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "python -m launch.summary: error: the peers' averaged model (model-final.pt) is not a usable model: its "
        "weights hold NaN or Inf; lower --lr (now 0.05)"], proc.stderr
    assert "accuracy " not in proc.stdout  # no table for a model that is not one
    refused = run.summary
    assert refused["error"].startswith("the peers' averaged model") and refused["accuracy"] is not None
