"""End to end with real peer processes: charlm trains, every partition is recorded, and the learning rate
follows its schedule exactly, by step on every peer and by version on the parameter server; the charlm
example trains under torchrun."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gossip.config import RunConfig
from gossip.optim import Schedule, run_schedule
from gossip.tasks import build_task, context_for
from gossip.tasks.corpus import read_corpus
from tests.conftest import ROOT, free_base_port

pytestmark = pytest.mark.timeout(240)
TORCHRUN = Path(sys.executable).parent / "torchrun"


def test_charlm_trains_two_peers_on_their_own_files(launch_run):
    run = launch_run("--task", "charlm", "--steps", "60", "--eval-every", "30", "--partition", "by-file", nodes=2)
    summary = run.summary
    uniform = math.log(256)  # a model that predicts every byte alike; the untrained one is within 5% of it
    assert summary["headline"] == "loss" and summary["loss"] < 0.6 * uniform, summary["loss"]
    assert summary["final_model"]["bits_per_char"] == pytest.approx(summary["loss"] / math.log(2))
    assert "validation loss" in run.stdout and "nats" in run.stdout
    corpus = read_corpus()
    assert (summary["data"]["sha256"], summary["data"]["bytes"]) == (corpus.sha256, len(corpus.text))
    shards = [p["shard"] for p in summary["peers"]]
    assert sum(s["samples"] for s in shards) == summary["data"]["train_windows"]
    assert sum(s["files"] for s in shards) <= summary["data"]["files"] and min(s["files"] for s in shards) >= 1
    assert summary["partition"] == "by-file" and summary["optimizer"]["name"] == "adamw"
    assert summary["optimizer"]["second_moment_of"] == 2  # each peer's AdamW normalises for the mean of 2
    # each peer scheduled its own lr by its step: warm-up of 3 steps (5% of 60), cosine to a tenth
    schedule = Schedule("cosine", 60, 3, 0.1)
    for rank in range(2):
        steps = [e for e in run.events(rank) if e["event"] == "step"]
        assert [e["lr"] for e in steps] == pytest.approx([3e-3 * schedule.factor(e["step"]) for e in steps], rel=1e-12)


def test_gossip_syncs_default_mix_steps_swarm_adamw_and_averages_after_every_step(launch_run):
    """Two peers on the exponential graph without overlap (for two, the exact mean every round), at the
    defaults: the run's model is that of two SwarmAdamW workers computed here, each on its own shard and
    schedule, set to their mean after every step; PyTorch's AdamW in their place ends elsewhere."""
    steps = 12
    run = launch_run("--task", "charlm", "--steps", str(steps), "--eval-every", "0", nodes=2)
    cfg = RunConfig.from_dict(json.loads((run.out / "config.json").read_text()))
    assert run.summary["topology"] == "exponential" and run.summary["optimizer"]["second_moment_of"] == 2
    final = torch.load(run.out / "model-final.pt", weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as each peer computes)
    try:
        swarm = two_workers_averaged(cfg, steps)
        own = two_workers_averaged(cfg, steps, peers=1)
    finally:
        torch.set_num_threads(threads)
    for name, weights in final.items():
        torch.testing.assert_close(weights, swarm[name], rtol=0, atol=1e-6)
    assert max((final[n] - own[n]).abs().max().item() for n in final) > 1e-4


def two_workers_averaged(cfg: RunConfig, steps: int, peers: int = 2) -> dict[str, torch.Tensor]:
    schedule = run_schedule(cfg)
    tasks = []
    for rank in range(2):
        context = context_for(cfg, rank)
        tasks.append(build_task(cfg.task, dataclasses.replace(
            context, optimizer=dataclasses.replace(context.optimizer, peers=peers))))
    for step in range(1, steps + 1):
        for task in tasks:
            schedule.apply(task.optimizer, step)
            task.train_step()
        with torch.no_grad():
            for a, b in zip(tasks[0].model.parameters(), tasks[1].model.parameters()):
                mean = 0.5 * a + 0.5 * b
                a.copy_(mean)
                b.copy_(mean)
    return {name: t.detach().clone() for name, t in tasks[0].model.state_dict().items()}


@pytest.mark.parametrize("mode, flags, k", [
    ("ps-async", ["--lr-schedule", "cosine", "--warmup-steps", "5", "--min-lr", "0.005"], 3),
    ("ps-sync", ["--optimizer", "adamw", "--lr-schedule", "linear", "--warmup-steps", "4"], 1),
])
def test_the_servers_lr_follows_its_version_in_closed_form(launch_run, mode, flags, k):
    run = launch_run("--mode", mode, "--steps", "30", "--eval-every", "0", *flags, nodes=3)
    events = [json.loads(line) for line in (run.out / "server.jsonl").read_text().splitlines()]
    optimizer = next(e for e in events if e["event"] == "ready")["optimizer"]
    updates = [e for e in events if e["event"] == "update"]
    assert len(updates) == 30 * k == optimizer["total_versions"]  # k updates in flight: k versions per step
    schedule = Schedule(optimizer["schedule"], 30 * k, flags_value(flags, "--warmup-steps") * k,
                        optimizer["min_lr"] / optimizer["lr"])
    assert [e["lr"] for e in updates] == pytest.approx(
        [optimizer["lr"] * schedule.factor(e["version"]) for e in updates], rel=1e-12)
    assert updates[-1]["lr"] == pytest.approx(optimizer["min_lr"])


def flags_value(flags: list[str], flag: str) -> int:
    return int(flags[flags.index(flag) + 1])


@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"torchrun is not installed beside {sys.executable}")
def test_the_charlm_example_trains_under_torchrun():
    command = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "examples/charlm_torchrun.py", "--steps", "30",
               "--base-port", str(free_base_port(2))]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    reports = [line for line in proc.stdout.splitlines() if line.startswith("peer ")]
    assert sorted(r.split(":")[0] for r in reports) == ["peer 0", "peer 1"], proc.stdout
    losses = [float(r.split("validation loss ")[1].split()[0]) for r in reports]
    assert all(loss < 0.75 * math.log(256) for loss in losses) and "30 gossip rounds" in reports[0]
