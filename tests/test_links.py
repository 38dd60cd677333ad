"""Heterogeneous links: emulated latency in the transport, and per-peer rates through network namespaces
and tc tbf (root only; the run's namespaces must be gone afterwards)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from gossip.errors import ConfigError
from gossip.net.transport import Transport, TransportConfig
from launch import links
from tests.conftest import endpoints, wait_until

pytestmark = pytest.mark.timeout(120)
LINK_TOOLS = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")


def test_emulated_latency_holds_every_message_and_keeps_them_pipelined():
    eps = endpoints(2)
    arrivals = []
    receiver = Transport(0, eps[0], eps, lambda identity, frames, connection: arrivals.append(time.monotonic()))
    sender = Transport(1, eps[1], eps, lambda *a: None, TransportConfig(delays=(0.3, 0.0)))
    receiver.start()
    sender.start()
    try:
        posted = time.monotonic()
        for index in range(3):
            sender.post([0], [str(index).encode()], latest_only=False, timeout=5)
        wait_until(lambda: len(arrivals) >= 3, 10, "the 3 messages at the receiver")
        assert len(arrivals) == 3 and min(arrivals) >= posted + 0.3
        assert max(arrivals) - min(arrivals) < 0.3  # held together, not one delay after another
    finally:
        sender.close()
        receiver.close()


def test_link_emulation_needs_root(monkeypatch):
    monkeypatch.setattr(links.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="--link-mbit needs root"):
        links.check_link_support()
    monkeypatch.setattr(links.os, "geteuid", lambda: 0)
    monkeypatch.setattr(links.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(ConfigError, match=r"needs the tc command\(s\) \(package iproute2\)"):
        links.check_link_support()


@pytest.mark.skipif(not LINK_TOOLS, reason="--link-mbit needs root and the ip and tc commands")
def test_a_rate_limited_link_slows_exactly_its_peer_and_leaves_no_namespace(launch_run):
    rate_mbit, rounds, dim = 20.0, 4, 125_000  # one message: 1 MB of float64
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    run = launch_run("--task", "consensus", "--dim", str(dim), "--steps", str(rounds), "--topology", "ring",
                     "--link-mbit", f"0,0,{rate_mbit}", nodes=3)  # (a ring of 3 averages exactly in a round)
    peers = json.loads((run.out / "peers.json").read_text())
    assert [p["endpoint"].split(":")[1] for p in peers] == ["//10.77.0.1", "//10.77.0.2", "//10.77.0.3"]
    ends = [next(e for e in run.events(r) if e["event"] == "end") for r in range(3)]
    assert all(set(e["routes"].values()) == {"tcp"} for e in ends), ends  # no Unix socket past the veth links
    limited = ends[2]
    # Everything peer 2 received came through its token bucket: it cannot have been faster than the rate.
    assert limited["wall_seconds"] >= 0.9 * limited["bytes_received"] * 8 / (rate_mbit * 1e6)
    assert limited["bytes_received"] >= 2 * rounds * dim * 8
    assert run.summary["consensus_distance"] < 1e-6  # the slow link changed the pace, not the result
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert not {name for name in after - before if name.startswith("gossip")}  # ours are gone (others may come)
