"""Processes that die mid-run: the run goes on, and a restarted process picks up where it left off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from launch.events import read_events
from tests.conftest import ROOT, reap_peers, start_launcher, wait_until
from tests.launcher import Launched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_to_end(launcher: Launched, out, action=lambda: None, timeout: float = 240) -> tuple[str, str]:
    """Do ``action`` (a fault) during the run, then wait for the launcher; kill whatever is left after."""
    try:
        action()
        return launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reap_peers(out, grace=5)


def kill_server_after(out, version: int) -> None:
    """SIGKILL the parameter server (the last process in peers.json) once it logged the update to ``version``."""
    wait_until(lambda: any(e["event"] == "update" and e["version"] >= version
                           for e in read_events(out / "server.jsonl")), 90, f"the server's update to version {version}")
    os.kill(json.loads((out / "peers.json").read_text())[-1]["pid"], signal.SIGKILL)


def test_a_killed_parameter_server_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    launcher = start_launcher(out, 3, "--mode", "ps-async", "--steps", "300", "--compute-ms", "10",
                              "--checkpoint-every", "20", "--max-restarts", "1", "--round-timeout", "3")

    # version 101's event is written only after version 100's checkpoint (the server works in order)
    stdout, stderr = run_to_end(launcher, out, lambda: kill_server_after(out, 101))
    assert launcher.returncode == 0, stderr[-3000:]
    assert "server failed (exit -9)" in stderr and "restarted it with --resume (1 of 1)" in stderr
    log = read_events(out / "server.jsonl")
    resumed = [e for e in log if e["event"] == "resume"]
    assert resumed and resumed[0]["found"] and resumed[0]["version"] >= 100  # from the last checkpoint
    assert resumed[0]["version"] % 20 == 0
    end = [e for e in log if e["event"] == "end"][-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_model"]["accuracy"] >= 0.85
    assert end["versions"] >= 300  # the run went on well past the crash
    rejoins = [e.get("rejoins", 0) for rank in range(3) for e in read_events(out / f"peer-{rank}.jsonl")
               if e["event"] == "end"]
    assert sum(rejoins) >= 1  # workers found the restarted server by saying hello again


def test_a_killed_diloco_server_resumes_with_its_outer_momentum(tmp_path):
    """ps-avg with outer Nesterov and int8 both ways: the server's checkpoint holds the outer momentum, and the
    restarted server loads it (past the checks that the optimizer state fits), sends the workers its public
    weights whole again, and trains on."""
    out = tmp_path / "run"
    launcher = start_launcher(out, 3, "--mode", "ps-avg", "--outer-optimizer", "nesterov", "--local-steps", "5",
                              "--compress", "int8",
                              "--steps", "300", "--compute-ms", "10", "--checkpoint-every", "5", "--max-restarts",
                              "1", "--round-timeout", "3")

    stdout, stderr = run_to_end(launcher, out, lambda: kill_server_after(out, 21))
    assert launcher.returncode == 0, stderr[-3000:]
    assert "restarted it with --resume (1 of 1)" in stderr
    resumed = [e for e in read_events(out / "server.jsonl") if e["event"] == "resume"]
    assert resumed and resumed[0]["found"] and resumed[0]["version"] >= 20 and resumed[0]["version"] % 5 == 0
    saved = torch.load(out / "checkpoint-server.pt", weights_only=True)["core"]["update"]["optimizer"]
    assert saved["state"] and all("momentum_buffer" in entry for entry in saved["state"].values())
    assert saved["param_groups"][0]["nesterov"] and saved["param_groups"][0]["momentum"] == 0.9
    assert json.loads((out / "summary.json").read_text())["final_model"]["accuracy"] >= 0.85


def test_a_worker_that_dies_in_ps_sync_is_named_after_the_timeout(tmp_path):
    out = tmp_path / "run"
    launcher = start_launcher(out, 3, "--mode", "ps-sync", "--steps", "2000", "--compute-ms", "5",
                              "--round-timeout", "2", "--task", "tests.tasks:worker_1_dies", "--keep-going")
    stdout, stderr = run_to_end(launcher, out, timeout=120)
    assert launcher.returncode == 1
    last = stderr.strip().splitlines()[-1]
    assert "server failed (exit 1)" in last and "heard nothing from worker(s) 1 for 2 s (--round-timeout)" in last


def test_ps_sync_can_go_on_without_a_dead_worker(tmp_path):
    out = tmp_path / "run"
    launcher = start_launcher(out, 3, "--mode", "ps-sync", "--steps", "200", "--compute-ms", "5",
                              "--round-timeout", "2", "--missing-worker", "continue", "--task",
                              "tests.tasks:worker_1_dies", "--keep-going")
    stdout, stderr = run_to_end(launcher, out, timeout=120)
    assert launcher.returncode == 0, stderr[-2000:]
    assert "peer 1 failed (exit 9)" in stderr and "going on without it (--keep-going)" in stderr
    server = read_events(out / "server.jsonl")
    assert [e["worker"] for e in server if e["event"] == "gone"] == [1]
    updates = [e for e in server if e["event"] == "update"]
    assert all(sorted(u["workers"]) == [0, 1, 2] for u in updates[:29])  # all three until it died
    assert all(sorted(u["workers"]) == [0, 2] for u in updates[30:])  # then the barrier is the two others
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == ["peer 1"] and summary["final_model"]["accuracy"] >= 0.85


def end_events(out, ranks) -> dict[int, dict]:
    return {r: next(e for e in read_events(out / f"peer-{r}.jsonl") if e["event"] == "end") for r in ranks}


def kill_peer_after(out, rank: int, steps: int) -> None:
    """SIGKILL peer ``rank`` once it has logged ``steps`` steps."""
    wait_until(lambda: sum(e["event"] == "step" for e in read_events(out / f"peer-{rank}.jsonl")) >= steps, 90,
               f"peer {rank}'s step {steps}")
    os.kill(json.loads((out / "peers.json").read_text())[rank]["pid"], signal.SIGKILL)


@pytest.mark.parametrize("mode", [
    "gossip-sync", "gossip-async", "gossip-async --async-rule latest", "gossip-sync --no-overlap"])
def test_a_killed_gossip_peer_is_restarted_from_its_checkpoint_and_rejoins(tmp_path, mode):
    out = tmp_path / "run"
    launcher = start_launcher(out, 6, "--mode", *mode.split(), "--steps", "400", "--compute-ms", "10",
                              "--checkpoint-every", "20", "--max-restarts", "1")
    stdout, stderr = run_to_end(launcher, out, lambda: kill_peer_after(out, 3, 150))
    assert launcher.returncode == 0, stderr[-3000:]
    assert "peer 3 failed (exit -9)" in stderr and "restarted it with --resume (1 of 1)" in stderr
    resumed = [e for e in read_events(out / "peer-3.jsonl") if e["event"] == "resume"]
    assert resumed and resumed[0]["found"] and resumed[0]["step"] >= 140 and resumed[0]["step"] % 20 == 0
    ready = [e for e in read_events(out / "peer-3.jsonl") if e["event"] == "ready"]
    assert ready[-1]["step"] >= resumed[0]["step"]  # it caught up with the others instead of lagging behind
    summary = json.loads((out / "summary.json").read_text())
    accuracy = {p["rank"]: p["test_accuracy"] for p in summary["peers"]}
    if mode == "gossip-async":  # push-sum: the run's model is the weighted average of the copies; the peer that
        # finishes last (often the restarted one) trains its last steps alone, so its own copy wanders more
        assert summary["accuracy"] >= 0.93, summary["accuracy"]
    else:  # lockstep or latest-snapshot mixing at every step: every copy is close to the others at the end
        assert min(accuracy.values()) >= 0.90, accuracy
        others = [accuracy[r] for r in range(6) if r != 3]
        assert abs(accuracy[3] - sum(others) / 5) <= 0.02, accuracy
    ends = end_events(out, range(6))
    assert ends[2]["readmitted"] >= 1 and ends[4]["readmitted"] >= 1  # its neighbours took it back
    steps = [e["step"] for e in ends.values()]  # the swarm's 6 x 400 (a restarted peer counts those it skipped)
    assert 6 * 400 - 6 <= sum(steps) <= 6 * 400 + 6 * 6 + 200, steps


@pytest.mark.parametrize("graph", [(), ("--topology", "exponential", "--no-overlap", "--speeds", "1,1,1,1,1,0.5",
                                         "--steps", "500")], ids=["ring", "exponential"])
def test_a_dead_peer_is_declared_dead_the_others_go_on_and_it_rejoins_later_by_hand(tmp_path, graph):
    """The slow path, in gossip-sync (its rejoin is the harder one: lockstep rounds): the neighbours
    declare the peer dead before it comes back. (gossip-async took the same path in RELIABILITY.md's run.)
    On the exponential graph (directed, a new neighbour each round) the others drift rounds apart while the
    peer is dead, and those it did not wait for re-admit it later, each in its own round: none may wait
    out --round-timeout for a round the returning peer skipped."""
    mode = "gossip-sync"
    out = tmp_path / "run"
    launcher = start_launcher(out, 6, "--mode", mode, "--steps", "800", "--compute-ms", "20", *graph,
                              "--checkpoint-every", "20", "--keep-going", "--peer-timeout", "1",
                              "--round-timeout", "30")
    again = None
    try:
        kill_peer_after(out, 3, 100)
        wait_until(lambda: "peer 3 is dead" in (out / "peer-2.log").read_text(), 60, "peer 2 to declare peer 3 dead")
        survivors = [e for e in read_events(out / "peer-2.jsonl") if e["event"] == "step"]
        again = subprocess.Popen([sys.executable, "-m", "gossip.peer", str(out / "config.json"), "--rank", "3",
                                  "--resume"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stdout, stderr = launcher.communicate(timeout=240)
        rejoined_output = again.communicate(timeout=120)[0]
    finally:
        for proc in (launcher, again):
            if proc is not None and proc.poll() is None:
                proc.kill()
        reap_peers(out, grace=5)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "peer 3 failed (exit -9)" in stderr and "going on without it (--keep-going)" in stderr
    assert again.returncode == 0, rejoined_output[-3000:]
    assert survivors[-1]["step"] < 800  # the others were still training when it came back
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == ["peer 3"]
    ends = end_events(out, range(6))
    assert ends[2]["deaths"] >= 1 and ends[4]["deaths"] >= 1  # its neighbours declared it dead ...
    assert ends[2]["readmitted"] >= 1 or ends[4]["readmitted"] >= 1  # ... and took it back when it returned
    others = [ends[r]["test"]["accuracy"] for r in range(6) if r != 3]
    assert min(others) >= 0.90, others
    assert abs(ends[3]["test"]["accuracy"] - sum(others) / 5) <= 0.02, (ends[3]["test"], others)
