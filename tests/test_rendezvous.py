"""Pure: launchers' variables -> rank, world size and meeting point; host lists; SLURM node lists; bind
addresses; --device on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gossip.config import GossipConfig, RendezvousConfig
from gossip.device import resolve_device
from gossip.errors import ConfigError
from gossip.net.address import (
    bindable,
    expand_nodelist,
    host_of_rank,
    ipc_endpoint,
    parse_hostfile,
    parse_hosts,
    split_endpoint,
)
from gossip.rendezvous import hosts_endpoints, plan_rendezvous, read_environment

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-04,11]",
         "SLURM_JOB_ID": "4242"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1"}


def test_torchrun_gives_rank_size_local_rank_and_its_agents_store():
    found = read_environment(TORCHRUN, rendezvous_port=46999)
    assert (found.source, found.rank, found.world_size, found.local_rank) == ("torchrun", 3, 4, 1)
    assert found.store == ("node01", 29500) and found.agent_store
    assert found.namespace == "gossip/job7/0"


def test_without_the_agent_store_rank_0_serves_it_at_master_addr():
    plans = [plan_rendezvous(RendezvousConfig(), 47000, {**TORCHRUN, "RANK": str(r),
                                                         "TORCHELASTIC_USE_AGENT_STORE": "False"}) for r in range(4)]
    assert [p.host_store for p in plans] == [True, False, False, False]
    assert {p.store for p in plans} == {("node01", 29500)}
    agent = plan_rendezvous(RendezvousConfig(), 47000, {**TORCHRUN, "RANK": "0"})
    assert not agent.host_store  # torchrun's agent already serves it


def test_a_torchrun_restart_meets_under_a_new_namespace():
    first = read_environment(TORCHRUN, 0).namespace
    assert read_environment({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"}, 0).namespace != first


def test_slurm_meets_on_the_first_node_of_the_job_unless_master_addr_is_set():
    found = read_environment(SLURM, rendezvous_port=46999)
    assert (found.source, found.rank, found.world_size, found.local_rank) == ("SLURM", 5, 8, 1)
    assert found.store == ("gpu03", 46999)
    assert read_environment({**SLURM, "MASTER_ADDR": "login2", "MASTER_PORT": "1234"}, 46999).store == ("login2", 1234)
    plan = plan_rendezvous(RendezvousConfig(), 47000, {**SLURM, "SLURM_PROCID": "0"})
    assert plan.host_store and plan.store == ("gpu03", 46999)  # rendezvous port: BASE_PORT - 1


@pytest.mark.parametrize("env,expected", [(OPENMPI, ("Open MPI", 2, 6, 0)), (MPICH, ("MPICH", 1, 3, 1))])
def test_mpi_variables(env, expected):
    found = read_environment(env, 0)
    assert (found.source, found.rank, found.world_size, found.local_rank) == expected
    assert found.store is None
    assert read_environment({**env, "MASTER_ADDR": "h0", "MASTER_PORT": "7000"}, 0).store == ("h0", 7000)


def test_precedence_is_torchrun_then_slurm_then_open_mpi_then_mpich():
    assert read_environment({**MPICH, **OPENMPI, **SLURM, **TORCHRUN}, 0).source == "torchrun"
    assert read_environment({**MPICH, **OPENMPI, **SLURM}, 0).source == "SLURM"
    assert read_environment({**MPICH, **OPENMPI}, 0).source == "Open MPI"
    assert read_environment({}, 0).source == ""


def test_flags_win_over_the_environment():
    plan = plan_rendezvous(RendezvousConfig(rank=1, world_size=4), 47000, TORCHRUN)
    assert (plan.rank, plan.world_size, plan.source) == (1, 4, "flags")
    plan = plan_rendezvous(RendezvousConfig(initial_peers=("tcp://seed:5000",)), 47000, TORCHRUN)
    assert plan.store == ("seed", 5000) and not plan.host_store and plan.rank == 3


def test_hosts_fix_every_endpoint_and_need_a_rank():
    plan = plan_rendezvous(RendezvousConfig(rank=4, hosts="a:4,b:2"), 5000, {})
    assert plan.world_size == 6 and plan.store is None
    assert plan.endpoints == ("tcp://a:5000", "tcp://a:5001", "tcp://a:5002", "tcp://a:5003", "tcp://b:5004",
                              "tcp://b:5005")
    assert plan_rendezvous(RendezvousConfig(hosts="a:2"), 5000, {**TORCHRUN, "RANK": "1", "WORLD_SIZE": "2"}).rank == 1
    with pytest.raises(ConfigError, match="with --hosts give this peer's --rank"):
        plan_rendezvous(RendezvousConfig(hosts="a:2"), 5000, {})
    with pytest.raises(ConfigError, match="--hosts a:2 has 2 slots but the world size is 3"):
        plan_rendezvous(RendezvousConfig(rank=0, world_size=3, hosts="a:2"), 5000, {})


def test_first_peer_joiner_and_lone_peer():
    first = plan_rendezvous(RendezvousConfig(world_size=3), 47000, {})
    assert (first.source, first.rank, first.host_store, first.store) == ("first peer", 0, True, ("", 46999))
    joiner = plan_rendezvous(RendezvousConfig(initial_peers=("tcp://10.0.0.1:46999",)), 47000, {})
    assert (joiner.source, joiner.rank, joiner.world_size, joiner.store) == ("join", None, None, ("10.0.0.1", 46999))
    alone = plan_rendezvous(RendezvousConfig(world_size=1), 47000, {})
    assert alone.store is None and alone.rank == 0


@pytest.mark.parametrize("rendezvous,env,message", [
    (RendezvousConfig(), {}, "give the first peer --world-size N and the others --initial-peers"),
    (RendezvousConfig(), OPENMPI, "Open MPI gives ranks but not where rank 0 is: export MASTER_ADDR"),
    (RendezvousConfig(), {"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR or MASTER_PORT is not"),
    (RendezvousConfig(), {**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer >= 0"),
    (RendezvousConfig(), {**TORCHRUN, "RANK": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
    (RendezvousConfig(rank=5), TORCHRUN, "rank 5 is outside 0..3 (world size from torchrun)"),
    (RendezvousConfig(), {**SLURM, "SLURM_JOB_NODELIST": "gpu[03-x]"}, "cannot read the SLURM node list"),
])
def test_bad_environments_say_what_to_do(rendezvous, env, message):
    with pytest.raises(ConfigError) as error:
        plan_rendezvous(rendezvous, 47000, env)
    assert message in str(error.value)


@pytest.mark.parametrize("nodelist,nodes", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a,b", ["a", "b"]),
    ("gpu[1-2],cpu5,x[8-10]-ib", ["gpu1", "gpu2", "cpu5", "x8-ib", "x9-ib", "x10-ib"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
])
def test_slurm_nodelist_expansion(nodelist, nodes):
    assert expand_nodelist(nodelist) == nodes


@given(st.lists(st.integers(0, 999), min_size=1, max_size=20, unique=True), st.integers(1, 4))
def test_nodelist_expansion_inverts_slurms_compression(indices, width):
    names = [f"node{str(i).zfill(width)}" for i in sorted(indices)]
    compressed = "node[" + ",".join(str(i).zfill(width) for i in sorted(indices)) + "]"
    assert expand_nodelist(compressed) == names


def test_host_lists_and_hostfiles():
    assert parse_hosts("a:4,b:2, c") == [("a", 4), ("b", 2), ("c", 1)]
    assert [host_of_rank(parse_hosts("a:2,b:1"), r) for r in range(3)] == ["a", "a", "b"]
    text = "# cluster\nnode01 slots=4\nnode02:2   # the small one\n\nnode03\n"
    assert parse_hostfile(text) == "node01:4,node02:2,node03"
    assert hosts_endpoints("a:1,b:1", 100) == ("tcp://a:100", "tcp://b:101")
    for spec, message in [("a:0", "must be a positive integer"), ("a:2,a:1", "names a twice"), ("a b", "not a host")]:
        with pytest.raises(ConfigError, match=message):
            parse_hosts(spec)
    with pytest.raises(ConfigError, match="line 1 'node01 cpus=4'"):
        parse_hostfile("node01 cpus=4")


def test_endpoints_and_what_a_peer_binds():
    assert split_endpoint("tcp://10.0.0.1:47000") == ("10.0.0.1", 47000)
    with pytest.raises(ConfigError, match="write tcp://HOST:PORT"):
        split_endpoint("10.0.0.1:47000")
    assert [bindable(h) for h in ("10.1.2.3", "localhost", "node07")] == ["10.1.2.3", "127.0.0.1", "0.0.0.0"]
    config = GossipConfig.of(rank=1, world_size=2, endpoints=("tcp://node07:5000", "tcp://10.0.0.2:5001"))
    assert [config.bind_endpoint(r) for r in (0, 1)] == ["tcp://0.0.0.0:5000", "tcp://10.0.0.2:5001"]
    assert GossipConfig.of(bind="0.0.0.0").bind_endpoint(0) == "tcp://0.0.0.0:47000"
    assert GossipConfig().bind_endpoint(0) == GossipConfig().endpoint(0) == "tcp://127.0.0.1:47000"


@pytest.mark.parametrize("fields,message", [
    ({"rank": -2}, "--rank must be >= -1"),
    ({"world_size": -1}, "--world-size must be >= 0"),
    ({"rank": 2, "world_size": 2}, "--rank 2 is outside 0..1"),
    ({"initial_peers": ("10.0.0.1",)}, "write tcp://HOST:PORT"),
    ({"announce": "a b"}, "--announce 'a b' is not a host name"),
    ({"hosts": "a:1", "hostfile": "f"}, "give --hosts or --hostfile, not both"),
    ({"remote_shell": " "}, "--remote-shell is empty"),
])
def test_rendezvous_config_checks(fields, message):
    with pytest.raises(ConfigError, match=message):
        RendezvousConfig(**fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without a GPU")
def test_device_without_a_gpu():
    assert resolve_device("auto", local_rank=3).type == "cpu"
    assert resolve_device("cpu", local_rank=0).type == "cpu"
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=f"--device {spec}: torch sees no GPU"):
            resolve_device(spec, local_rank=0)


@pytest.mark.parametrize("endpoint, expected", [
    ("tcp://127.0.0.1:47000", "ipc://@gossip-train/127.0.0.1:47000"),
    ("tcp://127.3.0.9:5", "ipc://@gossip-train/127.3.0.9:5"),
    ("tcp://localhost:47001", "ipc://@gossip-train/localhost:47001"),
    ("tcp://10.77.0.1:47000", None),  # routable: it may be a port mapped into another namespace
    ("tcp://node07:47000", None),
    ("ipc:///tmp/x", None),
    ("not an endpoint", None),
])
def test_only_loopback_endpoints_have_a_same_host_unix_socket(endpoint, expected):
    assert ipc_endpoint(endpoint) == expected
