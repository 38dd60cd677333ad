"""The averaging logic, through the averagers' public API, with no socket and no process: several averagers
in one process (a thread each) joined by ``tests/memory_link.py``. Gossip-sync is x <- W x per round with
the topology's own mixing matrix, push-sum keeps the network's mass while peers train and while a neighbour
takes nothing, CHOCO's compressed gossip keeps the network's mean, and an outer step of SGD with lr 1 and no
momentum is plain local-steps gossip; and the parameter server, on the same link, averages ps-avg's workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import topologies
from gossip.averagers import averager_class
from gossip.config import CoordinatorConfig, GossipConfig, RunConfig
from gossip.coordinator.server import ParameterServer
from gossip.coordinator.worker import PSWorker
from gossip.errors import PeerTimeout
from gossip.flat import FlatParams
from gossip.metrics import EventLog
from gossip.net.transport import Transport
from gossip.tasks import build_task, context_for
from tests.conftest import endpoints, run_peers
from tests.memory_link import MemoryNetwork

pytestmark = pytest.mark.timeout(30)

PEERS = 4
DIM = 6


class Vector(nn.Module):
    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.value = nn.Parameter(values.clone())


def starts(count: int = PEERS, dim: int = DIM) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(dim, generator=generator, dtype=torch.float64) for _ in range(count)]


def swarm(body, values: list[torch.Tensor], network: MemoryNetwork | None = None,
          outer: tuple[str, float, float] | None = None, **settings) -> list:
    """Run ``body(rank, averager, model)`` on every peer, its averager started on a memory link and closed
    after (finishing its last round); returns each peer's result, by default (its weights, its statistics)."""
    network = network or MemoryNetwork()
    settings = {"topology": "ring", "round_timeout": 10.0, "startup_timeout": 10.0, "shutdown_timeout": 5.0,
                **settings}

    def peer(rank: int):
        config = GossipConfig.of(rank=rank, world_size=len(values), **settings)
        model = Vector(values[rank])
        flat = FlatParams(model, config.network.chunk_bytes)
        averager = averager_class(config)(flat, config, config.build_topology(), outer=outer,
                                          connect=network.connect(rank))
        with averager.start():
            result = body(rank, averager, model)
        return result if result is not None else (model.value.detach().clone(), averager.statistics())

    return run_peers(len(values), peer)


def stepping(count: int):
    """A peer's body that only steps ``count`` times."""
    def body(rank, averager, model):
        for _ in range(count):
            averager.step()

    return body


def trainer(model: Vector):
    """``train(change)``: one step of a torch.optim optimizer that moves the model by ``change``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def train(change: torch.Tensor) -> None:
        optimizer.zero_grad()
        model.value.grad = -change
        optimizer.step()

    return train


def mixing(spec: str, round: int = 0) -> np.ndarray:
    return topologies.build(spec, PEERS).mixing_matrix(round)


def stacked(rows) -> np.ndarray:
    return np.stack([row.numpy() for row in rows])


def test_gossip_sync_without_overlap_is_x_gets_w_x_every_round():
    rounds = 5
    values = starts()
    history: list[list[torch.Tensor]] = [[] for _ in values]  # each peer's weights after each round

    def body(rank, averager, model):
        for _ in range(rounds):
            assert averager.step()
            history[rank].append(model.value.detach().clone())

    swarm(body, values, overlap=False)
    x = stacked(values)
    for round in range(rounds):
        x = mixing("ring", round) @ x
        np.testing.assert_allclose(stacked(h[round] for h in history), x, rtol=0, atol=1e-12)


def test_gossip_sync_with_overlap_mixes_each_round_one_step_later_and_close_completes_the_last():
    """With overlap mixing point r mixes round r - 1: after step k the weights are W^(k-1) x, and close()
    completes round k - 1, giving W^k x."""
    rounds = 4
    values = starts()
    history: list[list[torch.Tensor]] = [[] for _ in values]

    def body(rank, averager, model):
        for _ in range(rounds):
            averager.step()
            history[rank].append(model.value.detach().clone())

    results = swarm(body, values)
    w, x = mixing("ring"), stacked(values)
    expected = [x]
    for _ in range(rounds):
        expected.append(w @ expected[-1])
    for step in range(rounds):
        np.testing.assert_allclose(stacked(h[step] for h in history), expected[step], rtol=0, atol=1e-12)
    np.testing.assert_allclose(stacked(r[0] for r in results), expected[rounds], rtol=0, atol=1e-12)
    assert all(r[1]["rounds"] == rounds for r in results), [r[1]["rounds"] for r in results]


def test_gossip_sync_on_a_time_varying_graph_mixes_with_each_rounds_matrix():
    rounds = 4
    values = starts()
    results = swarm(stepping(rounds), values, topology="exponential", overlap=False)
    x = stacked(values)
    for round in range(rounds):
        x = mixing("exponential", round) @ x
    np.testing.assert_allclose(stacked(r[0] for r in results), x, rtol=0, atol=1e-12)


def push_sum_mass(results) -> tuple[np.ndarray, float]:
    weights = [stats["weight"] for _, stats in results]
    return sum(w * z.numpy() for w, (z, _) in zip(weights, results)), sum(weights)


def test_async_push_sum_keeps_the_mass_while_a_peer_trains_between_mixes():
    """Peer 1 moves its model by ``change`` at every step; with rate compensation off each step is credited
    with mass c = 1 (at most 4 w_i: ``credited_steps`` counts what it was), so the network's mass
    sum_i w_i z_i moves by exactly ``change`` times peer 1's credited steps, and sum_i w_i stays N."""
    values = starts()
    change = torch.linspace(-0.3, 0.5, DIM, dtype=torch.float64)

    def body(rank, averager, model):
        train = trainer(model)
        for _ in range(12 if rank != 2 else 7):  # (peer 2 stops first: its neighbours drain its last mass)
            if rank == 1:
                train(change)
            averager.step()

    results = swarm(body, values, mode="gossip-async", rate_compensation="off")
    credited = results[1][1]["credited_steps"]
    assert credited > 0
    mass, weight = push_sum_mass(results)
    np.testing.assert_allclose(mass, stacked(values).sum(0) + credited * change.numpy(), rtol=0, atol=1e-9)
    assert weight == pytest.approx(PEERS, rel=0, abs=1e-9)
    assert sum(stats["messages_received"] for _, stats in results) > 0


