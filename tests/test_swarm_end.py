"""The pure parts of "every peer's data counts alike": the swarm's progress as one gossip peer knows it
(``gossip/progress.py``), the parameter server's memory of each worker's latest gradient
(``gossip/coordinator/memory.py``) and its budget of gradients (``ServerCore``), and the header field that
carries the progress, validated."""

from __future__ import annotations

import pytest
import torch

from gossip.coordinator.core import Contribution, ServerCore
from gossip.coordinator.memory import REFRESH, GradientMemory
from gossip.coordinator.rates import ArrivalRates
from gossip.errors import ProtocolError
from gossip.net.wire import MAX_PROGRESS_PEERS, Header, Layout, decode, encode, up_header
from gossip.progress import MAX_RATE_FACTOR, MIN_RATE_POINTS, SwarmProgress


def test_progress_keeps_the_newest_step_of_every_peer_and_never_takes_ours_from_others():
    progress = SwarmProgress(4, rank=1)
    progress.advance(5)
    progress.merge([3, 99, 0, 7])
    progress.merge([2, 0, 4, 6])  # older news of peers 0 and 3 changes nothing
    assert progress.vector() == (3, 5, 4, 7)
    assert progress.total == 19 and progress.mean_step() == 4
    assert not progress.spent(5) and progress.spent(4)  # 4 peers x 5 steps = 20 > 19 >= 16


def test_the_rate_factor_is_the_swarm_mean_rate_times_the_seconds_a_step_took():
    progress = SwarmProgress(2, rank=0)
    assert progress.rate_factor(1.0, 1) == 1.0  # nothing known yet
    for t in range(MIN_RATE_POINTS):  # we step once a second, peer 1 three times a second: R = 2 per second
        progress.advance(t + 1)
        progress.merge([0, 3 * (t + 1)])
        progress.note(float(t))
    assert progress.mean_rate() == pytest.approx(2.0)
    assert progress.rate_factor(1.0, 1) == pytest.approx(2.0)  # our step of 1 s counts 2 (rbar / r_0)
    assert progress.rate_factor(1.0 / 3, 1) == pytest.approx(2.0 / 3)  # one of peer 1's steps
    assert progress.rate_factor(100.0, 1) == MAX_RATE_FACTOR  # bounded
    # it looks ahead: in 1 s the others take 2 x 2 x 1 - 1 = 3 steps (ours is the 4th, not yet done)
    total = progress.total
    assert progress.spent((total + 3) / 2, within=1.0) and not progress.spent((total + 4) / 2, within=1.0)
    assert not progress.spent((total + 1) / 2, within=0.25)  # our own step alone does not count ahead


def test_a_peer_first_heard_of_during_the_window_does_not_count_as_progress():
    progress = SwarmProgress(3, rank=0)
    for t in range(MIN_RATE_POINTS):
        progress.advance(t + 1)
        progress.merge([0, t + 1, 1000 if t == MIN_RATE_POINTS - 1 else 0])  # peer 2's first news: step 1000
        progress.note(float(t))
    assert progress.mean_rate() == pytest.approx(1.0)


def test_peers_first_heard_of_after_the_window_began_count_from_their_first_news():
    """A slow peer's window never rolls in a short run: the others, unknown at its first mixing point, must
    still count (else R would be its own rate and its steps would count 1, not rbar / r_i)."""
    progress = SwarmProgress(2, rank=0)
    progress.advance(1)
    progress.note(0.0)  # peer 1 not heard of yet
    for t in range(1, MIN_RATE_POINTS + 2):  # we step once a second, peer 1 four times a second
        progress.advance(t + 1)
        progress.merge([0, 4 * t])
        progress.note(float(t))
    assert progress.mean_rate() == pytest.approx((1.0 + 4.0) / 2)


def test_a_peer_is_known_to_have_started_once_it_spoke_was_flagged_or_has_a_step():
    progress = SwarmProgress(5, rank=1)
    assert progress.started() == {1}
    progress.merge([0, 0, 3, 0, 0])  # a header's vector: peer 2 has stepped
    progress.note_started([4])  # a hello from peer 4, or its flag in an "up"
    assert progress.started() == {1, 2, 4}
    assert progress.vector() == (0, 0, 3, 0, 0)  # an "up" is no claim of steps


def test_an_up_flags_who_has_started_and_nothing_else():
    header = up_header(2, [0, 4], world_size=5)
    assert (header.kind, header.step, header.progress) == ("up", 1, (1, 0, 1, 0, 1))
    assert decode(encode(header), layout(), world_size=5).header == header


@pytest.mark.parametrize("progress, step, reason", [
    ((1, 2, 1), 1, "up"),  # a flag that is a step count
    ((0, 0, 0), 0, "up"),  # its own flag 0
    ((), 1, "up"),  # none
    ((1, 1), 1, "progress"),  # two flags in a run of three
])
def test_an_up_that_is_not_one_flag_per_peer_is_dropped(progress, step, reason):
    frames = encode(Header(kind="up", sender=0, step=step, progress=progress))
    with pytest.raises(ProtocolError) as caught:
        decode(frames, layout(), world_size=3)
    assert caught.value.reason == reason


