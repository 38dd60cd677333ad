"""Every peer's data counts alike, at any speed: real peer processes on the quadratic task whose answer is
known (``tests/tasks.py:targets``: peer i minimises 0.5 |x - b_i|^2, so the right model is mean b).

In every mode, with equal speeds and with one peer four times slower, the product model must reach mean b:
exactly in the synchronous modes and the asynchronous server modes (below 1e-9: the server's memory of
each worker's latest gradient), and in gossip-async with a constant-step bias that falls with the
learning rate (at a quarter of it, with four times the steps, at most half the error, or within what the
peers' unequal credits leave, which is far below a rate-weighted fixed point's error). A rate-weighted
fixed point (rate compensation off) or a slow peer training alone at the end (each peer's own quota) keeps
its error whatever the learning rate, and fails.

gossip-async runs plain SGD (momentum 0), the regime of its analysis: with momentum 0.9 the effective step
lr / (1 - mu) is 0.5 here, and the last iterate's error is dominated by the order in which the six peers'
steps happen to land, not by a bias. The server modes run at the default momentum, which only speeds their
convergence to the exact fixed point.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.tasks import target_vectors

SPEEDS = {"equal": "1,1,1,1,1,1", "slow": "1,1,1,1,1,0.25"}
BASE = ("--task", "tests.tasks:targets", "--dim", "10", "--compute-ms", "2", "--log-every", "1000")
LR, STEPS = 0.05, 200
CREDIT_FLOOR = 0.01  # gossip-async: what the peers' unequal credits may leave, relative to the spread (below)
ASYNCHRONOUS = ["gossip-async", "ps-async", "ps-ssp", "ps-dcasgd"]


def error(run) -> float:
    return run.summary["final_model"]["error"]


def settled_error(run, seed: int) -> float:
    """``error`` of the network's push-sum mean averaged over the second half of each peer's sampled rounds
    (sum_i mean_t(w_i z_i) / sum_i mean_t(w_i)): the fixed point the run settles at, without the last
    iterate's random part."""
    _, answer, spread = target_vectors(seed, 6, 10)
    mass, weight, index = 0.0, 0.0, None
    for rank in range(6):
        trace = np.load(run.out / f"trace-{rank}.npz")
        later = trace["rounds"] >= trace["rounds"].max() / 2
        mass = mass + (trace["values"][later] * trace["weights"][later, None]).mean(0)
        weight += float(trace["weights"][later].mean())
        index = trace["index"]  # (the coordinates sampled: the same on every peer; all 10 here)
    assert len(index) == 10
    return float(np.linalg.norm(mass / weight - answer.numpy()[index])) / spread


def quadratic(launch_run, mode: str, speeds: str, lr: float, steps: int, *extra: str, name: str = "run"):
    momentum = ("--momentum", "0") if mode == "gossip-async" else ()
    return launch_run(*BASE, "--mode", mode, "--speeds", SPEEDS[speeds], "--lr", str(lr), "--steps", str(steps),
                      *momentum, *extra, nodes=6, name=name, timeout=120)


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("mode", ["gossip-sync", "ps-sync", "ps-avg"])
def test_the_synchronous_modes_reach_the_mean_of_the_objectives_exactly(launch_run, mode, speeds):
    run = quadratic(launch_run, mode, speeds, LR, 2 * STEPS)
    assert error(run) < 1e-9, error(run)


def assert_the_swarm_spent_its_budget(run, speeds: str) -> None:
    steps = [next(e for e in run.events(r) if e["event"] == "end")["step"] for r in range(6)]
    budget = 6 * run.summary["steps"]  # the swarm's, spent (up to a step a peer: gossip-async looks ahead)
    assert budget - 6 <= sum(steps) <= budget + 6 * 6, steps
    if speeds == "slow":  # the fast peers take more than --steps steps on average, the slow one fewer
        # (not each fast peer: on a loaded machine one of them may be slowed too, 199 against 200)
        assert steps[5] < run.summary["steps"] < sum(steps[:5]) / 5, steps


