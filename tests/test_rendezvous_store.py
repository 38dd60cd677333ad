"""The endpoint exchange on a real TCPStore on loopback, one thread per peer: ranks given out once, every
peer reading the same endpoints, and one clear error for each way a swarm can be formed wrongly; and what
someone else who reaches the store can no longer do: squat or overwrite an endpoint unseen, forge one in
--secure mode, put a path into the run name, or reach a store served on loopback from elsewhere.

Most tests meet at one store that a child process serves, each under a namespace of its own: in one
process, torch (2.13) stalls about every 25th connection to a store served in that same process for 5 s
(a connect that hangs in the kernel), which the tests of a whole module would hit several times."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import zmq
import zmq.utils.z85
from torch.distributed import TCPStore

from gossip.errors import ConfigError, PeerFailed, PeerTimeout
from gossip.net.security import CurveKeys, generate_keys, load_keys, shared_secret
from gossip.rendezvous import Plan
from gossip.rendezvous_store import Assignment, StoreRendezvous, Tags, announce_address, check_run_name, shown
from tests.conftest import free_base_port, wait_until

pytestmark = pytest.mark.timeout(60)
RUN = {"task": "digits", "steps": 300}
SERVE = """import os, socket, sys, torch.distributed as dist
listener = socket.socket()
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(128)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      master_listen_fd=os.dup(listener.fileno()))
print("serving", flush=True)
sys.stdin.read()  # until the test module closes our stdin (or dies)
"""


@dataclass
class Served:
    port: int
    store: TCPStore  # a client of it: the test's own hand in the store
    spaces: itertools.count

    def space(self) -> str:
        """A namespace of its own for one test's swarm."""
        return f"test{next(self.spaces)}"

    def plan(self, namespace: str, rank: int | None = None, world_size: int | None = None,
             source: str = "") -> Plan:
        return Plan(source or ("flags" if rank is not None else "join"), rank, world_size, 0,
                    store=("127.0.0.1", self.port), namespace=namespace)


@pytest.fixture(scope="module")
def served():
    port = free_base_port(1)
    child = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "serving"
        yield Served(port, TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)),
                     itertools.count())
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)


def first_and_joiners(port: int, world_size: int, joiners: int) -> list[Plan]:
    first = Plan("first peer", 0, world_size, 0, store=("", port), host_store=True)
    return [first] + [Plan("join", None, None, 0, store=("127.0.0.1", port)) for _ in range(joiners)]


def meet(plan: Plan, run: dict = RUN, timeout: float = 20.0, rank: int | None = None, bind: str = "",
         keydir: str = "") -> Assignment:
    meeting = StoreRendezvous(plan, timeout, bind=bind, keydir=keydir)
    meeting.open()
    try:
        return meeting.join(lambda r: f"tcp://127.0.0.1:{9000 + r}", run, plan.world_size,
                            plan.rank if rank is None else rank, server=False, parameter_server=False,
                            run_name=f"name-{plan.source.replace(' ', '-')}")
    finally:
        meeting.close()


def meet_all(plans: list[Plan], **kwargs) -> list:
    with ThreadPoolExecutor(len(plans)) as pool:
        futures = [pool.submit(meet, plan, **kwargs) for plan in plans]
        return [f.exception() or f.result() for f in futures]


def wait_for(store: TCPStore, key: str, future=None) -> None:
    """Wait for ``key`` in the store; fail at once, with its error, if ``future`` ends before it is there."""
    def stored() -> bool:
        if store.check([key]):
            return True
        assert future is None or not future.done(), future.exception()
        return False

    wait_until(stored, 10, f"{key} in the store")


@pytest.mark.slow  # waits on the store's sockets
def test_joiners_get_distinct_ranks_and_everyone_reads_the_same_endpoints():
    results = meet_all(first_and_joiners(free_base_port(1), world_size=4, joiners=3))
    assert sorted(a.rank for a in results) == [0, 1, 2, 3] and results[0].rank == 0
    assert {a.endpoints for a in results} == {tuple(f"tcp://127.0.0.1:{9000 + r}" for r in range(4))}
    assert {a.world_size for a in results} == {4}
    assert {a.run_name for a in results} == {"name-first-peer"}  # the first peer's proposal