def test_async_push_sum_keeps_the_mass_of_offers_a_held_neighbour_did_not_take():
    """Peer 0 takes nothing for a while (its inbound messages wait): each neighbour's link to it holds one
    message, further offers are not taken, and the neighbour keeps that share. Once released, mass is whole."""
    values = starts()
    network = MemoryNetwork()
    network.hold(0)
    offered = []

    def body(rank, averager, model):
        for step in range(10):
            if rank == 3 and step == 6:
                offered.append(averager.statistics()["held_back"])
                network.release(0)
            averager.step()

    results = swarm(body, values, network=network, mode="gossip-async")
    mass, weight = push_sum_mass(results)
    np.testing.assert_allclose(mass, stacked(values).sum(0), rtol=0, atol=1e-9)
    assert weight == pytest.approx(PEERS, rel=0, abs=1e-9)
    assert offered and offered[0].get("0", 0) > 0  # peer 3 held messages back from peer 0


def test_compressed_gossip_keeps_the_network_mean_and_contracts():
    rounds = 8
    values = starts()
    results = swarm(stepping(rounds), values, compress="int8", overlap=False)
    x0, x = stacked(values), stacked(r[0] for r in results)
    np.testing.assert_allclose(x.mean(0), x0.mean(0), rtol=0, atol=1e-12)
    spread = np.abs(x - x.mean(0)).max()
    assert spread < 0.2 * np.abs(x0 - x0.mean(0)).max(), spread
    assert all(r[1]["rounds"] == rounds for r in results)


def test_an_outer_sgd_step_with_lr_1_and_no_momentum_is_plain_local_steps_gossip():
    """Every third step a mix (``gossip_every`` 3), the peers training between mixes: with an outer SGD
    step of lr 1 and momentum 0 after each mix the weights are those of plain gossip without overlap."""
    values = starts()
    changes = [torch.full((DIM,), 0.01 * (rank + 1), dtype=torch.float64) for rank in range(PEERS)]

    def body(rank, averager, model):
        trace, train = [], trainer(model)
        for step in range(9):
            train(changes[rank] * (step % 3 + 1))
            if averager.step():
                trace.append(model.value.detach().clone())
        return trace

    outer = swarm(body, values, outer=("sgd", 1.0, 0.0), gossip_every=3)
    plain = swarm(body, values, gossip_every=3, overlap=False)
    assert all(len(trace) == 3 for trace in outer + plain)
    for mixed in range(3):
        np.testing.assert_allclose(stacked(t[mixed] for t in outer), stacked(t[mixed] for t in plain),
                                   rtol=0, atol=1e-12)
    # and plain gossip is x <- W (x + local steps) per mix
    x = stacked(values)
    for mixed in range(3):
        x = mixing("ring") @ (x + 6 * stacked(changes))
        np.testing.assert_allclose(stacked(t[mixed] for t in plain), x, rtol=0, atol=1e-12)


