"""A flag that does nothing in the chosen mode or task is refused with one line, and so is a number out of
range, before any process starts: in the launcher (``launch.cli.main`` in this process) and in
``gossip-peer``. One table, ``gossip.config.USED_ONLY_IN``, says where each mode- or task-specific flag
applies; ``launch.flags.READ_BY_EVERY_RUN`` lists the others, and every flag must be in one of the two."""

from __future__ import annotations

import dataclasses

import pytest

from gossip.config import GOSSIP_FIELDS, USED_ONLY_IN, CoordinatorConfig, GossipConfig, RunConfig
from launch.cli import main
from launch.flags import READ_BY_EVERY_RUN, TABLE
from launch.peer import main as peer_main
from tests.conftest import free_base_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def launch_here(capsys, monkeypatch, tmp_path):
    """``gossip-launch ARGS`` in this process: (exit status, stderr). Starting peers fails the test."""
    import launch.local

    def started(*_args, **_kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(launch.local, "supervise", started)

    def run(*args: str) -> tuple[int, str]:
        if "--base-port" not in args:
            args = (*args, "--base-port", str(free_base_port(8)))
        try:
            status = main([*args, "--out", str(tmp_path / "out")])
        except SystemExit as exc:  # argparse's errors
            status = exc.code
        assert not (tmp_path / "out").exists()
        return status, capsys.readouterr().err

    return run


def test_every_flag_is_either_read_by_every_run_or_says_where_it_applies():
    flags = {row.name for row in TABLE}
    specific = set(USED_ONLY_IN)
    assert not specific & READ_BY_EVERY_RUN, sorted(specific & READ_BY_EVERY_RUN)
    assert flags == specific | READ_BY_EVERY_RUN, (f"unclassified: {sorted(flags - specific - READ_BY_EVERY_RUN)}; "
                                                   f"no such flag: {sorted((specific | READ_BY_EVERY_RUN) - flags)}")


def test_every_condition_names_a_setting_of_the_run():
    fields = {f.name for cls in (RunConfig, CoordinatorConfig) for f in dataclasses.fields(cls)} | set(GOSSIP_FIELDS)
    assert {need.setting for needs in USED_ONLY_IN.values() for need in needs} <= fields
    assert set(USED_ONLY_IN) <= fields


@pytest.mark.parametrize("args,expected", [
    (["--async-rule", "latest"],
     "--async-rule applies to --mode gossip-async, not --mode gossip-sync; drop it or choose --mode gossip-async"),
    (["--mode", "ps-sync", "--topology", "torus"],
     "--topology applies to the gossip modes, not --mode ps-sync; drop it or choose --mode gossip-sync or "
     "gossip-async"),
    (["--mode", "ps-async", "--gossip-every", "4"], "--gossip-every applies to the gossip modes with --schedule "
                                                    "steps, not --mode ps-async"),
    (["--mode", "gossip-async", "--max-staleness", "5"],
     "--max-staleness applies to --mode gossip-async with --async-rule latest, not --async-rule push-sum; drop it "
     "or add --async-rule latest"),
    (["--max-staleness", "5"], "--max-staleness applies to --mode gossip-async with --async-rule latest, not --mode "
                               "gossip-sync; drop it or choose --mode gossip-async and add --async-rule latest"),
    (["--mode", "gossip-async", "--async-rule", "latest", "--staleness-temperature", "2"],
     "--staleness-temperature applies to --mode gossip-async with --async-rule latest and --staleness-weight exp, "
     "not --staleness-weight none"),
    (["--deadline-k", "5"], "--deadline-k applies to --deadline adaptive, not --deadline fixed; drop it or add "
                            "--deadline adaptive"),
    (["--pace-tolerance", "2"], "--pace-tolerance applies to --deadline adaptive, not --deadline fixed"),
    (["--consensus-step", "0.5"], "--consensus-step applies to --compress float16 or int8, not --compress none"),
    (["--trim-fraction", "0.1"], "--trim-fraction applies to --aggregate trimmed-mean, not --aggregate mean"),
    (["--byzantine-scale", "5"], "--byzantine-scale applies to --byzantine RANKS, not a run without --byzantine"),
    (["--mode", "ps-sync", "--nodes", "2", "--aggregate", "median"],
     "--aggregate applies to --nodes 3 or more, not --nodes 2; drop it or use --nodes 3 or more (one bad input of 3 "
     "is outvoted by two)"),
    (["--mode", "ps-async", "--nodes", "1", "--byzantine", "0"], "--byzantine applies to --nodes 2 or more, not "
                                                                 "--nodes 1"),
    (["--mode", "ps-async", "--aggregate", "median"], "--aggregate median combines the contributions of one version "
                                                      "coordinate-wise; --mode ps-async applies each gradient on its "
                                                      "own, which has no median: use --aggregate norm-clip"),
    (["--mode", "ps-avg", "--aggregate", "norm-clip"], "--aggregate norm-clip bounds the gradients a parameter server "
                                                       "applies, and its workers send weights: use --aggregate median "
                                                       "or trimmed-mean"),
    (["--round-seconds", "2"], "--round-seconds applies to --schedule time, not --schedule steps"),
    (["--mode", "ps-sync", "--local-steps", "5"], "--local-steps applies to --mode ps-avg, not --mode ps-sync"),
    (["--mode", "ps-async", "--staleness-bound", "5"], "--staleness-bound applies to --mode ps-ssp, not --mode "
                                                       "ps-async"),
    (["--mode", "ps-avg", "--staleness-lr"], "--staleness-lr applies to --mode ps-async, ps-ssp or ps-dcasgd, not "
                                             "--mode ps-avg"),
    (["--mode", "ps-sync", "--soft-sync", "2"], "--soft-sync applies to --mode ps-async, ps-ssp or ps-dcasgd"),
    (["--mode", "ps-ssp", "--dc-lambda", "0.1"], "--dc-lambda applies to --mode ps-dcasgd, not --mode ps-ssp"),
    (["--mode", "ps-dcasgd", "--dc-epsilon", "1e-5"], "--dc-epsilon applies to --mode ps-dcasgd with --dc-adaptive, "
                                                      "not a run without --dc-adaptive; drop it or add --dc-adaptive"),
    (["--missing-worker", "continue"], "--missing-worker applies to the ps-* modes, not --mode gossip-sync"),
    (["--server-retries", "9"], "--server-retries applies to the ps-* modes, not --mode gossip-sync"),
    (["--min-lr", "0.01"], "--min-lr applies to a task that trains with --lr-schedule cosine or linear, not "
                           "--lr-schedule constant; drop it or add --lr-schedule cosine or linear"),
    (["--task", "consensus", "--lr", "0.1"], "--lr applies to a task that trains, not --task consensus"),
    (["--task", "consensus", "--batch-size", "8"], "--batch-size applies to a task that trains, not --task consensus"),
    (["--dim", "10"], "--dim applies to --task consensus, not --task digits; drop it or choose --task consensus"),
    (["--task", "mnist", "--context", "32"], "--context applies to --task charlm, not --task mnist"),
])
def test_a_flag_that_does_nothing_here_is_one_line_and_exit_2(args, expected, launch_here):
    assert_one_line(launch_here, args, expected)


@pytest.mark.parametrize("args,expected", [
    (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
    (["--seed", "4294967296"], "--seed must be in 0..4294967295, got 4294967296"),
    (["--seed", "100000000000000000000000"], "--seed must be in 0..4294967295"),
    (["--seed", "1e23"], "argument --seed: invalid int value: '1e23'"),
    (["--nodes", "100000"], "--nodes 100000 needs 100001 ports from --base-port on, more than a host has (65535)"),
    (["--nodes", "3000", "--base-port", "64000"], "--base-port 64000 with --nodes 3000: the peers and the server "
                                                  "would listen up to port 67000, beyond 65535"),
    (["--task", "charlm", "--layers", "100000"], "--layers must be in 1..1024, got 100000"),
])
def test_a_number_out_of_range_is_one_line_and_exit_2(args, expected, launch_here):
    assert_one_line(launch_here, args, expected)


def assert_one_line(launch_here, args: list[str], expected: str) -> None:
    """``gossip-launch ARGS`` exits 2 with one line that says ``expected``, before any process starts."""
    status, stderr = launch_here(*args)
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("gossip-launch: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("fields", [
    {"task": "charlm", "lr_schedule": "constant"},  # its auto --min-lr (lr / 10) is no --min-lr given
    {"task": "tests.tasks:rank_value", "dim": 8, "layers": 3, "lr": 0.2},  # a user's task may read anything
    {"task": "consensus", "dim": 8},
    {"lr_schedule": "cosine", "min_lr": 0.01},
])
def test_a_setting_is_accepted_where_it_is_read(fields):
    RunConfig(**fields)


@pytest.mark.parametrize("gossip,coordinator", [
    ({"mode": "gossip-async", "async_rule": "latest", "staleness_weight": "exp", "staleness_temperature": 2.0,
      "max_staleness": 5}, {}),
    ({"deadline": "adaptive", "deadline_k": 5.0, "pace_tolerance": 1.0}, {}),
    ({"mode": "ps-dcasgd"}, {"dc_adaptive": True, "dc_momentum": 0.5, "dc_lambda": 1.0, "soft_sync": 2}),
    ({"mode": "ps-avg"}, {"local_steps": 3, "missing_worker": "continue"}),
])
def test_a_mode_specific_setting_is_accepted_in_its_mode(gossip, coordinator):
    RunConfig(gossip=GossipConfig.of(world_size=4, **gossip), coordinator=CoordinatorConfig(**coordinator))


def test_gossip_peer_refuses_the_same(capsys):
    assert peer_main(["--world-size", "2", "--async-rule", "latest"]) == 2
    assert capsys.readouterr().err == ("gossip-peer: error: --async-rule applies to --mode gossip-async, not --mode "
                                       "gossip-sync; drop it or choose --mode gossip-async\n")
