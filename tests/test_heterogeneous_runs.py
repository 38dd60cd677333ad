"""Heterogeneous peers on real processes through the launcher: adaptive deadlines with a slow peer, time-based
rounds, staleness weights as configured, and partner choice by speed class."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

import topologies
from gossip.tasks.consensus import initial_vector

pytestmark = pytest.mark.timeout(180)
SLOW_LAST = "1,1,1,0.25"


def end_event(run, rank: int) -> dict:
    return next(e for e in run.events(rank) if e["event"] == "end")


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_adaptive_deadlines_never_deadlock_keep_the_mean_and_report_the_straggler(launch_run, overlap):
    dim = 16
    run = launch_run("--task", "consensus", "--dim", str(dim), "--steps", "40", "--deadline", "adaptive",
                     "--speeds", SLOW_LAST, "--compute-ms", "20", "--deadline-window", "8", overlap, nodes=4)
    weights = np.array([end_event(run, r)["weight"] for r in range(4)])
    values = np.stack([torch.load(run.out / f"model-{r}.pt", weights_only=True)["value"].numpy() for r in range(4)])
    start = np.stack([initial_vector(r, dim, 0).numpy() for r in range(4)])
    assert weights.sum() == pytest.approx(4.0, abs=1e-12)
    np.testing.assert_allclose(weights @ values / weights.sum(), start.mean(0), rtol=0, atol=1e-12)
    summary = run.summary
    assert summary["final_mean_drift"] < 1e-12
    assert summary["chronic_stragglers"] == {"3": [0, 2]}
    assert "chronic straggler        peer 3 (missed its deadlines at peer(s) 0, 2" in run.stdout
    assert "neighbour 3 missed its deadline" in (run.out / "peer-0.log").read_text()
    # peer 0 mixes much of the straggler's mass late; peer 1 (fast neighbours only) at most a scheduling hiccup
    assert summary["peers"][0]["late_mixed"] > summary["peers"][1]["late_mixed"]


def test_time_rounds_give_faster_peers_more_local_steps(launch_run):
    rounds = 20
    run = launch_run("--task", "consensus", "--dim", "16", "--schedule", "time", "--round-seconds", "0.1",
                     "--rounds", str(rounds), "--speeds", SLOW_LAST, "--compute-ms", "20", "--deadline", "adaptive",
                     "--weight-by", "samples", nodes=4)
    peers = run.summary["peers"]
    assert [p["rounds"] for p in peers] == [rounds] * 4
    steps = [p["steps"] for p in peers]
    assert steps[3] >= rounds  # at least one step per round, however slow
    assert min(steps[:3]) >= 2 * steps[3], steps  # 4x faster: about 3-4x the steps in the same rounds
    assert run.summary["schedule"] == "time" and run.summary["rounds"] == rounds


@pytest.mark.parametrize("kind", ["exp", "inverse"])
def test_async_staleness_weights_follow_the_configured_function(launch_run, kind):
    temperature, max_staleness = 2.0, 2
    run = launch_run("--mode", "gossip-async", "--async-rule", "latest", "--task", "consensus", "--dim", "16",
                     "--steps", "60",
                     "--speeds", "1,1,1,0.3", "--compute-ms", "5", "--staleness-weight", kind,
                     *(["--staleness-temperature", str(temperature)] if kind == "exp" else []),
                     "--max-staleness", str(max_staleness), nodes=4)
    w = topologies.build("ring", 4).mixing_matrix(0)
    f = {"exp": lambda tau: math.exp(-tau / temperature), "inverse": lambda tau: 1 / (1 + tau)}[kind]
    for rank in range(4):
        mixes = [e["last_mix"] for e in run.events(rank) if e["event"] == "step" and e["mixed"]]
        taus: Counter[int] = Counter()
        for mix in mixes:
            neighbours = {int(j): entry for j, entry in mix.items() if j != "self"}
            total = w[rank, rank] + sum(w[rank, j] * f(tau) for j, (tau, _, _) in neighbours.items())
            assert mix["self"] == pytest.approx(w[rank, rank] / total, rel=1e-12)
            for j, (tau, w_ij, coef) in neighbours.items():
                assert w_ij == w[rank, j] and 0 <= tau <= max_staleness
                assert coef == pytest.approx(w_ij * f(tau) / total, rel=1e-12)
                taus[tau] += 1
        end = end_event(run, rank)
        assert {int(t): n for t, n in end["staleness"].items()} == taus  # the histogram is what was mixed
        assert run.summary["peers"][rank]["staleness"] == end["staleness"]
    slow_neighbour = end_event(run, 0)
    assert max(map(int, slow_neighbour["staleness"])) == max_staleness and slow_neighbour["ignored_stale"] > 0


def test_similar_speed_partners_follow_their_own_mixing_matrices(launch_run):
    speeds, nodes, steps = "1,1,0.5,0.5,1,1,0.5,0.5", 8, 10
    run = launch_run("--task", "consensus", "--dim", "8", "--steps", str(steps), "--topology", "random",
                     "--partners", "similar-speed", "--speeds", speeds, nodes=nodes)
    topology = topologies.prefer_similar(topologies.build("random", nodes),
                                         topologies.speed_classes([float(s) for s in speeds.split(",")]))
    traces = [np.load(run.out / f"trace-{r}.npz") for r in range(nodes)]
    x = np.stack([t["values"] for t in traces], axis=1)
    for t in range(steps):
        np.testing.assert_allclose(x[t + 1], topology.mixing_matrix(t) @ x[t], rtol=0, atol=1e-12)
