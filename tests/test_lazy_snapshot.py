"""Overlapping gossip copies the weights it sends only when something writes them before the next mix.

Three peers on a ring as threads of this process, real sockets on loopback. Whatever the pattern of
optimizer steps between mixing points (none, every one, some), each peer's trajectory equals the overlap
rule replayed in float64: at mixing point t, z_i += sum_j W_ij (s_j - s_i) with the snapshots of point
t - 1, then s_i = z_i; between points, the optimizer's steps. Also when the optimizer writes while ZeroMQ
is still sending the weights (an emulated latency holds them): they move to a copy instead.
"""

from __future__ import annotations

import logging

import pytest
import torch

import gossip
from gossip.flat import FlatParams
from gossip.writes import WriteWatch
from tests.conftest import endpoints, run_peers, vector_model

pytestmark = pytest.mark.timeout(60)

N, DIM, POINTS, LR = 3, 32, 8, 0.5
START = torch.randn(N, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
# the steps before which each peer's optimizer writes: peer 0 sometimes, peer 1 always, peer 2 never
WRITES = ({2, 3, 6}, set(range(1, POINTS + 1)), set())


def gradient(rank: int, step: int) -> torch.Tensor:
    return torch.linspace(-1, 1, DIM, dtype=torch.float64) * (rank + 1) + step


def copies(writes: set[int]) -> int:
    """How many times a peer copies its weights: at each mixing point that a write preceded (the next
    interval is expected to write too, so the copy is taken during the mix), and at each write that
    follows a mixing point that sent the weights uncopied (a write preceded none: the copy before it)."""
    return len(writes) + sum(1 for step in writes if step >= 2 and step - 1 not in writes)


def replay() -> torch.Tensor:
    """The overlap rule on a 3-ring (W = 1/3 everywhere), in float64."""
    z, snapshots = START.clone(), None
    for step in range(1, POINTS + 1):
        for rank in range(N):
            if step in WRITES[rank]:
                z[rank] -= LR * gradient(rank, step)
        if snapshots is not None:
            z += (snapshots.sum(0, keepdim=True) - N * snapshots) / 3
        snapshots = z.clone()
    return z + (snapshots.sum(0, keepdim=True) - N * snapshots) / 3  # close() completes the last round


def train(latency_ms: tuple[float, ...] = ()) -> list[tuple[torch.Tensor, dict]]:
    eps = endpoints(N)

    def peer(rank: int) -> tuple[torch.Tensor, dict]:
        model = vector_model(START[rank])
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        with gossip.attach(model, rank=rank, world_size=N, endpoints=tuple(eps), topology="ring",
                           link_latency_ms=latency_ms) as averager:
            for step in range(1, POINTS + 1):
                if step in WRITES[rank]:
                    model.value.grad = gradient(rank, step)
                    optimizer.step()
                averager.step()
        return model.value.detach().clone(), averager.statistics()

    return run_peers(N, peer)


@pytest.mark.parametrize("latency_ms", [(), (40.0, 0.0, 0.0)], ids=["prompt", "peer-0-sends-late"])
def test_the_trajectory_is_the_overlap_rule_whatever_writes_the_weights(latency_ms):
    results = train(latency_ms)
    expected = replay()
    for rank, (value, stats) in enumerate(results):
        torch.testing.assert_close(value, expected[rank], rtol=0, atol=1e-12)
        assert stats["snapshot_copies"] == copies(WRITES[rank]), (rank, stats["snapshot_copies"])
    if latency_ms:  # peer 0 wrote while its uncopied send was held back: the weights moved to a copy
        assert results[0][1]["relocated"] >= 1


def test_without_writes_no_round_copies_and_the_mean_is_kept():
    eps = endpoints(N)

    def peer(rank: int) -> tuple[torch.Tensor, dict]:
        model = vector_model(START[rank])
        with gossip.attach(model, rank=rank, world_size=N, endpoints=tuple(eps), topology="ring") as averager:
            for _ in range(POINTS):
                averager.step()
        return model.value.detach().clone(), averager.statistics()

    results = run_peers(N, peer)
    values = torch.stack([value for value, _ in results])
    assert [stats["snapshot_copies"] for _, stats in results] == [0] * N
    torch.testing.assert_close(values.mean(0), START.mean(0), rtol=0, atol=1e-14)


def test_a_write_outside_an_optimizer_step_turns_the_lazy_copy_off(caplog):
    eps = endpoints(N)

    def peer(rank: int) -> dict:
        model = vector_model(START[rank])
        with gossip.attach(model, rank=rank, world_size=N, endpoints=tuple(eps), topology="ring") as averager:
            for step in range(1, POINTS + 1):
                if rank == 0 and step == 3:
                    with torch.no_grad():
                        model.value.add_(1.0)  # in place, no optimizer: no hook sees it
                averager.step()
        return averager.statistics()

    with caplog.at_level(logging.WARNING, logger="gossip.averager"):
        stats = run_peers(N, peer)
    assert any("outside an optimizer step" in r.getMessage() for r in caplog.records)
    # from mixing point 3 on, peer 0 copies at every one (3..8); the others never needed to
    assert [s["snapshot_copies"] for s in stats] == [POINTS - 2, 0, 0]


def test_the_watch_sees_our_optimizer_and_a_forward_that_writes_buffers_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    flat = FlatParams(model, 1 << 20)
    watch = WriteWatch(flat)
    calls = []
    try:
        ours = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        other.step()
        assert not watch.take_written()
        watch.arm(lambda: calls.append("write"))
        model(torch.randn(5, 4)).sum().backward()  # the forward updates BatchNorm's running statistics
        assert calls == ["write"] and watch.take_written()
        ours.step()
        assert calls == ["write"] and watch.take_written()  # armed once: called once
        assert not watch.take_written()
    finally:
        watch.close()
    ours.step()
    model(torch.randn(5, 4))
    assert not watch.take_written()  # closed: the hooks are gone

    plain = torch.nn.Linear(4, 4)
    watch = WriteWatch(FlatParams(plain, 1 << 20))
    try:
        plain(torch.randn(2, 4))  # no buffers to average: a forward writes nothing of ours
        assert not watch.take_written()
    finally:
        watch.close()