def test_different_run_flags_are_refused_by_name(served):
    space = served.space()
    with ThreadPoolExecutor(2) as pool:
        hosted = pool.submit(meet, served.plan(space, 0, 2, "first peer"), timeout=1.5)
        refused = pool.submit(meet, served.plan(space), run={"task": "digits", "steps": 200})
        assert "steps 200 here, 300 there" in str(refused.exception())
        # the peer that found the difference told the store why: the first stops with that, not a timeout
        assert isinstance(hosted.exception(), PeerFailed)
        assert str(hosted.exception()).startswith("a peer without a rank could not join: this peer's run flags "
                                                  "differ from the swarm's (steps 200 here, 300 there)")


def test_a_peer_that_cannot_join_stops_only_once_the_peers_waiting_have_read_why(served):
    """A launcher that ends every process once one exits (torchrun) must find the others with the line read: the
    peer that left it returns only after each peer still joining has counted itself under ``abort-seen``."""
    space = served.space()

    def refused_then_count() -> int:
        with pytest.raises(ConfigError, match="steps 200 here, 300 there"):
            meet(served.plan(space), run={"task": "digits", "steps": 200})
        return int(served.store.add(f"{space}/abort-seen", 0))  # at once, before the others go on

    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(meet, served.plan(space, rank, 3), timeout=5.0) for rank in (0, 1)]
        for rank, future in enumerate(waiting):  # both wait for peer 2's endpoint
            wait_for(served.store, f"{space}/endpoint/{rank}", future)
        assert pool.submit(refused_then_count).result() == 2
        assert all(isinstance(f.exception(), PeerFailed) for f in waiting)


def test_one_peer_too_many_is_told_so(served):
    space = served.space()
    served.store.set(f"{space}/claimed", "1")  # as the first peer does once it holds its rank
    assert meet(served.plan(space, world_size=1)).rank == 0
    with pytest.raises(ConfigError, match="already has its 1 peers; this one is one too many"):
        meet(served.plan(space))


def test_two_peers_with_the_same_rank_and_a_disagreeing_world_size(served):
    space = served.space()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(meet, served.plan(space, 0, 3, "first peer"), timeout=1.5)
        wait_for(served.store, f"{space}/rank/0", first)
        futures = [pool.submit(meet, served.plan(space), rank=0), pool.submit(meet, served.plan(space, 2, 5))]
        assert "rank 0 is already taken" in str(futures[0].exception())
        assert "started for a world of 5, the swarm has 3" in str(futures[1].exception())
        assert isinstance(first.exception(), PeerFailed)  # told by whichever of the two failed first


@pytest.mark.slow  # waits on the store's sockets
def test_nobody_at_the_initial_peer_is_a_clear_timeout():
    plan = Plan("join", None, None, 0, store=("127.0.0.1", free_base_port(1)))
    with pytest.raises(PeerTimeout, match=r"nothing answered at 127.0.0.1:\d+ within 1 s .* is the first peer"):
        meet(plan, timeout=1.0)


