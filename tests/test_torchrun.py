"""``torchrun ... -m launch.peer``: two torchrun agents with c10d rendezvous on 127.0.0.1 (as two machines
would run them) form one gossip swarm, exchanging endpoints through the agents' own store; and with
``--max-restarts 0`` the peers of one agent finish when the other agent's peer dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_base_port, wait_until

TORCHRUN = Path(sys.executable).parent / "torchrun"  # the one of this environment's torch
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif(not TORCHRUN.exists(), reason=f"torchrun is not installed beside {sys.executable}")]


def torchrun(rdzv_port: int, nproc: int, peer_args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--max-restarts", "0", "-m", "launch.peer", *peer_args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def stop(agents: list[subprocess.Popen]) -> None:
    for agent in agents:  # our own children; torchrun stops its workers when it is killed
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)


def last_event(out: Path, rank: int) -> dict:
    try:
        return json.loads((out / f"peer-{rank}.jsonl").read_text().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return {}


def test_two_torchrun_agents_form_one_gossip_swarm(tmp_path):
    out, base = tmp_path / "run", free_base_port(2)
    rdzv = free_base_port(1)
    agents = [torchrun(rdzv, 1, ["--steps", "80", "--base-port", str(base), "--out", str(out)]) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=150)[0] for agent in agents]
    finally:
        stop(agents)
    assert [a.returncode for a in agents] == [0, 0], outputs
    config = json.loads((out / "config.json").read_text())
    assert config["nodes"] == 2
    assert config["gossip"]["network"]["endpoints"] == [f"tcp://127.0.0.1:{base + r}" for r in (0, 1)]
    for rank in (0, 1):
        end = last_event(out, rank)
        assert end["event"] == "end" and end["rounds"] == 80 and end["bytes_received"] > 0
        assert end["test"]["accuracy"] >= 0.85
    assert not any("Traceback" in text for text in outputs), outputs


def test_with_max_restarts_0_the_other_agents_peers_finish_without_a_lost_one(tmp_path):
    """The agent that serves the c10d store (the first to start) must live: the others' agents need it. The
    second agent's peer dies in its 20th step; its agent stops and fails, and the first agent's two peers
    declare it dead after --peer-timeout and finish (c10d, not the start order, decides which ranks each
    agent's peers get). (torchrun then waits up to 300 s in its exit barrier for the
    failed agent, so the test ends the first agent itself once its peers are done.)"""
    out, base, rdzv = tmp_path / "run", free_base_port(3), free_base_port(1)
    peer_args = ["--task", "tests.tasks:dies", "--steps", "60", "--round-timeout", "2", "--peer-timeout", "1",
                 "--base-port", str(base), "--out", str(out)]

    def serving() -> bool:
        if port_open(rdzv):
            return True
        assert agents[0].poll() is None, "the first agent exited before serving its store"
        return False

    def two_ended() -> bool:
        if sum(last_event(out, r).get("event") == "end" for r in range(3)) >= 2:
            return True
        assert agents[0].poll() is None, agents[0].communicate()[0]
        return False

    agents = [torchrun(rdzv, 2, peer_args)]
    try:
        wait_until(serving, 60, "the first agent to serve its store")  # before the second one starts
        agents.append(torchrun(rdzv, 1, peer_args, env={"GOSSIP_TEST_DIE": "1"}))
        failed = agents[1].communicate(timeout=150)[0]
        wait_until(two_ended, 60, lambda: f"two peers to end: {[last_event(out, r) for r in range(3)]}")
    finally:
        stop(agents)
    assert agents[1].returncode != 0 and "exitcode  : 3" in failed, failed
    (dead,) = [r for r in range(3) if last_event(out, r).get("event") != "end"]  # c10d orders the agents
    steps = [e for e in map(json.loads, (out / f"peer-{dead}.jsonl").read_text().splitlines()) if e["event"] == "step"]
    assert max(e["step"] for e in steps) == 19
    for rank in sorted({0, 1, 2} - {dead}):
        end = last_event(out, rank)
        assert end["step"] == 60 and end["dead_neighbours"] == [dead] and end["test"]["accuracy"] >= 0.8


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True