def layout() -> Layout:
    return Layout.describe([("w", (4,), "float32")], ["float32"], [4])


@pytest.mark.parametrize("progress, step, reason", [
    ((1, 2), 1, "progress"),  # two entries in a run of three
    ((1, 2, 3), 1, "progress"),  # the sender (peer 1) names its own step 2 in a message of step 1
    ((1, -2, 3), 2, "field"),
])
def test_a_header_with_a_progress_that_does_not_fit_is_dropped(progress, step, reason):
    frames = encode(Header(kind="bye", sender=1, step=step, progress=progress))
    with pytest.raises(ProtocolError) as caught:
        decode(frames, layout(), world_size=3)
    assert caught.value.reason == reason


def test_a_header_carries_the_progress_of_the_most_peers_a_run_may_have():
    peers = MAX_PROGRESS_PEERS
    progress = tuple([(1 << 53) - 1] * peers)
    frames = encode(Header(kind="bye", sender=0, step=progress[0], progress=progress))
    assert decode(frames, layout(), world_size=peers).header.progress == progress


def test_memory_steps_with_the_mean_of_every_workers_latest_gradient():
    memory = GradientMemory([torch.zeros(3, dtype=torch.float64)])
    out = [torch.empty(3, dtype=torch.float64)]
    memory.store(0, [torch.tensor([1.0, 0, 0], dtype=torch.float64)])
    memory.store(1, [torch.tensor([0, 2.0, 0], dtype=torch.float64)], scale=0.5)
    for _ in range(5):  # worker 0, four times as fast, replaces its own gradient: it still counts once
        memory.store(0, [torch.tensor([3.0, 0, 0], dtype=torch.float64)])
    memory.mean_into(out)
    assert out[0].tolist() == [1.5, 0.5, 0.0]
    memory.forget(0)  # a worker that left pulls no more
    memory.mean_into(out)
    assert out[0].tolist() == [0.0, 1.0, 0.0]


def test_memory_refreshes_its_running_sum():
    memory = GradientMemory([torch.zeros(2)])
    generator = torch.Generator().manual_seed(0)
    for step in range(REFRESH + 3):
        memory.store(step % 3, [torch.randn(2, generator=generator) * 1e6])
    out = [torch.empty(2)]
    memory.mean_into(out)
    exact = sum(stored[0].double() for stored in memory.latest.values()) / 3
    torch.testing.assert_close(out[0].double(), exact, rtol=1e-6, atol=1.0)


class Recorder:
    def __init__(self) -> None:
        self.applied: list[list[int]] = []
        self.left_workers: list[int] = []

    def apply(self, batch, staleness, version):
        self.applied.append([c.worker for c in batch])

    def sent(self, worker):
        pass

    def left(self, worker):
        self.left_workers.append(worker)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def contribution(worker: int, clock: int) -> Contribution:
    return Contribution(worker, 0, clock, [])


def test_the_server_ends_the_run_for_everyone_when_its_budget_of_gradients_is_spent():
    core = ServerCore(3, Recorder(), batch_size=1, staleness_bound=2, budget=4)
    for worker in range(3):
        core.join(worker)
    assert core.submit(contribution(0, 1)) == [0]
    assert core.submit(contribution(0, 2)) == [0]
    assert core.submit(contribution(0, 3)) == []  # 3 ahead of the slowest: held (ps-ssp)
    assert core.held == {0} and not core.take_ending()
    assert core.submit(contribution(1, 1)) == []  # the 4th gradient: the budget is spent
    assert core.take_ending() == [0, 1] and core.contributed == 4 and not core.held
    assert core.submit(contribution(2, 1)) == [] and core.take_ending() == [2]  # applied no more
    assert core.contributed == 4 and core.clocks == [3, 1, 1]
    core.leave(2)
    assert core.update.left_workers == [2]


def test_an_adamw_servers_rate_weights_count_each_worker_alike_per_second():
    """Worker 0 contributes every second, worker 1 every 4 s: R = (1 + 1/4) / 2 per second per worker, so
    worker 0's gradients weigh 0.625 and worker 1's 2.5 (each worker's weights per second: 0.625 alike)."""
    rates = ArrivalRates(2)
    rates.joined(0, 0.0)
    rates.joined(1, 0.0)
    weights: dict[int, list[float]] = {0: [], 1: []}
    for t in range(1, 81):
        weights[0].append(rates.arrived(0, float(t), active=2))
        if t % 4 == 0:
            weights[1].append(rates.arrived(1, float(t), active=2))
    assert weights[0][0] == 1.0  # nothing measured yet
    assert weights[0][-1] == pytest.approx(0.625, rel=0.02) and weights[1][-1] == pytest.approx(2.5, rel=0.02)
    rates.joined(1, 100.0)  # a restarted worker: its interval counts from its hello, not from before
    assert rates.arrived(1, 104.0, active=2) == pytest.approx(4 * rates.mean_rate(2))