def test_announce_address():
    assert announce_address("node07", "", "10.0.0.1") == "node07"
    assert announce_address("", "10.1.1.1", "10.0.0.1") == "10.1.1.1"
    assert announce_address("", "0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert announce_address("", "", "localhost") == "127.0.0.1"


def test_a_rank_beyond_the_swarm_is_refused(served):
    space = served.space()
    with ThreadPoolExecutor(2) as pool:
        hosted = pool.submit(meet, served.plan(space, 0, 2, "first peer"), timeout=1.5)
        with pytest.raises(ConfigError, match="rank 5 is outside 0..1: the swarm has 2 peers"):
            pool.submit(meet, served.plan(space, 5)).result()
        assert isinstance(hosted.exception(), PeerFailed)  # started for this swarm, so it is told why
        assert str(hosted.exception()) == "peer 5 could not join: rank 5 is outside 0..1: the swarm has 2 peers"


# -- someone else at the store -------------------------------------------------------------------------
def test_a_squatted_endpoint_stops_its_peer_with_one_line(served):
    space = served.space()
    served.store.set(f"{space}/endpoint/1", "tcp://10.6.6.6:9001")  # written before peer 1 gets there
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(meet, served.plan(space, 0, 2))
        squatted = pool.submit(meet, served.plan(space, 1, 2))
        error = str(squatted.exception())
        assert error.startswith(f"endpoint/1 in the store at 127.0.0.1:{served.port} was already written by someone "
                                "else (it holds tcp://10.6.6.6:9001)") and "\n" not in error
        first.result()  # without --secure, peer 0 cannot tell (see the signed tests below)


def test_an_overwrite_attempt_does_not_change_what_readers_see(served):
    space, store = served.space(), served.store
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(meet, served.plan(space, 0, 2))
        wait_for(store, f"{space}/endpoint/0", first)
        # the way every entry is written: compare_set against "absent" changes nothing once it is written
        assert store.compare_set(f"{space}/endpoint/0", "", "tcp://10.6.6.6:9000") == b"tcp://127.0.0.1:9000"
        joiner = meet(served.plan(space, 1, 2))
        assert joiner.endpoints == ("tcp://127.0.0.1:9000", "tcp://127.0.0.1:9001") == first.result().endpoints


def test_a_raw_overwrite_is_caught_by_the_owner_who_binds_what_it_announced(served):
    space, store = served.space(), served.store
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(meet, served.plan(space, 0, 2))
        wait_for(store, f"{space}/endpoint/0", first)
        store.set(f"{space}/endpoint/0", "tcp://10.6.6.6:9000")  # a TCPStore has no access control
        joiner = meet(served.plan(space, 1, 2))
        assert joiner.endpoints[1] == "tcp://127.0.0.1:9001"  # its own: what it announced, never read back
        assert str(first.exception()) == (f"endpoint/0 in the store at 127.0.0.1:{served.port} was overwritten by "
                                          "someone else (it now holds tcp://10.6.6.6:9000; this peer announced "
                                          "tcp://127.0.0.1:9000)")


@pytest.mark.parametrize("name", ["../../home/x", "a/b", "/etc", "..", ".", "x" * 101, "run\nname", "r\x1b[2J", "a b"])
def test_a_run_name_that_is_not_a_plain_file_name_is_refused(name):
    with pytest.raises(ConfigError) as error:
        check_run_name(name)
    assert "is not a plain file name" in str(error.value) and "\n" not in str(error.value)


def test_a_hostile_run_name_world_size_or_run_flags_in_the_store_give_one_line(served):
    assert [check_run_name(n) for n in ("20250101-120000", "a.b_c-9", "")] == ["20250101-120000", "a.b_c-9", ""]
    for key, value, message in [("world_size", "2x", f"world_size in the store at 127.0.0.1:{served.port} holds 2x"),
                                ("world_size", "9999999", "holds 9999999, not a world size"),
                                ("run", "[1]", "run in the store at"),
                                ("name", "../../outside", "the run name in the rendezvous store, ../../outside, is "
                                                          "not a plain file name")]:
        space = served.space()
        for k, v in {"world_size": "2", "run": json.dumps(RUN, sort_keys=True), "name": "ok", key: value}.items():
            served.store.set(f"{space}/{k}", v)
        with pytest.raises(ConfigError, match="someone else wrote it") as error:
            meet(served.plan(space))
        assert message in str(error.value) and "\n" not in str(error.value)
    space = served.space()
    served.store.set(f"{space}/rank/0", "evil\nline\x1b[2J")
    with pytest.raises(ConfigError, match=r"rank 0 is already taken by 'evil\\nline\\x1b\[2J'; give every peer"):
        meet(served.plan(space, 0, 2))
    assert shown("x" * 100).endswith("'...") and len(shown("x" * 100)) == 85


def test_a_joiner_does_not_take_a_claimed_rank(served):
    space, store = served.space(), served.store
    store.set(f"{space}/claimed", "1")
    for rank in (0, 2):
        store.set(f"{space}/rank/{rank}", f"someone {rank}")
    with ThreadPoolExecutor(1) as pool:  # peers 0 and 2 write their endpoints, as their claims say
        joiner = pool.submit(meet, served.plan(space, world_size=3))
        wait_for(store, f"{space}/endpoint/1", joiner)
        for rank in (0, 2):
            store.compare_set(f"{space}/endpoint/{rank}", "", f"tcp://127.0.0.1:{9000 + rank}")
        assert joiner.result().rank == 1
    with pytest.raises(ConfigError, match="rank 2 is already taken by someone 2; give every peer its own --rank"):
        meet(served.plan(space, 2, 3))


# -- the store served by a peer listens where the peer binds --------------------------------------------
def test_the_store_a_peer_serves_listens_only_on_its_bind_address():
    port = free_base_port(1)
    meeting = StoreRendezvous(Plan("first peer", 0, 2, 0, store=("", port), host_store=True), 5, bind="127.0.0.2")
    meeting.open()
    try:
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
        with pytest.raises(ConnectionRefusedError):  # a store on every interface would answer here
            socket.create_connection(("127.0.0.1", port), timeout=2)
        if shutil.which("ss"):
            listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True,
                                       timeout=10).stdout.split()
            assert f"127.0.0.2:{port}" in listening and f"*:{port}" not in listening, listening
    finally:
        meeting.close()
    with pytest.raises(Exception, match=f"cannot serve the rendezvous store on 10.255.255.1:{port}.*not an address "
                       "of this host"):
        StoreRendezvous(Plan("first peer", 0, 2, 0, store=("", port), host_store=True), 5, bind="10.255.255.1").open()


