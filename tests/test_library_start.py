"""How ``gossip.attach`` finds its swarm (explicit arguments, else torchrun's, SLURM's or MPI's variables,
else alone) and fails: naming its keyword arguments, releasing what it opened so that a retry works."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import torch

import gossip
from gossip.errors import ConfigError, PeerUnreachable
from gossip.flat import FlatParams
from gossip.join import locate
from gossip.naming import as_keywords
from tests.conftest import free_base_port, run_peers, vector_model

pytestmark = pytest.mark.timeout(60)
LAYOUT = FlatParams(vector_model(torch.zeros(3)), 1 << 20).layout


def test_with_nothing_given_and_no_launcher_a_process_trains_alone_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="gossip"):
        config = locate(gossip.GossipConfig(), set(), {}, LAYOUT)
    assert (config.rank, config.world_size) == (0, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "gossip: no rank or world_size given and no torchrun, SLURM or MPI variables set: this process trains "
        "alone (pass rank= and world_size=, or start it with torchrun)"]


@pytest.mark.parametrize("given,env,expected", [
    ({"world_size": 4}, {}, "world_size=4 but this process's rank is unknown: pass rank=R (0..3), or start"),
    ({}, {"RANK": "1", "WORLD_SIZE": "3"}, "RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not"),
    ({}, {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"},
     "Open MPI gives ranks but not where rank 0 is: export MASTER_ADDR (rank 0's host) and MASTER_PORT, or pass "
     "endpoints=[...]"),
])
def test_a_swarm_that_cannot_be_found_is_one_line_naming_what_to_pass(given, env, expected):
    with pytest.raises(ConfigError) as raised:
        locate(gossip.GossipConfig.of(**given), set(given), env, LAYOUT)
    assert str(raised.value).startswith(expected), raised.value


def test_the_launchers_variables_give_what_the_arguments_do_not():
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    config = locate(gossip.GossipConfig.of(endpoints=()), set(), {**env, "WORLD_SIZE": "1", "RANK": "0"}, LAYOUT)
    assert (config.rank, config.world_size) == (0, 1)  # torchrun with one process: alone, nothing to meet
    endpoints = tuple(f"tcp://127.0.0.1:{47000 + r}" for r in range(3))
    config = locate(gossip.GossipConfig.of(endpoints=endpoints, world_size=3), {"endpoints"}, env, LAYOUT)
    assert (config.rank, config.world_size, config.network.endpoints) == (2, 3, endpoints)  # endpoints given: no store


def test_errors_name_keyword_arguments_not_flags():
    assert as_keywords("choose another --base-port, or raise --startup-timeout") == \
        "choose another base_port, or raise startup_timeout"
    assert as_keywords("--no-overlap applies to --mode gossip-sync") == "overlap=False applies to mode gossip-sync"
    assert as_keywords("lower --lr") == "lower --lr"  # (no keyword of attach sets it)
    with pytest.raises(ConfigError, match=r"^chunk_mb 1000 is out of range"):
        gossip.attach(vector_model(torch.zeros(3)), chunk_mb=1000, environ={})
    with pytest.raises(ConfigError, match="^unknown option 'nodez'; see gossip.GossipConfig for the options$"):
        gossip.attach(vector_model(torch.zeros(3)), nodez=3, environ={})
    with pytest.raises(ConfigError, match="^unknown option 'chunk_mib'; did you mean 'chunk_mb'"):
        gossip.attach(vector_model(torch.zeros(3)), chunk_mib=4, environ={})


def test_a_failed_attach_releases_its_socket_and_thread_so_a_retry_works():
    base = free_base_port(2)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", base))
    holder.listen()
    with holder, pytest.raises(PeerUnreachable, match=f"peer 0 cannot listen on tcp://127.0.0.1:{base}: .*choose "
                                                     "another base_port"):
        gossip.attach(vector_model(torch.zeros(3)), rank=0, world_size=2, base_port=base, ipc=False, environ={})
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gossip-loop")]  # its loop thread is gone

    def peer(rank: int) -> list[float]:
        model = vector_model(torch.full((3,), float(rank)))
        with gossip.attach(model, rank=rank, world_size=2, base_port=base, ipc=False, environ={}) as averager:
            for _ in range(3):
                averager.step()
        return model.value.tolist()

    assert run_peers(2, peer) == [[0.5] * 3, [0.5] * 3]  # the retry binds the port the failure released


def test_state_dict_holds_the_counters_and_weight_a_restart_resumes_with(tmp_path):
    base = free_base_port(2)

    def peer(rank: int) -> dict:
        model = vector_model(torch.full((3,), float(rank)))
        with gossip.attach(model, rank=rank, world_size=2, base_port=base, ipc=False, environ={}) as averager:
            for _ in range(4):
                averager.step(samples=8)
            return averager.state_dict()

    states = run_peers(2, peer)
    # (gossip-sync's default mix is not overlapped: the 4th mixing point's round is mixed before step returns)
    assert states[0] == {"step": 4, "rounds": 4, "samples": 32, "weight": 1.0, "found": True}
    torch.save({"averager": states[1]}, tmp_path / "checkpoint.pt")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["averager"] == states[1]


@pytest.mark.parametrize("resume,expected", [
    ([4], "resume must be a dict from averager.state_dict(), got list"),
    ({"step": -1}, "resume['step'] is -1, not a count >= 0"),
    ({"step": 4, "weight": float("nan")}, "resume['weight'] is nan, not a push-sum weight > 0"),
])
def test_a_resume_state_that_is_not_a_state_dict_is_refused_in_one_line(resume, expected):
    base = free_base_port(1)
    with pytest.raises(ConfigError) as raised:
        gossip.attach(vector_model(torch.zeros(3)), rank=0, world_size=2, base_port=base, ipc=False, environ={},
                      resume=resume)
    assert str(raised.value).startswith(expected), raised.value
