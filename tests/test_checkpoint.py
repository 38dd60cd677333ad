"""Checkpoints survive a crash in the middle of a write, and a full disk costs the new one only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gossip import checkpoint
from gossip.errors import CheckpointError
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)

WRITER = """
import sys, torch
from gossip import checkpoint
path = sys.argv[1]
version = 0
while True:
    version += 1
    checkpoint.save({"version": version, "weights": torch.full((1_000_000,), float(version))}, path)
    print(version, flush=True)
"""


def test_killing_a_writer_mid_write_leaves_a_loadable_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    for delay in (0.0, 0.05, 0.13):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
        try:
            writer.stdout.readline()  # at least one checkpoint is complete
            time.sleep(delay)  # then kill it at some point of a later write
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
        finally:
            if writer.poll() is None:
                writer.kill()
        state = checkpoint.load(path)
        assert state["version"] >= 1
        assert torch.equal(state["weights"], torch.full((1_000_000,), float(state["version"])))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "checkpoint.pt"]
    assert set(leftovers) <= {".checkpoint.pt.tmp"}  # at most the torn temporary, never read


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a 2 MiB tmpfs")
    try:
        path = mount / "checkpoint.pt"
        checkpoint.save({"version": 1, "weights": torch.zeros(1000)}, path)
        with pytest.raises(CheckpointError, match="not written .*the previous one is kept"):
            checkpoint.save({"version": 2, "weights": torch.zeros(1_000_000)}, path)  # 4 MB > 2 MiB
        assert checkpoint.load(path)["version"] == 1
        assert sorted(p.name for p in mount.iterdir()) == ["checkpoint.pt"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_an_unreadable_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(tmp_path / "bad.pt")
