"""Across a real network boundary: two hosts made of network namespaces joined by a 100 Mbit/s link
(``tests/netns.py``), each running peers bound to its own address. Skipped, with the reason, where
namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import pytest

from tests import netns
from tests.conftest import ROOT, alive, free_base_port, wait_until

REASON = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON)), pytest.mark.timeout(240)]


@pytest.fixture
def hosts(tmp_path):
    with netns.two_hosts(tmp_path) as made:
        yield made


def measure(hosts: netns.TwoHosts, address: str, size: int) -> float:
    return netns.throughput(hosts, address, size, free_base_port(1))


def test_the_limited_link_is_limited_and_the_other_is_not(hosts):
    limited = measure(hosts, hosts.wan[1], 8 << 20)
    unlimited = measure(hosts, hosts.lan[1], 64 << 20)
    assert limited < 0.5 * unlimited, (limited, unlimited)


def test_launcher_trains_across_the_limited_link(hosts, launch_run):
    sent_before = [hosts.tx_bytes(0, hosts.wan_devices[0]), hosts.tx_bytes(0, hosts.lan_devices[0])]
    run = launch_run("--hosts", f"{hosts.wan[0]}:2,{hosts.wan[1]}:2", "--remote-shell", str(hosts.shell),
                     "--steps", "150", nodes=4, timeout=200)
    summary = run.summary
    assert summary["mean_test_accuracy"] >= 0.9 and all(p["rounds"] == 150 for p in summary["peers"])
    peers = json.loads((run.out / "peers.json").read_text())
    assert [p["endpoint"].split(":")[1] for p in peers] == ["//" + hosts.wan[i // 2] for i in range(4)]
    ends = [next(e for e in run.events(r) if e["event"] == "end") for r in range(4)]
    assert all(set(e["routes"].values()) == {"tcp"} for e in ends), ends  # announced off loopback: TCP
    # On a ring, peers 0 and 1 (host 0) each send half of their bytes to a neighbour on host 1: all of it
    # went over the limited link, none over the other one
    crossed = (summary["peers"][0]["bytes_sent"] + summary["peers"][1]["bytes_sent"]) / 2
    wan, lan = (hosts.tx_bytes(0, d) - before for d, before in zip((hosts.wan_devices[0], hosts.lan_devices[0]),
                                                                    sent_before))
    assert wan >= crossed and lan < 0.01 * crossed, (wan, lan, crossed)


def test_peers_started_by_hand_on_two_hosts_join_with_the_line_the_first_prints(hosts, tmp_path):
    base, out = free_base_port(4) + 1, tmp_path / "run"  # the first peer's rendezvous store takes base - 1
    peer = [sys.executable, "-m", "launch.peer"]
    # a topology and speeds other than the defaults: the pasted line carries them, and a joiner, which checks
    # its flags before it knows the world size, must offer them as given (it offered the ring and no speeds)
    first = subprocess.Popen(hosts.exec(0, [*peer, "--world-size", "3", "--bind", hosts.wan[0], "--steps", "40",
                                            "--topology", "exponential", "--speeds", "1,1,0.5",
                                            "--base-port", str(base), "--out", str(out)]),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [first]
    try:
        line = next(text.strip() for text in first.stdout if text.strip().startswith("python -m launch.peer"))
        assert f"--initial-peers tcp://{hosts.wan[0]}:{base - 1}" in line
        assert "--topology exponential" in line and "--speeds 1.0,1.0,0.5" in line
        pasted = hosts.exec(1, [*peer, *shlex.split(line)[3:], "--out", str(out)])  # as a user pastes it
        procs += [subprocess.Popen(pasted, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for _ in range(2)]
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    endpoints = json.loads((out / "config.json").read_text())["gossip"]["network"]["endpoints"]
    # the joiners announce the address that routes to the first peer: their own end of the link
    assert endpoints == [f"tcp://{hosts.wan[0]}:{base}"] + [f"tcp://{hosts.wan[1]}:{base + r}" for r in (1, 2)]
    summary = subprocess.run([sys.executable, "-m", "launch.summary", str(out), "--no-plot"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    result = json.loads((out / "summary.json").read_text())
    assert [p["rounds"] for p in result["peers"]] == [40, 40, 40] and result["mean_test_accuracy"] >= 0.8


def test_ctrl_c_stops_peers_on_other_hosts(hosts, tmp_path):
    out = tmp_path / "interrupted"
    launcher = subprocess.Popen([sys.executable, "-m", "launch", "--hosts", f"{hosts.wan[0]}:1,{hosts.wan[1]}:1",
                                 "--remote-shell", str(hosts.shell), "--task", "tests.tasks:slow_digits",
                                 "--steps", "100000", "--out", str(out), "--progress", "plain",
                                 "--base-port", str(free_base_port(2))],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []

    def training() -> bool:
        pids[:] = training_pids(out, 2)  # (those started so far are killed below if the wait fails)
        return len(pids) == 2

    try:
        wait_until(training, 120, "both peers to start training")
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
        wait_until(lambda: not any(alive(pid) for pid in pids), 20, "the peers to stop after Ctrl-C")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == 130, stderr
    assert not any(alive(pid) for pid in pids), "a peer outlived the launcher"
    # the shell wrapper, like ssh, does not pass SIGTERM on: the peers stopped because their stdin closed
    assert all(json.loads((out / f"peer-{r}.jsonl").read_text().splitlines()[-1])["event"] == "stopped"
               for r in range(2))


def training_pids(out, nodes: int) -> list[int]:
    pids = []
    for rank in range(nodes):
        try:
            lines = [json.loads(line) for line in (out / f"peer-{rank}.jsonl").read_text().splitlines()]
        except (OSError, ValueError):
            continue
        if any(e["event"] == "step" for e in lines):
            pids.append(next(e["pid"] for e in lines if e["event"] == "start"))
    return pids