@pytest.mark.parametrize("speeds", SPEEDS)
def test_gossip_async_reaches_the_mean_of_the_objectives_with_a_bias_in_proportion_to_lr(launch_run, speeds):
    """Its error is that of its fixed point, measured over four runs (seeds 0 to 3) at each learning rate: the
    network's mean (push-sum weighted) averaged over the second half of each peer's rounds, from the traces
    (``settled_error``). At lr / 4, with four times the steps, it must fall by at least half, or be within
    ``CREDIT_FLOOR`` of the spread: what the peers' unequal credits leave, which does not fall with lr.

    The credits are rate compensation's, measured online from rates that a shared machine moves by +-10%,
    so they differ by a few percent, and the run minimises the credit-weighted mean of the objectives. Over
    seeds 0-7 at equal speeds and lr / 4 beside a busy process (2026-11-28), the target weighted by each
    peer's credited steps lay 0.0017-0.0066 of the spread from the answer (weighted by its steps,
    0.0033-0.0138), and the settled error was 0.0005-0.0075. The part that falls with lr is not much larger:
    0.006-0.019 at lr with equal speeds, 0.010-0.032 with a peer 4x slower (0.020-0.038 before every peer
    waited at the start until all are up). Without the floor, the ratio over four seeds came out above 1/2
    in 3 of 6 runs of this test at equal speeds (0.29-0.79; the code before the start wait 0.11-0.38) and in
    1 of 6 with the slow peer (0.54), six seeds did not keep it below (0.60 once in three), and neither did lr
    against lr / 16 or 2 lr against lr / 8 (0.58 once in six). A rate-weighted fixed point (rate
    compensation off, slow peer) ends 0.13-0.15 of the spread away at both learning rates, far beyond both
    bounds."""
    seeds = (0, 1, 2, 3)
    runs = {lr: [quadratic(launch_run, "gossip-async", speeds, lr, round(STEPS * LR / lr), "--seed", str(seed),
                           name=f"lr{LR / lr:g}-seed{seed}") for seed in seeds] for lr in (LR, LR / 4)}
    fast, slow = (sum(settled_error(run, seed) for run, seed in zip(runs[lr], seeds)) / len(seeds)
                  for lr in (LR, LR / 4))
    assert slow <= max(fast / 2, CREDIT_FLOOR), (fast, slow)
    for run in runs[LR] + runs[LR / 4]:
        assert_the_swarm_spent_its_budget(run, speeds)


@pytest.mark.parametrize("speeds", SPEEDS)
@pytest.mark.parametrize("mode", [mode for mode in ASYNCHRONOUS if mode != "gossip-async"])
def test_the_asynchronous_servers_reach_the_mean_of_the_objectives_exactly(launch_run, mode, speeds):
    """The server's memory of each worker's latest gradient makes its fixed point the mean's minimiser at any
    learning rate, and its last iterate is that point: no bias to fall with the learning rate (measured
    about 1e-16 in every mode and speed). A rate-weighted fixed point stays far above the bound
    (``test_without_rate_compensation_a_slow_peer_counts_by_its_rate``)."""
    run = quadratic(launch_run, mode, speeds, LR, STEPS)
    assert error(run) < 1e-9, error(run)
    assert_the_swarm_spent_its_budget(run, speeds)


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
    # and no peer waited for the end much longer than one of the slow peer's steps: that step, plus the
    # time the news of it takes to arrive (under a full suite's load once 0.100 s against a step of 0.086 s).
    # Were each peer to stop on its own --steps, the fast ones would wait 30 of the slow one's steps.
    idle = last["trained_until"] - min(e["trained_until"] for e in ends)
    assert idle < 2 * ends[5]["step_seconds"], (idle, ends[5]["step_seconds"])


def test_without_rate_compensation_a_slow_peer_counts_by_its_rate(launch_run):
    """The rate-weighted fixed point that ``--rate-compensation off`` keeps: the error does not fall with the
    learning rate (the guard that ``test_the_asynchronous_servers_reach_the_mean_of_the_objectives_exactly``
    can fail)."""
    fast = quadratic(launch_run, "ps-async", "slow", LR, STEPS, "--rate-compensation", "off", name="lr")
    slow = quadratic(launch_run, "ps-async", "slow", LR / 4, 4 * STEPS, "--rate-compensation", "off", name="lr4")
    assert error(slow) > error(fast) / 2 and error(slow) > 0.05, (error(fast), error(slow))
