"""gossip-async's push-sum rule, checked by exact invariants on real peer processes: the network's mass and
weighted mean are kept, every step moves the mean by exactly its 1/N share, a message is mixed once, every
mix replays exactly from the peers' traces, and consensus contracts at least at the graph's synchronous
rate."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import gossip
import topologies
from gossip.averagers.flow import FlowWindow
from tests.conftest import endpoints, run_peers, vector_model, wait_until

pytestmark = pytest.mark.timeout(150)


def final_state(run, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each peer's final push-sum weight and model vector."""
    weights, models = [], []
    for rank in range(nodes):
        end = next(e for e in run.events(rank) if e["event"] == "end")
        weights.append(end["weight"])
        models.append(next(iter(torch.load(run.out / f"model-{rank}.pt", weights_only=True).values())))
    return torch.tensor(weights, dtype=torch.float64), torch.stack(models).to(torch.float64)


def weighted_mean(weights: torch.Tensor, models: torch.Tensor) -> torch.Tensor:
    return (weights[:, None] * models).sum(0) / weights.sum()


def test_mass_and_mean_are_kept_on_a_ring_of_8_with_a_slow_peer(launch_run):
    """Peer r starts at r: after the run drains, the weights sum to N and the weighted mean is still
    (N - 1) / 2, so the slow peer's value counts exactly 1/N, however often its neighbours sent."""
    nodes = 8
    run = launch_run("--mode", "gossip-async", "--task", "tests.tasks:rank_value", "--dim", "8", "--steps", "40",
                     "--speeds", "1,1,1,1,1,1,1,0.25", "--compute-ms", "5", nodes=nodes)
    weights, models = final_state(run, nodes)
    assert weights.sum().item() == pytest.approx(nodes, rel=1e-9)
    assert torch.allclose(weighted_mean(weights, models), torch.full((8,), (nodes - 1) / 2, dtype=torch.float64),
                          rtol=1e-9, atol=0)
    assert all(p["dropped"] == {} for p in run.summary["peers"])


@pytest.mark.parametrize("compensation", ["off", "on"])
@pytest.mark.parametrize("speeds", ["1,1,1,1", "1,1,1,0.25"])
def test_every_step_moves_the_mean_by_its_share(launch_run, speeds, compensation):
    """Peer r's gradient is r + 1 everywhere: after the run drains, the weighted mean ends exactly
    lr * sum_r c_r (r + 1) / N below where it began, c_r the steps peer r was credited with: every step of
    every peer moves the mean by its credit / N at the full learning rate, however the messages interleave
    with the steps. Without rate compensation each step's credit is 1, so c_r is peer r's steps and a peer
    twice as fast counts twice; with it the peers' credits, per second of the run, are equal."""
    nodes, steps, lr = 4, 60, 0.01
    run = launch_run("--mode", "gossip-async", "--task", "tests.tasks:constant_gradient", "--dim", "4",
                     "--steps", str(steps), "--lr", str(lr), "--momentum", "0", "--compute-ms", "10",
                     "--speeds", speeds, "--rate-compensation", compensation, nodes=nodes)
    weights, models = final_state(run, nodes)
    ends = [next(e for e in run.events(rank) if e["event"] == "end") for rank in range(nodes)]
    assert weights.sum().item() == pytest.approx(nodes, rel=1e-9)
    credits = [end["credited_steps"] for end in ends]  # (bounded where a credit exceeded 4 w: still exact)
    if compensation == "off":
        assert all(end["credit_bounded"] == 0 for end in ends)  # (no weight fell below 1 / 4)
        assert credits == [end["step"] for end in ends]
    elif speeds != "1,1,1,1":  # a step of the peer 4x slower counts about 4x one of a fast peer's
        per_step = [c / end["step"] for c, end in zip(credits, ends)]
        assert per_step[3] > 2.5 * max(per_step[:3]), per_step
    moved = (nodes - 1) / 2 - weighted_mean(weights, models)
    exact = lr * sum(c * (r + 1) for r, c in enumerate(credits)) / nodes
    assert torch.allclose(moved, torch.full_like(moved, exact), rtol=1e-9, atol=0), (moved, exact)


def test_a_message_is_mixed_once():
    """Peer 1 steps a few times and stops stepping (without closing); peer 0 keeps stepping. Between two of
    peer 0's steps in which nothing arrived its model stays where it was, to float32 rounding (a step after one
    that sent mass renormalises z by the weight it kept: z + (1/w - 1) z + (1 - 1/w) s moves it by an ulp), where
    a mixed message moves it by 1e-3 or more: nothing is mixed twice."""
    eps = endpoints(2)
    models = [vector_model(torch.zeros(8)), vector_model(torch.ones(8))]
    options = dict(world_size=2, endpoints=tuple(eps), mode="gossip-async", startup_timeout=20, round_timeout=20)
    history: list[tuple[int, int, torch.Tensor]] = []  # peer 0's (received before, after, model) per step

    def peer(rank: int):
        averager = gossip.attach(models[rank], rank=rank, **options)
        for step in range(5 if rank == 1 else 40):
            if rank == 1:  # each of its steps follows a message of peer 0's, so it sends mass, not pings
                wait_until(lambda done=step: averager.mailbox.received[0] > done, 10, f"peer 0's message {step + 1}")
            before = averager.mailbox.received[1] if rank == 0 else 0
            averager.step()
            if rank == 0:
                history.append((before, averager.mailbox.received[1], models[0].value.detach().clone()))
                time.sleep(0.005)  # (pacing only: peer 1 stops stepping while peer 0 goes on)
        averager.close()
        return averager.statistics()

    stats = run_peers(2, peer)
    assert stats[0]["step"] == 40
    # nothing arrived from the start of one step (which mixes before it ends) to the end of the next
    moves = [(before, after) for before, after in zip(history, history[1:]) if before[0] == after[1]]
    assert moves, "peer 0 had steps in which nothing arrived"
    assert not any(moved(before[2], after[2]) for before, after in moves)
    changed = sum(moved(a[2], b[2]) for a, b in zip(history, history[1:]))
    assert 0 < changed <= stats[0]["received"]  # it did mix what came, once each
    assert sum(s["weight"] for s in stats) == pytest.approx(2.0, rel=1e-12), stats


