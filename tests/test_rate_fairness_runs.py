"""Every peer's data counts alike, at any speed: real peer processes on the quadratic task whose answer is
known (``tests/tasks.py:targets``: peer i minimises 0.5 |x - b_i|^2, so the right model is mean b).

In every mode, with equal speeds and with one peer four times slower, the product model must reach mean b:
exactly in the synchronous modes (below 1e-9), and in the asynchronous ones either exactly (the server's
memory of each worker's latest gradient: below 1e-6) or with a constant-step bias that falls with the
learning rate (at a quarter of it, with four times the steps, well under the error: below, at most 0.6 of it).
A rate-weighted
fixed point (rate compensation off) or a slow peer training alone at the end (each peer's own quota) keeps
its error whatever the learning rate, and fails.

gossip-async runs plain SGD (momentum 0), the regime of its analysis: with momentum 0.9 the effective step
lr / (1 - mu) is 0.5 here, and the last iterate's error is dominated by the order in which the six peers'
steps happen to land, not by a bias. The server modes run at the default momentum, which only speeds their
convergence to the exact fixed point.
"""

from __future__ import annotations

import pytest

SPEEDS = {"equal": "1,1,1,1,1,1", "slow": "1,1,1,1,1,0.25"}
BASE = ("--task", "tests.tasks:targets", "--dim", "10", "--compute-ms", "2", "--log-every", "1000")
LR, STEPS = 0.05, 200
ASYNCHRONOUS = ["gossip-async", "ps-async", "ps-ssp", "ps-dcasgd"]


def error(run) -> float:
    return run.summary["final_model"]["error"]


def quadratic(launch_run, mode: str, speeds: str, lr: float, steps: int, *extra: str, name: str = "run"):
    momentum = ("--momentum", "0") if mode == "gossip-async" else ()
    return launch_run(*BASE, "--mode", mode, "--speeds", SPEEDS[speeds], "--lr", str(lr), "--steps", str(steps),
                      *momentum, *extra, nodes=6, name=name, timeout=120)


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("mode", ["gossip-sync", "ps-sync", "ps-avg"])
def test_the_synchronous_modes_reach_the_mean_of_the_objectives_exactly(launch_run, mode, speeds):
    run = quadratic(launch_run, mode, speeds, LR, 2 * STEPS)
    assert error(run) < 1e-9, error(run)


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("mode", ASYNCHRONOUS)
def test_the_asynchronous_modes_reach_the_mean_of_the_objectives(launch_run, mode, speeds):
    """gossip-async's error is the mean of six runs (seeds 0 to 5) at each learning rate: its last iterate
    also has a random part, from the order in which the peers' last steps land, about as large as the bias
    at lr / 4. Over 40 runs at each learning rate on an idle machine (equal speeds) the mean error at lr / 4
    was 0.29 of the mean at lr, as a bias in proportion to lr makes it (0.25); a bias that does not fall
    would keep it near 1. Drawn from those runs, the mean of four at lr / 4 exceeded half the mean of four
    at lr in 4.4% of draws (two full-suite runs of one day failed so, at 0.53 and 0.67), six in 2.0%; with
    the bound at 0.6, six in 0.3%. The server's memory makes its modes exact."""
    seeds = tuple(range(6)) if mode == "gossip-async" else (0,)
    runs = {lr: [quadratic(launch_run, mode, speeds, lr, round(STEPS * LR / lr), "--seed", str(seed),
                           name=f"lr{LR / lr:g}-seed{seed}") for seed in seeds] for lr in (LR, LR / 4)}
    fast, slow = (sum(error(run) for run in runs[lr]) / len(seeds) for lr in (LR, LR / 4))
    assert slow <= 0.6 * fast or max(fast, slow) < 1e-6, (fast, slow)
    for run in runs[LR] + runs[LR / 4]:
        steps = [next(e for e in run.events(r) if e["event"] == "end")["step"] for r in range(6)]
        budget = 6 * run.summary["steps"]  # the swarm's, spent (up to a step a peer: gossip-async looks ahead)
        assert budget - 6 <= sum(steps) <= budget + 6 * 6, steps
        if speeds == "slow":  # the fast peers take more than --steps steps on average, the slow one fewer
            # (not each fast peer: on a loaded machine one of them may be slowed too, 199 against 200)
            assert steps[5] < run.summary["steps"] < sum(steps[:5]) / 5, steps


@pytest.mark.parametrize("mode", ASYNCHRONOUS)
def test_with_a_slow_peer_the_asynchronous_modes_end_together(launch_run, mode):
    """Steps long enough (20 ms, the slow peer's 80 ms) that what the end events show is the rule, not the
    shared CPU's hiccups while the first peers to finish save their models."""
    run = launch_run("--task", "tests.tasks:targets", "--dim", "10", "--compute-ms", "20", "--steps", "40",
                     "--mode", mode, "--speeds", SPEEDS["slow"], nodes=6)
    ends = [next(e for e in run.events(r) if e["event"] == "end") for r in range(6)]
    # nobody trains alone: the last peer to stop began its last step while another still trained
    last = max(ends, key=lambda e: e["trained_until"])
    assert last["last_step_began"] < max(e["trained_until"] for e in ends if e is not last), ends
    # and no peer waited for the end longer than one of the slow peer's steps
    idle = last["trained_until"] - min(e["trained_until"] for e in ends)
    assert idle < ends[5]["step_seconds"], (idle, ends[5]["step_seconds"])


def test_without_rate_compensation_a_slow_peer_counts_by_its_rate(launch_run):
    """The rate-weighted fixed point that ``--rate-compensation off`` keeps: the error does not fall with the
    learning rate (the guard that the test above can fail)."""
    fast = quadratic(launch_run, "ps-async", "slow", LR, STEPS, "--rate-compensation", "off", name="lr")
    slow = quadratic(launch_run, "ps-async", "slow", LR / 4, 4 * STEPS, "--rate-compensation", "off", name="lr4")
    assert error(slow) > error(fast) / 2 and error(slow) > 0.05, (error(fast), error(slow))