@pytest.mark.slow  # waits on the store's sockets
def test_a_swarm_meets_at_a_store_bound_to_one_address():
    port = free_base_port(1)
    plans = [Plan("first peer", 0, 3, 0, store=("", port), host_store=True)] + \
        [Plan("join", None, None, 0, store=("127.0.0.2", port)) for _ in range(2)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(meet, plan, bind="127.0.0.2" if plan.host_store else "") for plan in plans]
        results = [f.result() for f in futures]
    assert sorted(a.rank for a in results) == [0, 1, 2]


# -- --secure: entries signed with the run's CURVE keys -------------------------------------------------
@pytest.fixture(scope="module")
def keydirs(tmp_path_factory) -> list[str]:
    """Every rank's KEYDIR as its host holds it: everyone's public keys, its own secret key only."""
    root = tmp_path_factory.mktemp("keys")
    generate_keys(root / "all", 3)
    dirs = []
    for rank in range(3):
        own = root / f"host{rank}"
        shutil.copytree(root / "all" / "public", own / "public")
        (own / "private").mkdir()
        shutil.copy(root / "all" / "private" / f"peer-{rank}.key_secret", own / "private")
        dirs.append(str(own))
    return dirs


def test_secure_peers_meet_and_a_joiner_takes_the_rank_whose_key_it_holds(served, keydirs):
    space = served.space()
    plans = [served.plan(space, 0, 3, "first peer"), served.plan(space), served.plan(space)]
    served.store.set(f"{space}/claimed", "1")
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(meet, plan, keydir=keydirs[(3 - i) % 3]) for i, plan in enumerate(plans)]
        results = [f.result() for f in futures]
    assert [a.rank for a in results] == [0, 2, 1]  # host 2's key dir holds only peer-2's secret, and so on
    assert {a.endpoints for a in results} == {tuple(f"tcp://127.0.0.1:{9000 + r}" for r in range(3))}
    assert json.loads(served.store.get(f"{space}/endpoint/1"))["endpoint"] == "tcp://127.0.0.1:9001"
    assert served.store.check([f"{space}/tag/1/0", f"{space}/tag/1/2"]) and not served.store.check([f"{space}/tag/1/1"])


