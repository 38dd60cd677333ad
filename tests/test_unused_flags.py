"""A flag that does nothing in the chosen mode is refused with one line, and so is a number out of range,
before any process starts: in the launcher (``launch.cli.main`` in this process) and in ``gossip-peer``."""

from __future__ import annotations

import dataclasses

import pytest

from gossip.config import USED_ONLY_IN, CoordinatorConfig, GossipConfig
from launch.cli import main
from launch.peer import main as peer_main
from tests.conftest import free_base_port

pytestmark = pytest.mark.timeout(60)

# Settings every mode reads (where peers listen and how long they wait, ...), and mode-specific ones that
# their own checks refuse elsewhere in gossip/config.py with a message of their own; every other field of
# GossipConfig and CoordinatorConfig must say in USED_ONLY_IN where it applies.
EVERY_MODE = {"rank", "world_size", "mode", "host", "base_port", "endpoints", "bind", "server_endpoint", "ipc",
              "secure", "peer_speeds", "link_latency_ms", "chunk_mb", "queue_depth", "round_timeout", "peer_timeout",
              "startup_timeout", "send_timeout", "shutdown_timeout", "seed", "max_rounds", "max_steps", "max_weight",
              "lazy_snapshot"}
CHECKED_ELSEWHERE = {"schedule", "weight_by", "deadline", "overlap", "compress", "partners", "rate_compensation",
                     "aggregate", "byzantine", "server_momentum", "server_lr", "outer_optimizer", "outer_lr",
                     "outer_momentum"}


def test_every_setting_says_where_it_applies():
    fields = {f.name for cls in (GossipConfig, CoordinatorConfig) for f in dataclasses.fields(cls)}
    classified = {name for _, name in USED_ONLY_IN} | EVERY_MODE | CHECKED_ELSEWHERE
    assert fields == classified, f"unclassified: {sorted(fields - classified)}; gone: {sorted(classified - fields)}"


@pytest.mark.parametrize("args,expected", [
    (["--async-rule", "latest"], "--async-rule applies to --mode gossip-async, not to this run (--mode gossip-sync); "
                                 "drop it or choose that mode"),
    (["--mode", "ps-sync", "--topology", "torus"], "--topology applies to the gossip modes (the ps-* modes talk to "
                                                   "the server), not to this run (--mode ps-sync)"),
    (["--mode", "ps-async", "--gossip-every", "4"], "--gossip-every applies to the gossip modes (ps-avg averages"),
    (["--mode", "gossip-async", "--max-staleness", "5"], "--max-staleness applies to --mode gossip-async "
                                                         "--async-rule latest"),
    (["--deadline-k", "5"], "--deadline-k applies to --deadline adaptive"),
    (["--consensus-step", "0.5"], "--consensus-step applies to --compress float16 or int8"),
    (["--trim-fraction", "0.1"], "--trim-fraction applies to --aggregate trimmed-mean"),
    (["--mode", "ps-sync", "--local-steps", "5"], "--local-steps applies to --mode ps-avg"),
    (["--mode", "ps-async", "--staleness-bound", "5"], "--staleness-bound applies to --mode ps-ssp"),
    (["--mode", "ps-ssp", "--dc-lambda", "0.1"], "--dc-lambda applies to --mode ps-dcasgd"),
    (["--missing-worker", "continue"], "--missing-worker applies to the ps-* modes"),
    (["--round-seconds", "2"], "--round-seconds applies to --schedule time"),
    (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
    (["--seed", "4294967296"], "--seed must be in 0..4294967295"),
    (["--nodes", "100000"], "--nodes 100000 needs 100001 ports from --base-port on, more than a host has (65535)"),
    (["--nodes", "3000", "--base-port", "64000"], "--base-port 64000 with --nodes 3000: the peers and the server "
                                                  "would listen up to port 67000, beyond 65535"),
    (["--task", "charlm", "--layers", "100000"], "--layers must be in 1..1024, got 100000"),
])
def test_a_flag_that_does_nothing_or_a_number_out_of_range_is_one_line_and_exit_2(args, expected, capsys, tmp_path):
    if "--base-port" not in args:
        args = [*args, "--base-port", str(free_base_port(4))]
    try:
        status = main([*args, "--out", str(tmp_path / "out")])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("gossip-launch: error: ") and expected in err[0], err[0]
    assert not (tmp_path / "out").exists()


def test_gossip_peer_refuses_the_same(capsys):
    assert peer_main(["--world-size", "2", "--async-rule", "latest"]) == 2
    assert "gossip-peer: error: --async-rule applies to --mode gossip-async" in capsys.readouterr().err
