"""A running peer under fire: 11,000 hostile messages of every kind while it trains."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, free_base_port, reap_peers
from tests.hostile import attack, victim_layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_peer_under_fire_keeps_training_and_counts_every_drop(tmp_path):
    out, nodes = tmp_path / "run", 4
    base = free_base_port(nodes)
    command = [sys.executable, "-m", "launch", "--nodes", str(nodes), "--steps", "400", "--compute-ms", "15",
               "--out", str(out), "--base-port", str(base), "--progress", "off", "--no-plot"]
    launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and '"round": 5' not in _read(out / "peer-0.jsonl"):
            time.sleep(0.1)
        sent = attack(f"tcp://127.0.0.1:{base}", victim_layout(world_size=nodes), nodes, count=11_000)
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reap_peers(out, grace=5)
    assert launcher.returncode == 0, stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    victim, bystander = summary["peers"][0], summary["peers"][1]
    dropped = victim["dropped"]
    assert sum(sent.values()) == 11_000
    assert sum(dropped.values()) >= 11_000, (dropped, dict(sent))
    for reason, count in sent.items():
        if reason != "header":  # random bytes may fail as a bad field instead of a bad header
            assert dropped.get(reason, 0) >= count, (reason, dropped, dict(sent))
    assert victim["test_accuracy"] >= 0.90 and summary["final_model"]["accuracy"] >= 0.90
    assert victim["max_rss_mb"] < 1.5 * bystander["max_rss_mb"]  # the flood did not pile up in memory
    assert bystander["dropped"] == {}


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
