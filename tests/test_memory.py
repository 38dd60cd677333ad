"""What a gossip-sync peer allocates beyond its model: three real peer processes on a ring, a 32 MiB model.

A round holds the in-neighbours' messages of the round it mixes and, from a neighbour already a round
ahead, up to as many of the next round's. With overlap (the default) a peer whose weights are written
between mixing points (an optimizer step) also holds the one snapshot it sent, which the next snapshot
overwrites once ZeroMQ has let go of it; one whose weights are not written sends them uncopied and holds
no snapshot. So the peak resident memory beyond what the process held before ``attach`` is at most
(1 + 2 x in-degree) models when training with overlap and 2 x in-degree otherwise, plus a fixed allowance
for the sockets, threads and allocator (measured: about 20 MB). Before the snapshot was reused, the
overlapping round peaked at 5.7-7.1 models of 64 MiB; before it was taken only when needed, a round
without training held the snapshot too.
"""

from __future__ import annotations

import multiprocessing as mp
import resource

import pytest
import torch

from tests.conftest import free_base_port

pytestmark = pytest.mark.timeout(180)

MODEL_MB = 32
FIXED_MB = 32  # sockets, threads, the allocator's bookkeeping
IN_DEGREE = 2  # a ring


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / (1 << 20)


def peak_resident_mb() -> float:
    """This process's high-water mark (VmHWM). Not ``ru_maxrss``, which Linux carries over an exec from
    the forking process: a child of a large pytest process would report the parent's size."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def peer(rank: int, port: int, overlap: bool, train: bool, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    import gossip

    model = torch.nn.Linear(1, 1, bias=False)
    model.weight = torch.nn.Parameter(torch.full((MODEL_MB << 18,), float(rank)))  # 4-byte values
    model.weight.grad = torch.zeros_like(model.weight)  # a step that writes the weights without moving them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = resident_mb()
    with gossip.attach(model, rank=rank, world_size=3, base_port=port, topology="ring", overlap=overlap) as averager:
        for _ in range(12):
            if train:
                optimizer.step()
            averager.step()
    results.put((rank, peak_resident_mb() - before, float(model.weight[0])))


@pytest.mark.parametrize("overlap,train", [(True, True), (True, False), (False, True)],
                         ids=["overlap-training", "overlap-mixing-only", "no-overlap"])
def test_a_peer_holds_at_most_its_rounds_messages_and_one_snapshot(overlap, train):
    # forked from one server that imported torch and gossip once (a fresh child's peak counts from its fork)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "gossip"])
    results = context.Queue()
    port = free_base_port(3)
    procs = [context.Process(target=peer, args=(rank, port, overlap, train, results)) for rank in range(3)]
    for proc in procs:
        proc.start()
    try:
        reports = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert [value for *_, value in reports] == pytest.approx([1.0] * 3), reports  # averaged: (0 + 1 + 2) / 3
    models = (1 + 2 * IN_DEGREE) if overlap and train else 2 * IN_DEGREE
    grew = {rank: round(extra) for rank, extra, _ in reports}
    assert max(grew.values()) <= models * MODEL_MB + FIXED_MB, f"peers grew by {grew} MB"
