"""The launcher's command line: every flag documented with its default, and one clear line for bad input."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from launch.cli import FLAGS, PER_PEER_DEFAULTS, build_parser
from tests.conftest import ROOT, free_base_port

pytestmark = pytest.mark.timeout(60)


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_help_shows_every_flag_with_its_default():
    proc = launch("--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    squeezed = "".join(proc.stdout.split())  # ... and may break them at a hyphen
    parser = build_parser()
    for flag, name, _ in FLAGS:
        assert flag in text, flag
        if name != "out":
            default = parser.get_default(name)
            per_peer = isinstance(default, tuple)
            shown = ",".join(map(str, default)) or PER_PEER_DEFAULTS[name] if per_peer else str(default)
            usage = f"{flag}, --no-{flag[2:]}" if isinstance(default, bool) else f"{flag} {name.upper()}"
            assert usage in text, usage
            assert f"(default:{shown})".replace(" ", "") in squeezed, (flag, shown)
    assert "--progress" in text and "runs/<date-time>" in text


def test_defaults_are_four_peers_on_a_ring_training_digits():
    args = build_parser().parse_args([])
    assert (args.nodes, args.topology, args.mode, args.task) == (4, "ring", "gossip-sync", "digits")


@pytest.mark.parametrize("args,expected", [
    (["--nodes", "abc"], "argument --nodes: invalid int value: 'abc'"),
    (["--nodez", "3"], "unrecognized arguments: --nodez 3"),
    (["--mode", "gossip"], "unknown mode 'gossip'; choose one of: gossip-sync, gossip-async"),
    (["--topology", "rng"], "unknown topology 'rng'"),
    (["--topology", "torus:3x3", "--nodes", "8"], "torus:3x3"),
    (["--nodes", "0"], "--nodes must be >= 1, got 0"),
    (["--speeds", "1,1", "--nodes", "4"], "--speeds lists 2 values for 4 nodes; give one per node, e.g. 1,1,1,0.25"),
    (["--speeds", "1,x"], "is not a comma-separated list of numbers"),
    (["--speeds", "1,1,1,0"], "--speeds must be positive numbers"),
    (["--staleness-weight", "linear"], "unknown staleness weight 'linear'"),
    (["--task", "nosuchpackage.mod:fn"], "cannot import task module 'nosuchpackage.mod'"),
    (["--task", "tests.tasks:nothing_here"], "has no function 'nothing_here'"),
    (["--chunk-mb", "1000"], "--chunk-mb 1000.0 is out of range"),
    (["--mode", "ps-async", "--soft-sync", "9"], "--soft-sync 9 exceeds the 4 workers; use 1..4"),
    (["--mode", "ps-ssp", "--staleness-bound", "-1"], "--staleness-bound must be >= 0, got -1"),
    (["--mode", "ps-dcasgd", "--dc-lambda", "-0.5"], "--dc-lambda must be a number >= 0"),
    (["--mode", "ps-avg", "--local-steps", "0"], "--local-steps must be >= 1, got 0"),
    (["--mode", "ps-async", "--server-lr", "fast"], "--server-lr must be auto or a number > 0, got 'fast'"),
    (["--mode", "ps-ssp", "--server-momentum", "1"], "--server-momentum must be auto or a number in [0, 1)"),
    (["--mode", "ps-avg", "--server-momentum", "0"], "--server-momentum sets the parameter server's optimizer, "
                                                     "which --mode ps-avg has none of"),
    (["--schedule", "clock"], "--schedule 'clock' is not valid; choose one of: steps, time"),
    (["--schedule", "time"], "--schedule time needs --rounds N"),
    (["--rounds", "10"], "--rounds applies to --schedule time"),
    (["--schedule", "time", "--rounds", "5", "--round-seconds", "0"], "--round-seconds must be a positive number"),
    (["--deadline", "soon"], "--deadline 'soon' is not valid; choose one of: fixed, adaptive"),
    (["--mode", "gossip-async", "--deadline", "adaptive"], "need --mode gossip-sync"),
    (["--weight-by", "bytes"], "--weight-by 'bytes' is not valid; choose one of: none, samples"),
    (["--straggler-fraction", "1.5"], "--straggler-fraction must be in (0, 1)"),
    (["--deadline-window", "2"], "--deadline-window must be >= 3"),
    (["--partners", "similar-speed"], "--partners similar-speed: partner choice by speed applies to the random"),
    (["--link-mbit", "0,10"], "--link-mbit lists 2 values for 4 peers; give one per peer"),
    (["--link-mbit", "0,0,0,-1"], "--link-mbit must be rates in Mbit/s >= 0"),
    (["--link-latency-ms", "1,2,3"], "--link-latency-ms lists 3 values for 4 peers"),
    (["--mode", "ps-sync", "--schedule", "time", "--rounds", "5"], "--schedule time and --partners apply to the gossip modes"),
    (["--aggregate", "mode"], "--aggregate 'mode' is not valid; choose one of: mean, median, trimmed-mean"),
    (["--aggregate", "median", "--deadline", "adaptive"], "push-sum masses assume a linear mean"),
    (["--byzantine", "1,x"], "is not a comma-separated list of integers"),
    (["--byzantine", "4"], "--byzantine must list peer ranks in 0..3, got 4"),
])
def test_bad_input_gives_one_clear_line_and_exit_2(args, expected, tmp_path):
    proc = launch(*args, "--out", str(tmp_path / "out"), "--base-port", str(free_base_port(8)))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gossip-launch: error:") and expected in lines[0], lines[0]
    assert not (tmp_path / "out" / "peers.json").exists()


def test_a_port_in_use_is_reported_before_anything_starts(tmp_path):
    base = free_base_port(4)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 2))
        holder.listen()
        proc = launch("--out", str(tmp_path / "out"), "--base-port", str(base))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"gossip-launch: error: port {base + 2} for peer 2 on 127.0.0.1 is unavailable "
                                   "(Address already in use); choose another --base-port")


def test_an_output_directory_holding_a_run_is_not_overwritten(tmp_path):
    (tmp_path / "peers.json").write_text("[]")
    proc = launch("--out", str(tmp_path), "--base-port", str(free_base_port(4)))
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


SECONDS_UP_TO = "must be a positive number of seconds up to"


@pytest.mark.parametrize("args,expected", [
    (["--round-timeout", "1e300"], f"--round-timeout {SECONDS_UP_TO} 604800 (one week), got 1e+300"),
    (["--peer-timeout", "1e20"], f"--peer-timeout {SECONDS_UP_TO} 6553 (ZeroMQ's heartbeat limit), got 1e+20"),
    (["--send-timeout", "inf"], f"--send-timeout {SECONDS_UP_TO} 604800 (one week), got inf"),
    (["--startup-timeout", "nan"], f"--startup-timeout {SECONDS_UP_TO} 604800 (one week), got nan"),
    (["--shutdown-timeout", "1e300"], f"--shutdown-timeout {SECONDS_UP_TO} 604800 (one week), got 1e+300"),
    (["--schedule", "time", "--rounds", "3", "--round-seconds", "1e300"],
     f"--round-seconds {SECONDS_UP_TO} 604800 (one week), got 1e+300"),
    (["--deadline", "adaptive", "--deadline-floor", "inf"], f"--deadline-floor {SECONDS_UP_TO} 604800 (one week)"),
    (["--compute-ms", "1e300"], "--compute-ms must be in 0..6.048e+08 (a step of at most one week), got 1e+300"),
    (["--speeds", "1,1,1,1e-300"], "--speeds must be in 1e-06..1e+06 (1e-06: a million times slower); got 1e-300"),
])
@pytest.mark.parametrize("command", ["gossip-launch", "gossip-peer"])
def test_a_wait_too_long_to_wait_is_one_line_in_both_commands(command, args, expected, capsys, monkeypatch):
    """In-process: the flag is refused while parsing, before a peer starts (one that started would end with
    an OverflowError traceback from threading, asyncio, time.sleep or ZeroMQ)."""
    import types

    import launch.cli
    import launch.peer

    def started(*_args, **_kwargs):
        raise AssertionError("a run started")

    monkeypatch.setitem(sys.modules, "launch.local", types.SimpleNamespace(run_local=started))
    monkeypatch.setitem(sys.modules, "gossip.peer", types.SimpleNamespace(guarded=started, name_logs=started,
                                                                          run_role=started))
    monkeypatch.delenv("GOSSIP_STOP_ON_EOF", raising=False)
    if command == "gossip-launch":
        status = launch.cli.main(args)
    else:
        status = launch.peer.main(["--world-size", "4", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{command}: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("timeout", ["1e300", "inf", "nan"])
def test_the_rendezvous_timeout_is_one_line_too(timeout, capsys):
    import launch.peer

    assert launch.peer.main(["--world-size", "4", "--rendezvous-timeout", timeout]) == 2
    assert capsys.readouterr().err == (f"gossip-peer: error: --rendezvous-timeout {SECONDS_UP_TO} 604800 (one week), "
                                       f"got {float(timeout)!r}\n")
