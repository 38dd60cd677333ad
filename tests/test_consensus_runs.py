"""Averaging itself, measured on real peer processes: the consensus task (no training, only mixing).

For gossip-sync the peers' traces must follow x_{t+1} = W_t x_t exactly (to float64 rounding), the
consensus distance must shrink every round by at most the contraction bound ||W_t - J||, and on fixed
graphs the asymptotic rate must equal the second-largest eigenvalue modulus of W.
"""

from __future__ import annotations

import numpy as np
import pytest

import topologies
from tests.conftest import consensus_distance as distance
from tests.conftest import load_traces

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("spec,nodes,rounds,extra", [
    ("ring", 8, 30, ()), ("torus:4x2", 8, 12, ()), ("random:degree=3", 8, 12, ()),
    ("random:degree=3", 8, 12, ("--no-overlap",)),  # the weights sent uncopied and mixed in place
])
def test_sync_consensus_follows_the_mixing_matrix(launch_run, spec, nodes, rounds, extra):
    run = launch_run("--task", "consensus", "--topology", spec, "--steps", str(rounds), "--dim", "64", *extra,
                     nodes=nodes)
    topology = topologies.build(spec, nodes)
    recorded, x = load_traces(run.out, nodes)
    np.testing.assert_array_equal(recorded, np.arange(rounds + 1))

    expected = x[0]
    for t in range(rounds):
        expected = topology.mixing_matrix(t) @ expected
        np.testing.assert_allclose(x[t + 1], expected, rtol=0, atol=1e-12, err_msg=f"round {t + 1}")

    mean0 = x[0].mean(0)
    assert max(np.abs(x[t].mean(0) - mean0).max() for t in range(rounds + 1)) < 1e-13  # the mean never moves
    assert run.summary["mean_drift"] < 1e-12
    # nothing writes the weights between rounds: sent uncopied, even with overlap
    assert all(next(e for e in run.events(r) if e["event"] == "end")["snapshot_copies"] == 0
               for r in range(nodes) if "--no-overlap" not in extra)

    ratios = [distance(x[t + 1]) / distance(x[t]) for t in range(rounds)]
    for t, ratio in enumerate(ratios):
        assert ratio <= topology.contraction(t) + 1e-9, f"round {t}: {ratio} > bound {topology.contraction(t)}"
    if not topology.time_varying:
        slem = topology.slem(0)
        assert ratios[-1] == pytest.approx(slem, abs=2e-3), (ratios, slem)
        trace = run.summary["consensus_trace"]
        assert [row["round"] for row in trace] == list(range(rounds + 1))
        assert trace[-1]["distance"] == pytest.approx(distance(x[-1]), rel=1e-9)


def test_rank_values_reach_the_exact_mean(launch_run):
    """Rank r starts at the value r; after enough rounds every peer holds (N - 1) / 2."""
    nodes = 6
    run = launch_run("--task", "tests.tasks:rank_value", "--steps", "60", "--dim", "4", nodes=nodes)
    _, x = load_traces(run.out, nodes)
    np.testing.assert_array_equal(x[0][:, 0], np.arange(nodes))
    np.testing.assert_allclose(x[-1], (nodes - 1) / 2, atol=1e-9)
    assert run.summary["consensus_distance"] < 1e-9


def test_full_graph_averages_exactly_in_one_round(launch_run):
    run = launch_run("--task", "tests.tasks:rank_value", "--topology", "full", "--steps", "1", "--dim", "3", nodes=5)
    _, x = load_traces(run.out, 5)
    np.testing.assert_allclose(x[1], 2.0, rtol=0, atol=1e-15)