def test_the_shared_secret_is_x25519_of_the_curve_keys():
    z85 = zmq.utils.z85.encode
    alice = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")  # RFC 7748, 6.1
    bob_public = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
    assert shared_secret(z85(alice), z85(bob_public)).hex() == \
        "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
    (public_a, secret_a), (public_b, secret_b) = zmq.curve_keypair(), zmq.curve_keypair()
    assert shared_secret(secret_a, public_b) == shared_secret(secret_b, public_a)
    assert z85(shared_secret(secret_a, z85((9).to_bytes(32, "little")))) == public_a  # libzmq's own public key
    with pytest.raises(ConfigError, match="low order"):
        shared_secret(secret_a, z85(bytes(32)))


def forge(store: TCPStore, space: str, keys: CurveKeys | None, entry: str | None = None) -> None:
    """Write peer 1's endpoint entry (by default one pointing elsewhere), tagged for peer 0 with ``keys``
    over the nonce peer 0 published (``keys`` None: no tag)."""
    entry = entry or json.dumps({"agreed": "", "endpoint": "tcp://10.6.6.6:9001"}, sort_keys=True)
    if keys is not None:
        nonces = {"0": store.get(f"{space}/nonce/0").decode()}
        store.set(f"{space}/tag/1/0", Tags(keys, "1", 3).seal("endpoint/1", entry, nonces)["0"])
    store.set(f"{space}/endpoint/1", entry)


def test_secure_readers_refuse_a_forged_replayed_or_untagged_endpoint(served, keydirs):
    old = served.space()  # an earlier run with the same keys, its entries recorded
    with ThreadPoolExecutor(3) as pool:
        [f.result() for f in [pool.submit(meet, served.plan(old, r, 3), keydir=keydirs[r]) for r in range(3)]]
    public, secret = zmq.curve_keypair()
    key_holder = load_keys(keydirs[2], 2, 3)  # peer 2's own key: it cannot sign for peer 1 either

    def replay(space: str) -> None:
        for key in ("tag/1/0", "endpoint/1"):
            served.store.set(f"{space}/{key}", served.store.get(f"{old}/{key}"))

    for attack in [lambda space: forge(served.store, space, CurveKeys(public, secret, key_holder.peers, Path())),
                   lambda space: forge(served.store, space, key_holder),
                   replay,
                   lambda space: forge(served.store, space, None, served.store.get(f"{old}/endpoint/1").decode())]:
        space = served.space()
        with ThreadPoolExecutor(2) as pool:
            peers = [pool.submit(meet, served.plan(space, r, 3), keydir=keydirs[r]) for r in (0, 2)]
            wait_for(served.store, f"{space}/nonce/0", peers[0])
            served.store.set(f"{space}/nonce/1", "00" * 16)
            attack(space)
            for peer in peers:
                assert str(peer.exception()) == ("endpoint/1 in the rendezvous store is not signed by peer 1's key; "
                                                 "someone else wrote it (the run stops: restart it, and keep the "
                                                 "store's port off untrusted networks)")
    space = served.space()  # signed by peer 1, but for other flags than the swarm's: changed under it
    with ThreadPoolExecutor(1) as pool:
        peer = pool.submit(meet, served.plan(space, 0, 2), keydir=keydirs[0])
        wait_for(served.store, f"{space}/nonce/0", peer)
        served.store.set(f"{space}/nonce/1", "00" * 16)
        forge(served.store, space, load_keys(keydirs[1], 1, 3))
        assert str(peer.exception()).startswith("peer 1 agreed on another world size, run flags or run name than "
                                                "this peer: someone changed them")


def test_secure_a_squatted_rank_or_a_missing_key_is_one_line(served, keydirs):
    space = served.space()
    served.store.set(f"{space}/claimed", "1")
    served.store.set(f"{space}/rank/1", "squatter")
    with pytest.raises(ConfigError, match=r"no free rank whose secret key is in .*host1/private \(this host holds "
                       r"the keys of rank\(s\) 1, and those are taken\)"):
        meet(served.plan(space, world_size=3), keydir=keydirs[1])
    with pytest.raises(ConfigError, match="no secret key .*host1/private/peer-0.key_secret"):
        meet(served.plan(space, 0, 3), keydir=keydirs[1])
    assert not served.store.check([f"{space}/rank/0"])  # refused before it claimed the rank