def moved(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Changed by more than float32 rounding (8 ulp)."""
    return not torch.allclose(after, before, rtol=8 * torch.finfo(torch.float32).eps, atol=0)


def test_consensus_replays_exactly_and_contracts_within_one_step_of_delay_of_the_second_eigenvalue(launch_run):
    """The consensus task on a ring of 8 at equal speeds (no training).

    Exact: every mixing point of every peer is the push-sum formula applied to the snapshots it names
    (``last_mixed_rounds``: sender -> the rounds of its messages this mix took), replayed from the peers'
    traces in float64: z_i = ((w_i - sum_j m_j) s_i + sum_j m_j s_j) / w_i with m_j = W_ij w_j at the round
    j sent, and no message is mixed twice.

    A band: while every peer is stepping, the copies' distance from the exact mean shrinks per step
    geometrically, at least at the rate of the synchronous mix applied every other step, sqrt(SLEM of W):
    what a step sends is mixed by the receiver at its next step, or one later when the message is still in
    flight (eight peers on two cores, as in CI). The synchronous bound itself (SLEM 0.805) failed about one
    run in two on a 2-core machine, 2 and 3 of 4 runs on two commits of 2026-11-25, at 0.805-0.844 per
    step."""
    nodes, steps = 8, 80
    run = launch_run("--mode", "gossip-async", "--task", "consensus", "--steps", str(steps), "--dim", "16",
                     "--compute-ms", "10", nodes=nodes)
    recorded = [np.load(run.out / f"trace-{rank}.npz") for rank in range(nodes)]
    traces = [trace["values"] for trace in recorded]
    replay_push_sum(run, recorded, nodes, steps)
    step_times = [[e["time"] for e in run.events(rank) if e["event"] == "step"] for rank in range(nodes)]
    mean = np.stack([trace[0] for trace in traces]).mean(0)

    def state(moment: float) -> tuple[float, float]:
        """(distance of the copies from the mean, mean steps taken) at a moment of the run."""
        done = [sum(t <= moment for t in times) for times in step_times]  # values[k]: after k steps
        copies = np.stack([trace[k] for trace, k in zip(traces, done)])
        return float(np.sqrt(((copies - mean) ** 2).sum(1).mean())), float(np.mean(done))

    (first, steps_first), (last, steps_last) = (state(max(times[0] for times in step_times) + 0.02),
                                                state(min(times[-1] for times in step_times)))
    assert steps_last - steps_first >= 20 and last > 1e-12  # (a window long enough, above rounding)
    rate = (last / first) ** (1 / (steps_last - steps_first))
    assert rate <= topologies.build("ring", nodes).slem(0) ** 0.5, rate


def replay_push_sum(run, recorded: list, nodes: int, steps: int) -> None:
    """Every mix of every peer equals the push-sum formula on the snapshots it names (trace row k: the
    model and weight after k rounds; step k completes round k - 2, so its mix is row k - 1)."""
    row = topologies.build("ring", nodes).mixing_matrix(0)
    values = [trace["values"] for trace in recorded]
    weights = [trace["weights"] for trace in recorded]
    # a row per round (the swarm's budget of steps: a peer does about ``steps``, not exactly)
    assert all(list(trace["rounds"]) == list(range(len(trace["rounds"]))) for trace in recorded)
    worst, mixes = 0.0, 0
    for i in range(nodes):
        taken: set[tuple[int, int]] = set()
        for event in run.events(i):
            if event["event"] != "step" or event["step"] < 2:
                continue
            k = event["step"] - 1
            named = [(int(j), r) for j, rounds in event["last_mixed_rounds"].items() for r in rounds]
            assert not taken & set(named), (i, event)  # each message mixed once
            taken |= set(named)
            terms = [(float(row[i, j]) * weights[j][r], values[j][r]) for j, r in named]
            mass = sum(m for m, _ in terms)
            replayed = ((weights[i][k] - mass) * values[i][k - 1] + sum(m * s for m, s in terms)) / weights[i][k]
            worst = max(worst, float(np.abs(replayed - values[i][k]).max()))
            mixes += len(named)
    assert mixes >= nodes * steps, mixes  # (two in-neighbours each: most messages were mixed while stepping)
    assert worst <= 1e-12, worst


def test_flow_window_holds_a_link_back_after_window_unanswered_messages():
    flow = FlowWindow(2)
    assert flow.ready(1, heard=0, answers_us=True)  # nothing sent yet
    flow.sent(1, heard=0)
    assert flow.ready(1, heard=0, answers_us=True)  # one of two unanswered
    flow.sent(1, heard=0)
    assert not flow.ready(1, heard=0, answers_us=True)  # two: wait for an answer
    assert flow.ready(1, heard=0, answers_us=False)  # a neighbour that never sends to us is never held back
    assert flow.ready(1, heard=1, answers_us=True)  # it sent us something since
    flow.sent(1, heard=1)
    assert flow.ready(1, heard=1, answers_us=True) and flow.ready(2, heard=0, answers_us=True)
    flow.hold([1, 1, 2])
    assert flow.statistics() == {"1": 2, "2": 1}
