"""The launcher's command line: every flag documented once, with its default, under its group, and one clear
line for bad input. (That the README and docs/ agree with the parsers: tests/test_docs.py.)"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections import Counter

import pytest

from launch.cli import build_parser, main
from launch.flags import AUTO_SWITCHES, CHOICES, FLAGS, GROUPS, PER_PEER_DEFAULTS, SWITCHES, config_from_args
from tests.conftest import ROOT, free_base_port

pytestmark = pytest.mark.timeout(60)


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


@pytest.fixture
def launch_here(capsys, monkeypatch):
    """``gossip-launch ARGS`` in this process: (exit status, stderr). Starting peers fails the test."""
    import launch.local

    def started(*_args, **_kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(launch.local, "supervise", started)

    def run(*args: str) -> tuple[int, str]:
        try:
            status = main(list(args))
        except SystemExit as exc:  # argparse's errors
            status = exc.code
        return status, capsys.readouterr().err

    return run


def test_help_shows_every_flag_with_its_default():
    parser = build_parser()
    help_text = parser.format_help()
    text = " ".join(help_text.split())  # argparse wraps lines
    squeezed = "".join(help_text.split())  # ... and may break them at a hyphen
    for row in FLAGS:
        assert row.flag in text, row.flag
        if row.name != "out" and row.name not in SWITCHES:
            default = parser.get_default(row.name)
            per_peer = isinstance(default, tuple)
            shown = ",".join(map(str, default)) or PER_PEER_DEFAULTS[row.name] if per_peer \
                else AUTO_SWITCHES.get(row.name, str(default))
            if isinstance(default, bool) or row.name in AUTO_SWITCHES:
                usage = f"{row.flag}, --no-{row.flag[2:]}"
            elif row.name in CHOICES:
                usage = f"{row.flag} {{{','.join(CHOICES[row.name])}}}"
            else:
                usage = f"{row.flag} {row.name.upper()}"
            assert usage in text, usage
            assert f"(default:{shown})".replace(" ", "") in squeezed, (row.flag, shown)
    assert "--progress" in text and "runs/<date-time>" in text


def help_sections(help_text: str) -> list[tuple[str, list[str]]]:
    """(title, option strings listed under it) for each titled section of ``--help``, in order."""
    sections: list[tuple[str, list[str]]] = []
    for line in help_text.splitlines():
        if re.fullmatch(r"[a-z][a-z ]*:", line):
            sections.append((line[:-1], []))
        elif sections and re.match(r"  -", line):  # an option's line; its help may follow on the same line
            invocation = re.split(r"\s{2,}", line.strip())[0]
            sections[-1][1].extend(part.split()[0] for part in invocation.split(", "))
    return sections


def test_help_groups_the_flags_under_titles_in_order_and_lists_each_once():
    parser = build_parser()
    sections = help_sections(parser.format_help())
    assert [title for title, _ in sections if title in GROUPS] == list(GROUPS)
    listed = Counter(option for _, options in sections for option in options)
    assert set(listed) == set(parser._option_string_actions), set(listed) ^ set(parser._option_string_actions)
    assert all(count == 1 for count in listed.values()), [o for o, count in listed.items() if count > 1]
    group_of = {option: title for title, options in sections for option in options}
    for row in FLAGS:
        assert group_of[row.flag] == row.group, (row.flag, group_of[row.flag], row.group)
    assert [row.group for row in FLAGS] == sorted((row.group for row in FLAGS), key=GROUPS.index)  # one run each


def test_defaults_are_four_gossip_sync_peers_on_sgps_graph_training_digits():
    args = build_parser().parse_args([])
    assert (args.nodes, args.topology, args.overlap, args.mode, args.task) == (4, "auto", None, "gossip-sync", "digits")
    gossip = config_from_args(args).gossip
    assert (gossip.topology_spec, gossip.overlaps) == ("exponential", False)
    async_gossip = config_from_args(build_parser().parse_args(["--mode", "gossip-async"])).gossip
    assert (async_gossip.topology_spec, async_gossip.overlaps) == ("ring", True)


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
    (["--staleness-weight", "linear"], "--staleness-weight 'linear' is not valid; choose one of: none, inverse, exp"),
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
    (["--partners", "similar-speed", "--topology", "ring"],
     "--partners similar-speed: partner choice by speed applies to the random"),
    (["--link-mbit", "0,10"], "--link-mbit lists 2 values for 4 peers; give one per peer"),
    (["--link-mbit", "0,0,0,-1"], "--link-mbit must be rates in Mbit/s >= 0"),
    (["--link-latency-ms", "1,2,3"], "--link-latency-ms lists 3 values for 4 peers"),
    (["--mode", "ps-sync", "--schedule", "time", "--rounds", "5"],
     "--schedule time and --partners apply to the gossip modes"),
    (["--aggregate", "mode"], "--aggregate 'mode' is not valid; choose one of: mean, median, trimmed-mean, "
                              "norm-clip"),
    (["--aggregate", "median", "--deadline", "adaptive"], "push-sum masses assume a linear mean"),
    (["--byzantine", "1,x"], "is not a comma-separated list of integers"),
    (["--byzantine", "4"], "--byzantine must list peer ranks in 0..3, got 4"),
    (["--optimizer", "adam"], "--optimizer 'adam' is not valid; choose one of: sgd, adamw"),
    (["--lr", "fast"], "--lr must be a number or auto, got 'fast'"),
    (["--steps", "2.5"], "--steps must be an integer or auto, got '2.5'"),
    (["--lr-schedule", "step"], "--lr-schedule 'step' is not valid; choose one of: constant, cosine, linear"),
    (["--min-lr", "1"], "--min-lr must be in 0..--lr (0.05), got 1.0"),
    (["--warmup-steps", "-3"], "--warmup-steps must be >= 0, got -3"),
    (["--optimizer", "adamw", "--momentum", "0.5"], "--momentum is SGD's; AdamW's momentum is the first of --betas"),
    (["--betas", "0.9,1.5"], "--betas must be two numbers in [0, 1)"),
    (["--lr-schedule", "cosine", "--schedule", "time", "--rounds", "5"], "which --schedule time does not fix"),
    (["--partition", "dirichlet:0"], "--partition dirichlet:0: ALPHA must be > 0"),
    (["--partition", "dirichlet:0.001", "--nodes", "60"], "left a peer with fewer than 23 samples in 1000 draws"),
    (["--partition", "by-file"], "--partition by-file does not apply to --task digits; use iid or dirichlet:ALPHA"),
    (["--task", "charlm", "--partition", "dirichlet:1"], "does not apply to --task charlm; use iid or by-file"),
    (["--task", "charlm", "--partition", "by-file", "--nodes", "5000"], "at least one file per peer"),
    (["--task", "charlm", "--data", "/no/such/corpus"], "--data /no/such/corpus: no such file or folder"),
    (["--task", "charlm", "--model-dim", "100", "--heads", "3"], "--model-dim 100 must be a multiple of --heads 3"),
    (["--layers", "4"], "--layers applies to --task charlm, not --task digits"),
])
def test_bad_input_gives_one_clear_line_and_exit_2(args, expected, tmp_path, launch_here):
    status, stderr = launch_here(*args, "--out", str(tmp_path / "out"), "--base-port", str(free_base_port(8)))
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gossip-launch: error:") and expected in lines[0], lines[0]
    assert not (tmp_path / "out" / "peers.json").exists()


def test_a_port_in_use_is_reported_before_anything_starts(tmp_path, launch_here):
    base = free_base_port(4)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 2))
        holder.listen()
        status, stderr = launch_here("--out", str(tmp_path / "out"), "--base-port", str(base))
    assert status == 2
    assert stderr.strip() == (f"gossip-launch: error: port {base + 2} for peer 2 on 127.0.0.1 is unavailable "
                              "(Address already in use); choose another --base-port")


def test_an_output_directory_holding_a_run_is_not_overwritten(tmp_path):
    """The real command, end to end: ``python -m launch`` parses, checks and exits 2 with one line."""
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
