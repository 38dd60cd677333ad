"""End to end on the embedded default task: real peer processes train digits by gossip over loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from launch.summary import average_state_dicts
from tests.conftest import (
    ROOT,
    alive,
    free_base_port,
    granted_send_buffer,
    launcher_command,
    peer_pids,
    reap_peers,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)


def test_sync_ring_digits_trains_every_peer(launch_run):
    run = launch_run("--steps", "200", "--topology", "ring", nodes=4, plot=True)
    summary = run.summary
    accuracies = [p["test_accuracy"] for p in summary["peers"]]
    assert summary["mean_test_accuracy"] >= 0.90, accuracies
    assert max(accuracies) - min(accuracies) <= 0.02, accuracies
    assert summary["final_model"]["accuracy"] >= 0.90
    assert all(p["rounds"] == 200 and p["bytes_sent"] > 0 for p in summary["peers"])

    for name in ("peers.json", "summary.json", "summary.png", "model-final.pt", "config.json"):
        assert (run.out / name).stat().st_size > 0, name
    peers = json.loads((run.out / "peers.json").read_text())
    assert [p["rank"] for p in peers] == [0, 1, 2, 3]
    assert all(p["endpoint"].startswith("tcp://127.0.0.1:") for p in peers)

    states = [torch.load(run.out / f"model-{r}.pt", weights_only=True) for r in range(4)]
    final = torch.load(run.out / "model-final.pt", weights_only=True)
    for name, tensor in final.items():
        torch.testing.assert_close(tensor, sum(s[name] for s in states) / 4, rtol=0, atol=1e-6)
    product = average_state_dicts(states, [1.0 if p["weight"] is None else p["weight"] for p in summary["peers"]])
    assert product.keys() == final.keys()
    for name, tensor in final.items():  # model-final.pt is the launcher's average of these states, bit for bit
        assert torch.equal(tensor, product[name]), name

    ends = [next(e for e in run.events(r) if e["event"] == "end") for r in range(4)]
    # neighbours on loopback: the same-host Unix socket, not TCP
    assert [e["routes"] for e in ends] == [{str((r - 1) % 4): "ipc", str((r + 1) % 4): "ipc"} for r in range(4)]
    assert [p["routes"] for p in summary["peers"]] == [e["routes"] for e in ends]
    # each of them with the send buffer asked for, as far as the kernel allows (net.core.wmem_max, doubled)
    assert [e["send_buffers"] for e in ends] == [{j: granted_send_buffer() for j in e["routes"]} for e in ends]
    # every round is followed by an optimizer step, so overlap copied what it sent each round
    assert [e["snapshot_copies"] for e in ends] == [200] * 4

    steps = [e for e in run.events(1) if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 201))
    assert {"loss", "round", "bytes_sent", "bytes_received", "time", "wait_seconds"} <= steps[-1].keys()
    assert "mean test accuracy" in run.stdout and "consensus distance" in run.stdout
    assert "summary.png" in run.stdout


def test_sync_ring_digits_trains_without_overlap_over_tcp(launch_run):
    """--no-overlap: every peer sends its weights themselves (the 38 KB MLP goes below pyzmq's copy
    threshold, so ZeroMQ copies it) and mixes each round before training on. --no-ipc: over TCP loopback,
    as between hosts."""
    run = launch_run("--steps", "200", "--topology", "ring", "--no-overlap", "--no-ipc", nodes=4)
    accuracies = [p["test_accuracy"] for p in run.summary["peers"]]
    assert run.summary["mean_test_accuracy"] >= 0.90, accuracies
    assert max(accuracies) - min(accuracies) <= 0.02, accuracies
    ends = [next(e for e in run.events(r) if e["event"] == "end") for r in range(4)]
    assert all(e["rounds"] == 200 and e["relocated"] == 0 for e in ends), ends
    assert all(set(e["routes"].values()) == {"tcp"} and len(e["routes"]) == 2 for e in ends), ends
    assert "summary.png" not in run.stdout  # not plotted, so not listed among the results


def test_async_with_a_slow_peer_finishes_and_logs_staleness(launch_run):
    run = launch_run("--mode", "gossip-async", "--async-rule", "latest", "--speeds", "1,1,1,0.3", "--steps", "150",
                     "--compute-ms", "2", "--staleness-weight", "inverse", nodes=4)
    summary = run.summary
    steps = [p["steps"] for p in summary["peers"]]  # the swarm's 4 x 150: the slow peer does fewer
    assert 4 * 150 - 4 <= sum(steps) <= 4 * 150 + 16 and steps[3] < 150 < min(steps[:3]), steps
    histograms = [p["staleness"] for p in summary["peers"]]
    assert all(h for h in histograms), histograms  # every peer mixed something and logged its staleness
    # The slow peer's neighbours see its snapshots grow stale between its sends.
    assert max(int(tau) for tau in histograms[0]) >= 2
    logged = [e for e in run.events(0) if e["event"] == "step" and e.get("staleness")]
    assert logged, "step events carry the staleness histogram"
    # The slow peer mixed its neighbours' models up to its last step (it ends with them, not alone).
    last = [e for e in run.events(3) if e["event"] == "step" and e["mixed"]][-1]
    assert last["step"] == steps[3] and {"0", "2"} <= last["last_mix"].keys(), last
    assert next(e for e in run.events(3) if e["event"] == "end")["dead_neighbours"] == []
    assert summary["mean_test_accuracy"] >= 0.85


def test_the_command_of_the_readme_runs_as_users_start_it(tmp_path):
    """``python -m launch`` in a fresh interpreter, at every default but where its files and ports go (the
    other launcher tests fork theirs from a warmed process): it imports what it needs, trains, prints the
    whole summary (its output is flushed before it skips the interpreter's teardown) and exits 0."""
    out = tmp_path / "default"
    command = launcher_command(out, 4, progress="auto", plot=None)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=ROOT)
    reap_peers(out, grace=5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "gossip-sync" and summary["accuracy"] >= 0.92, summary["accuracy"]
    assert summary["topology"] == "exponential"  # (auto: SGP's graph for the plain lockstep mix)
    assert all(p["steps"] == 300 for p in summary["peers"])
    assert proc.stdout.endswith(f"results                  {out}/ (summary.json, summary.png, peer-<rank>.jsonl, "
                                "model-*.pt)\n"), proc.stdout[-500:]


def test_a_failing_peer_is_named_and_the_run_fails(launch_run):
    run = launch_run("--task", "tests.tasks:fails_on_rank_2", "--steps", "300", nodes=3, expect_ok=False)
    assert run.returncode == 1
    message = run.stderr.strip().splitlines()[-1]
    assert "peer 2 failed" in message and "simulated failure" in message, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("start_method,mode", [("fork", "gossip-sync"), ("exec", "gossip-sync"),
                                               ("fork", "gossip-async"), ("fork", "ps-sync"), ("fork", "ps-async")])
def test_ctrl_c_stops_every_process_cleanly(tmp_path, start_method, mode):
    out = tmp_path / "interrupted"
    command = launcher_command(out, 3, "--start-method", start_method, "--mode", mode, "--task",
                               "tests.tasks:slow_digits", "--steps", "100000", progress="plain", plot=None)
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _all_training(out, 3), 90, "every peer to start training")
        pids = peer_pids(out)
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        leftovers = reap_peers(out, grace=5)
    assert launcher.returncode == 130, stderr
    processes = 4 if mode.startswith("ps-") else 3
    assert f"stopping {processes} peers" in stderr and "Traceback" not in stderr
    assert len(pids) == processes and not leftovers and not any(alive(pid) for pid in pids)
    logs = [f"peer-{rank}.jsonl" for rank in range(3)] + (["server.jsonl"] if processes == 4 else [])
    for name in logs:
        last = json.loads((out / name).read_text().splitlines()[-1])
        assert last["event"] == "stopped" and last["message"] == "SIGTERM", (name, last)


def _all_training(out, nodes: int) -> bool:
    try:
        return all('"event": "step"' in (out / f"peer-{r}.jsonl").read_text() for r in range(nodes))
    except OSError:
        return False


def test_peer_process_exits_with_one_line_on_a_bad_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"nodes": 2, "steps": -1}))
    proc = subprocess.run([sys.executable, "-m", "gossip.peer", str(tmp_path / "config.json"), "--rank", "0"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["peer 0: --steps must be >= 1, got -1"]


def test_the_three_line_example_trains(tmp_path):
    proc = subprocess.run([sys.executable, "examples/ordinary_loop.py", "--world-size", "2", "--steps", "100",
                           "--base-port", str(free_base_port(2))], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("peer "))
    assert len(lines) == 2 and all("100 gossip rounds" in line for line in lines), proc.stdout
    assert all(float(line.split("accuracy ")[1].split()[0]) >= 0.85 for line in lines)
