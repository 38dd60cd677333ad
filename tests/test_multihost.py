"""Peers started the multi-host ways, here on loopback: as a fixed host list with one peer dying mid-run,
by ``gossip-launch --hosts`` with a parameter server, and by hand where test_netns.py cannot do that across
network namespaces. (torchrun is in test_torchrun.py.)"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.conftest import ROOT, free_base_port, wait_until

pytestmark = pytest.mark.timeout(180)


class Peers:
    """``python -m launch.peer`` processes, each with its output in a file; all killed at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> int:
        log = self.logs / f"{len(self.procs)}.log"
        with open(log, "wb") as file:
            proc = subprocess.Popen([sys.executable, "-m", "launch.peer", *argv], cwd=ROOT, stdout=file,
                                    stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs.append((proc, log))
        return len(self.procs) - 1

    def output(self, index: int) -> str:
        return self.procs[index][1].read_text()

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [proc.wait(max(0.1, deadline - time.monotonic())) for proc, _ in self.procs]

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def peers(tmp_path):
    started = Peers(tmp_path)
    yield started
    started.kill_all()


def wait_for_line(peers: Peers, index: int, prefix: str, timeout: float = 60) -> str:
    lines: list[str] = []

    def printed() -> bool:
        exited = peers.procs[index][0].poll() is not None  # (before reading: what it printed before exiting counts)
        lines[:] = [line.strip() for line in peers.output(index).splitlines() if line.strip().startswith(prefix)]
        assert lines or not exited, peers.output(index)
        return bool(lines)

    wait_until(printed, timeout, lambda: f"a line starting {prefix!r}: {peers.output(index)}")
    return lines[0]


def events(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"peer-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.skipif(netns.unavailable() is None, reason="test_netns.py starts peers by hand across two "
                    "network namespaces")
def test_peers_started_by_hand_join_with_the_line_the_first_peer_prints(peers, tmp_path):
    out, base = tmp_path / "run", free_base_port(4) + 1  # the first peer's rendezvous store takes base - 1
    peers.start(["--world-size", "3", "--bind", "127.0.0.1", "--base-port", str(base), "--steps", "60",
                 "--topology", "exponential", "--speeds", "1,1,0.5", "--out", str(out)])  # (test_netns.py says why)
    line = wait_for_line(peers, 0, "python -m launch.peer")
    assert f"--initial-peers tcp://127.0.0.1:{base - 1}" in line and "--steps 60" in line
    for _ in range(2):
        peers.start([*shlex.split(line)[3:], "--out", str(out)])  # the printed line, as a user pastes it
    assert peers.wait_all(timeout=120) == [0, 0, 0], [peers.output(i) for i in range(3)]

    summary = subprocess.run([sys.executable, "-m", "launch.summary", str(out), "--no-plot"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    result = json.loads((out / "summary.json").read_text())
    assert [p["rank"] for p in result["peers"]] == [0, 1, 2] and all(p["rounds"] == 60 for p in result["peers"])
    assert result["mean_test_accuracy"] >= 0.8
    endpoints = json.loads((out / "config.json").read_text())["gossip"]["network"]["endpoints"]
    assert endpoints == [f"tcp://127.0.0.1:{base + r}" for r in range(3)]  # announced: the route to the store


def test_a_peer_that_dies_is_given_up_and_the_others_finish(peers, tmp_path):
    out, base = tmp_path / "run", free_base_port(3)
    common = ["--hosts", "127.0.0.1:3", "--base-port", str(base), "--task", "tests.tasks:dies", "--steps", "60",
              "--round-timeout", "2", "--peer-timeout", "1", "--out", str(out)]
    for rank in range(3):
        peers.start([*common, "--rank", str(rank)], env={"GOSSIP_TEST_DYING_RANKS": "1"})
    assert peers.wait_all(timeout=120) == [0, 3, 0], [peers.output(i) for i in range(3)]
    for rank in (0, 2):
        end = events(out, rank)[-1]
        assert end["event"] == "end" and end["step"] == 60 and end["dead_neighbours"] == [1]
        assert "peer 1 is dead" in peers.output(rank)
    steps_of_dead = [e["step"] for e in events(out, 1) if e["event"] == "step"]
    assert max(steps_of_dead) == 19


def test_launcher_hosts_with_a_parameter_server_on_the_first_host(launch_run):
    run = launch_run("--hosts", "127.0.0.1:2,127.0.0.2:1", "--mode", "ps-sync", "--steps", "40", nodes=3)
    listed = json.loads((run.out / "peers.json").read_text())
    assert [(p["rank"], p["host"], p["endpoint"].rsplit(":", 1)[0]) for p in listed] == [
        (0, "127.0.0.1", "tcp://127.0.0.1"), (1, "127.0.0.1", "tcp://127.0.0.1"), (2, "127.0.0.2", "tcp://127.0.0.2"),
        (3, "127.0.0.1", "tcp://127.0.0.1")]
    summary = run.summary
    assert summary["server"]["updates"] == 40 and all(p["steps"] == 40 for p in summary["peers"])


def test_gossip_async_takes_no_step_before_every_peer_is_up(peers, tmp_path):
    """The swarm's budget is shared, so a peer started late must not find it spent by the others. Ring of 4
    by hand: peer 0's neighbours 1 and 3 are up while peer 2 is not yet started; peer 0 alone would have
    its hellos and could spend all 4 x 200 steps (1 s at 5 ms a step) while peer 2 is still starting. It
    waits until it knows every peer is up: no peer's first step comes before peer 2 started, and peer 2
    trains too."""
    out, base = tmp_path / "run", free_base_port(4)
    common = ["--hosts", "127.0.0.1:4", "--base-port", str(base), "--topology", "ring", "--mode", "gossip-async",
              "--steps", "200", "--compute-ms", "5", "--out", str(out)]
    for rank in (0, 1, 3):
        peers.start([*common, "--rank", str(rank)])
    wait_until(lambda: (out / "peer-0.jsonl").exists(), 60, "peer 0's start")
    time.sleep(3.0)  # ample for peer 0 to have run through the whole budget, had it not waited
    assert not any(e["event"] == "step" for e in events(out, 0))
    peers.start([*common, "--rank", "2"])
    assert peers.wait_all(timeout=120) == [0, 0, 0, 0], [peers.output(i) for i in range(4)]
    late = next(e["time"] for e in events(out, 2) if e["event"] == "start")
    for rank in range(4):
        steps = [e["time"] for e in events(out, rank) if e["event"] == "step"]
        assert steps and min(steps) > late, (rank, len(steps))
