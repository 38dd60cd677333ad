"""``gossip-peer``'s command line, in process: the launcher's flags plus the rendezvous flags, flags that
reproduce a configuration, and one clear line (exit 2) for bad flags, variables and host lists."""

from __future__ import annotations

import shlex

import pytest

from launch import cli, flags
from launch import peer as peer_cli
from tests.conftest import free_base_port

pytestmark = pytest.mark.timeout(60)


def test_help_lists_the_shared_and_the_rendezvous_flags_but_not_the_launchers_own():
    text = " ".join(peer_cli.build_parser().format_help().split())
    for row in flags.SHARED_FLAGS + flags.PEER_FLAGS:
        assert row.flag in text, row.flag
    for row in flags.FLAGS:
        if row.name in flags.LAUNCHER_ONLY:
            assert f"{row.flag} " not in text, row.flag
    assert "--server" in text and "(default: -1)" in text and "(default: 300.0)" in text


def test_flags_written_from_a_config_read_back_as_the_same_config():
    argv = ["--mode", "ps-dcasgd", "--speeds", "1,1,1,0.5", "--dc-adaptive",
            "--device", "cpu", "--bind", "0.0.0.0", "--lr", "0.1", "--out", "runs/x", "--hosts", "a:2,b:2"]
    parser = peer_cli.build_parser()
    args = parser.parse_args(argv)
    cfg = flags.config_from_args(args, nodes=4)
    rendezvous = flags.rendezvous_from_args(args)
    written = flags.flag_argv(flags.field_values(cfg, rendezvous), flags.SHARED_FLAGS)
    again = parser.parse_args(written)
    assert flags.config_from_args(again, nodes=4) == cfg and flags.rendezvous_from_args(again) == rendezvous
    assert "--dc-adaptive" in written and "--steps" not in written  # defaults are left out


def test_the_line_for_the_next_machine_carries_the_run_flags_only():
    args = peer_cli.build_parser().parse_args(["--steps", "50", "--world-size", "3", "--device", "cpu",
                                               "--bind", "10.0.0.1", "--base-port", "5000"])
    line = peer_cli.next_machine_line(flags.config_from_args(args, nodes=3), "tcp://10.0.0.1:4999")
    assert line == "python -m launch.peer --initial-peers tcp://10.0.0.1:4999 --steps 50 --base-port 5000"


@pytest.mark.parametrize("run", [[], ["--topology", "exponential", "--speeds", "1,1,0.5"], ["--topology", "torus"]])
def test_a_joiner_offers_the_first_peers_run_flags_from_the_line_it_printed(run):
    """A joiner checks its flags on a stand-in before it knows the world size; what it offers at the
    rendezvous must still equal what the first peer offers (it offered the stand-in's ring and no speeds)."""
    parser = peer_cli.build_parser()
    first = parser.parse_args(["--world-size", "3", "--steps", "40", *run])
    offered = peer_cli.agreed_flags(peer_cli.provisional_config(first, 3), first, 3)
    line = peer_cli.next_machine_line(flags.config_from_args(first, nodes=3), "tcp://10.0.0.1:4999")
    joiner = parser.parse_args(shlex.split(line)[3:])
    assert peer_cli.agreed_flags(peer_cli.provisional_config(joiner, None), joiner, None) == offered


@pytest.mark.parametrize("argv,env,expected", [
    (["--rank", "5", "--world-size", "2"], {}, "--rank 5 is outside 0..1"),
    (["--initial-peers", "10.0.0.1:46999"], {}, "'10.0.0.1:46999' is not an endpoint; write tcp://HOST:PORT"),
    (["--device", "gpu", "--world-size", "2"], {}, "--device 'gpu' is not a device"),
    (["--hosts", "a:0", "--rank", "0"], {}, "--hosts entry 'a:0': the count after ':' must be a positive integer"),
    (["--steps", "5"], {}, "give the first peer --world-size N and the others --initial-peers"),
    ([], {"RANK": "1", "WORLD_SIZE": "2"}, "RANK and WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not"),
    ([], {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, "export MASTER_ADDR (rank 0's host)"),
    ([], {"SLURM_PROCID": "x", "SLURM_NTASKS": "4"}, "SLURM_PROCID='x' is not an integer"),
    (["--world-size", "2", "--task", "nosuch.module:fn"], {}, "cannot import task module 'nosuch.module'"),
    (["--world-size", "3", "--topology", "torus:2x2"], {}, "torus:2x2"),
])
def test_bad_input_is_one_line_and_exit_2(argv, env, expected, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert peer_cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gossip-peer: error:") and expected in lines[0], lines


@pytest.mark.parametrize("argv,expected", [
    (["--hosts", "a:2", "--nodes", "3"], "--nodes 3 but --hosts has 2 slots; leave --nodes out with --hosts"),
    (["--hostfile", "/nonexistent/hosts"], "cannot read the hostfile /nonexistent/hosts"),
    (["--hosts", "a:2,a:1"], "--hosts names a twice"),
    (["--hosts", "a:1", "--hostfile", "f"], "give --hosts or --hostfile, not both"),
])
def test_launcher_host_lists_are_checked(argv, expected, tmp_path, capsys):
    code = cli.main([*argv, "--out", str(tmp_path / "out"), "--base-port", str(free_base_port(4))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_remote_peer_is_started_with_the_run_flags_its_rank_and_the_host_list(tmp_path):
    from launch.hosts import remote_command, run_config

    args = cli.build_parser().parse_args(["--hosts", "a:1,b:1", "--steps", "7", "--remote-shell", "ssh -p 2222",
                                          "--remote-python", "/opt/py/bin/python", "--out", str(tmp_path)])
    rendezvous = flags.rendezvous_from_args(args)
    cfg = run_config(args, "a:1,b:1", nodes_given=False)
    assert cfg.gossip.network.endpoints == ("tcp://a:47000", "tcp://b:47001")
    command = remote_command(cfg, rendezvous, "a:1,b:1", "b", ["--rank", "1"])
    assert command[:4] == ["ssh", "-p", "2222", "b"]
    assert "GOSSIP_STOP_ON_EOF=1" in command[4] and "exec /opt/py/bin/python -m launch.peer" in command[4]
    assert command[4].endswith(f"--steps 7 --out {tmp_path} --hosts a:1,b:1 --rank 1")
