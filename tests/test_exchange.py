"""The endpoint exchange on a real TCPStore on loopback, one thread per peer: ranks given out once, every
peer reading the same endpoints, and one clear error for each way a swarm can be formed wrongly."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed import TCPStore

from gossip.errors import ConfigError, PeerTimeout
from gossip.exchange import Assignment, StoreRendezvous, announce_address
from gossip.rendezvous import Plan
from tests.conftest import free_base_port

pytestmark = pytest.mark.timeout(60)
RUN = {"task": "digits", "steps": 300}


def first_and_joiners(port: int, world_size: int, joiners: int) -> list[Plan]:
    first = Plan("first peer", 0, world_size, 0, store=("", port), host_store=True)
    return [first] + [Plan("join", None, None, 0, store=("127.0.0.1", port)) for _ in range(joiners)]


def meet(plan: Plan, run: dict = RUN, timeout: float = 20.0, rank: int | None = None) -> Assignment:
    meeting = StoreRendezvous(plan, timeout)
    meeting.open()
    try:
        return meeting.join(lambda r: f"tcp://127.0.0.1:{9000 + r}", run, plan.world_size,
                            plan.rank if rank is None else rank, server=False, parameter_server=False,
                            run_name=f"name-{plan.source}")
    finally:
        meeting.close()


def meet_all(plans: list[Plan], **kwargs) -> list:
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = [pool.submit(meet, plan, **kwargs) for plan in plans]
        return [f.exception() or f.result() for f in futures]


def test_joiners_get_distinct_ranks_and_everyone_reads_the_same_endpoints():
    results = meet_all(first_and_joiners(free_base_port(1), world_size=4, joiners=3))
    assert sorted(a.rank for a in results) == [0, 1, 2, 3] and results[0].rank == 0
    assert {a.endpoints for a in results} == {tuple(f"tcp://127.0.0.1:{9000 + r}" for r in range(4))}
    assert {a.world_size for a in results} == {4}
    assert {a.run_name for a in results} == {"name-first peer"}  # the first peer's proposal


def held_store(port: int) -> TCPStore:
    """A store the test serves, so that it outlives a first peer whose short timeout expires."""
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)


def test_different_run_flags_are_refused_by_name():
    port = free_base_port(1)
    store = held_store(port)
    joiner = Plan("join", None, None, 0, store=("127.0.0.1", port))
    with ThreadPoolExecutor(2) as pool:
        hosted = pool.submit(meet, Plan("first peer", 0, 2, 0, store=("127.0.0.1", port)), timeout=1.5)
        refused = pool.submit(meet, joiner, run={"task": "digits", "steps": 200})
        assert "steps 200 here, 300 there" in str(refused.exception())
        assert isinstance(hosted.exception(), PeerTimeout)
        assert "peer(s) 1 did not check in within 1.5 s (--rendezvous-timeout)" in str(hosted.exception())
    del store


def test_one_peer_too_many_is_told_so():
    port = free_base_port(1)
    store = held_store(port)
    store.set("gossip/claimed", "1")  # as the first peer does once it holds its rank
    joiner = Plan("join", None, 1, 0, store=("127.0.0.1", port))
    assert meet(joiner).rank == 0
    with pytest.raises(ConfigError, match="already has its 1 peers; this one is one too many"):
        meet(Plan("join", None, None, 0, store=("127.0.0.1", port)))
    del store


def test_two_peers_with_the_same_rank_and_a_disagreeing_world_size():
    port = free_base_port(1)
    store = held_store(port)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(meet, Plan("first peer", 0, 3, 0, store=("127.0.0.1", port)), timeout=1.5)
        while not store.check(["gossip/rank/0"]) and not first.done():
            time.sleep(0.01)
        futures = [pool.submit(meet, Plan("join", None, None, 0, store=("127.0.0.1", port)), rank=0),
                   pool.submit(meet, Plan("join", 2, 5, 0, store=("127.0.0.1", port)))]
        assert "rank 0 is already taken" in str(futures[0].exception())
        assert "started for a world of 5, the swarm has 3" in str(futures[1].exception())
        assert isinstance(first.exception(), PeerTimeout)
    del store


def test_nobody_at_the_initial_peer_is_a_clear_timeout():
    plan = Plan("join", None, None, 0, store=("127.0.0.1", free_base_port(1)))
    with pytest.raises(PeerTimeout, match=r"nothing answered at 127.0.0.1:\d+ within 1 s .* is the first peer"):
        meet(plan, timeout=1.0)


def test_announce_address():
    assert announce_address("node07", "", "10.0.0.1") == "node07"
    assert announce_address("", "10.1.1.1", "10.0.0.1") == "10.1.1.1"
    assert announce_address("", "0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert announce_address("", "", "localhost") == "127.0.0.1"


def test_a_rank_beyond_the_swarm_is_refused():
    port = free_base_port(1)
    store = held_store(port)
    with ThreadPoolExecutor(2) as pool:
        hosted = pool.submit(meet, Plan("first peer", 0, 2, 0, store=("127.0.0.1", port)), timeout=1.5)
        with pytest.raises(ConfigError, match="rank 5 is outside 0..1: the swarm has 2 peers"):
            pool.submit(meet, Plan("join", 5, None, 0, store=("127.0.0.1", port))).result()
        assert isinstance(hosted.exception(), PeerTimeout)
    del store