def test_the_memory_link_counts_what_it_carried_with_the_transports_keys():
    def body(rank, averager, model):
        averager.step()
        return averager

    averagers = swarm(body, starts(2), topology="full")  # (closed: their last round finished)
    ring = endpoints(2)
    real = Transport(0, ring[0], ring, lambda *message: None).statistics().keys()  # (built, never started)
    for averager in averagers:
        stats = averager.transport.statistics()
        assert stats.keys() == real and real <= averager.statistics().keys()
        assert stats["messages_sent"] == stats["messages_received"] == 2  # the hello and round 0
        assert stats["dropped"] == {}


class Recorder:
    """What a link tells a mailbox, written down."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, int]] = []  # (header bytes, connection)
        self.events: list[tuple] = []

    def deliver(self, authenticated, frames, connection) -> None:
        self.messages.append((frames[0].bytes, connection))

    def link(self, peer: int, up: bool) -> None:
        self.events.append(("link", peer, up))

    def connection_closed(self, connection: int) -> None:
        self.events.append(("closed", connection))


def test_the_memory_link_queues_offers_replaces_and_forgets_as_the_transport_does():
    network = MemoryNetwork(queue_depth=2)
    boxes = [Recorder(), Recorder()]
    a, b = (network.connect(rank)(box) for rank, box in enumerate(boxes))
    a.start()
    a.post([1], [b"early"], latest_only=False, timeout=1.0)  # b does not listen yet: it waits
    b.start()
    assert [m for m, _ in boxes[1].messages] == [b"early"] and boxes[0].events == [("link", 1, True)]
    network.hold(1)
    assert a.offer([1], [b"one"], timeout=1.0) == [1]
    assert a.offer([1], [b"two"], timeout=1.0) == []  # its queue is not empty: not taken
    a.post([1], [b"latest"], latest_only=True, timeout=1.0)
    a.post([1], [b"newer"], latest_only=True, timeout=1.0)  # replaces the unsent latest_only message
    with pytest.raises(PeerTimeout):
        a.post([1], [b"full"], latest_only=False, timeout=0.01)
    network.release(1)
    assert [m for m, _ in boxes[1].messages] == [b"early", b"one", b"newer"]
    assert a.statistics()["replaced"] == 1
    network.hold(1)
    a.post([1], [b"dropped"], latest_only=False, timeout=1.0)
    connection = boxes[1].messages[-1][1]
    a.forget(1)  # what waits is dropped, the connection closes at the receiver, the next post connects anew
    assert boxes[1].events == [("closed", connection)]
    network.release(1)
    a.post([1], [b"again"], latest_only=False, timeout=1.0)
    assert boxes[1].messages[-1][0] == b"again" and boxes[1].messages[-1][1] != connection
    b.close(flush_timeout=0.0)
    assert boxes[0].events[-1] == ("link", 1, False) and not b.started


def test_ps_avg_workers_continue_from_the_mean_of_their_weights_through_the_server(tmp_path):
    """The parameter server on the same memory network (rank N, watching no links): each worker starts from
    the server's weights, moves them, and after its step holds the mean of what the workers sent."""
    cfg = RunConfig(nodes=2, task="digits", gossip=GossipConfig.of(world_size=2, mode="ps-avg"),
                    coordinator=CoordinatorConfig(local_steps=1)).for_rank(0)
    network = MemoryNetwork()
    server = ParameterServer(cfg, tmp_path, EventLog(tmp_path / "server.jsonl"),
                             connect=network.connect(2, server=True))
    start = server.flat.segments[0].clone()
    changes = [torch.full_like(start, 0.5 * (rank + 1)) for rank in range(2)]

    def process(rank: int):
        if rank == 2:
            try:
                server.serve()
            finally:
                server.close(finish=True)
            return server.transport.statistics()
        config = cfg.for_rank(rank).gossip
        model = build_task(cfg.task, context_for(cfg, rank)).model
        with PSWorker(FlatParams(model, config.network.chunk_bytes), config, cfg.coordinator,
                      connect=network.connect(rank)).start() as worker:
            began = worker.flat.segments[0].clone()
            worker.flat.segments[0].add_(changes[rank])
            worker.step()
            return began, worker.flat.segments[0].clone()

    *workers, served = run_peers(3, process)
    for began, after in workers:
        assert torch.equal(began, start)
        torch.testing.assert_close(after, start + (changes[0] + changes[1]) / 2)
    assert served["messages_received"] == 6 and served["dropped"] == {}  # a hello, the weights and a bye each
