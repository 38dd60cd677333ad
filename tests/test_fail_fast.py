"""A run that cannot go on ends at once for every peer, with the true cause named: a peer whose weights
diverged, a model that differs on one rank, a peer that cannot listen (launcher, library, torchrun)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_base_port

TORCHRUN = Path(sys.executable).parent / "torchrun"
SCRIPT = str(ROOT / "tests" / "attach_script.py")


def last_error(run, rank: int) -> dict:
    return next(e for e in reversed(run.events(rank)) if e["event"] in ("error", "stopped"))


def diverged_at(message: str) -> tuple[int, int] | None:
    """(the peer that diverged, its step) as ``message`` names them, or None."""
    found = re.search(r"peer (\d+) diverged: .*(?:after|at) step (\d+)", message)
    return (int(found.group(1)), int(found.group(2))) if found else None


@pytest.mark.timeout(150)
def test_a_peer_whose_weights_diverge_stops_every_peer_within_two_rounds_naming_itself(launch_run):
    run = launch_run("--task", "tests.tasks:diverges_on_rank_2", "--steps", "100", expect_ok=False)
    assert run.returncode == 1
    assert diverged_at(run.stderr.strip().splitlines()[-1])[0] == 2, run.stderr[-2000:]
    step = diverged_at(last_error(run, 2)["message"])[1]
    for rank in range(4):
        error = last_error(run, rank)
        if error["event"] == "error":  # (the launcher may have stopped a peer first: "stopped")
            assert diverged_at(error["message"]) == (2, step), error
            assert error.get("rounds", 0) <= step + 2, (rank, error, step)  # (none: it was still starting)
    # every peer at once, as a user meets it: the same, whichever peer is named
    run = launch_run("--lr", "1e8", "--steps", "50", expect_ok=False, name="all")
    assert run.returncode == 1 and diverged_at(run.stderr.strip().splitlines()[-1]), run.stderr[-2000:]
    for rank in range(4):
        error = last_error(run, rank)
        if error["event"] == "error":
            assert error.get("rounds", 0) <= diverged_at(error["message"])[1] + 2, error


@pytest.mark.timeout(120)
def test_a_model_that_differs_on_one_rank_fails_every_peer_within_a_round(launch_run):
    run = launch_run("--task", "tests.tasks:wider_on_rank_1", "--steps", "50", expect_ok=False)
    assert run.returncode == 1
    line = run.stderr.strip().splitlines()[-1]
    fingerprints = re.search(r"the peers' models differ: peer (\d)'s has layout ([0-9a-f]{16}), peer (\d)'s "
                             r"([0-9a-f]{16}); every peer must build the same model", line)
    assert fingerprints and "1" in (fingerprints.group(1), fingerprints.group(3)), line
    assert fingerprints.group(2) != fingerprints.group(4)
    for rank in range(4):
        error = last_error(run, rank)
        assert error.get("rounds", 0) <= 1, (rank, error)


def hold_port(port: int) -> socket.socket:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


def finish(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Each process's (exit status, stdout, stderr); every one is killed after ``timeout`` seconds."""
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return results


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


@pytest.mark.timeout(120)
def test_a_taken_port_in_the_library_stops_every_peer_within_seconds_naming_it():
    base = free_base_port(3)
    with hold_port(base + 1):
        began = time.monotonic()
        peers = [subprocess.Popen([sys.executable, SCRIPT, str(base), "10", str(rank), "3"], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(3)]
        results = finish(peers, timeout=60)
        elapsed = time.monotonic() - began
    assert [code for code, _, _ in results] == [1, 1, 1], results
    assert elapsed < 10, elapsed
    for code, _, err in results:
        line = last_line(err)
        assert f"peer 1 cannot listen on tcp://127.0.0.1:{base + 1}" in line, line
        assert "choose another base_port" in line and "--base-port" not in line, line


needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"torchrun is not installed beside {sys.executable}")


def torchrun(nproc: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), SCRIPT, *args],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})


@needs_torchrun
@pytest.mark.timeout(150)
def test_under_torchrun_attach_finds_its_peers_and_they_average():
    """No rank, world size or endpoint in the program: three processes under torchrun form the default graph,
    SGP's exponential one of three (each round W = (I + P) / 2, P the shift by 1, then by 2), and the weights
    0, 1 and 2 meet at their mean: two rounds multiply every deviation from it by (I + P)(I + P^-1) / 4 =
    (I + 3J) / 4, a quarter, so after 12 rounds the weights are exactly 1 - 2^-12, 1 and 1 + 2^-12."""
    [(code, out, err)] = finish([torchrun(3, str(free_base_port(3)), "12")], timeout=120)
    assert code == 0, err[-3000:]
    reports = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2], out
    for report in reports:
        assert report["world_size"] == 3 and report["rounds"] == 12, report
        assert report["weight"] == 1.0 + (report["rank"] - 1) * 2.0 ** -12, report
    assert "trains alone" not in err


@needs_torchrun
@pytest.mark.timeout(150)
def test_under_torchrun_a_taken_port_stops_every_peer_within_seconds_naming_it():
    base = free_base_port(3)
    with hold_port(base + 2):
        began = time.monotonic()
        [(code, _, err)] = finish([torchrun(3, str(base), "10")], timeout=120)
        elapsed = time.monotonic() - began
    assert code != 0
    assert elapsed < 10, elapsed
    failures = re.findall(r"gossip\.errors\.\w+: (.*)", err)
    assert len(failures) == 3, err[-3000:]
    assert all(f"peer 2 cannot listen on tcp://127.0.0.1:{base + 2}" in f for f in failures), failures
