"""The event log: strict JSON lines whatever a peer logs (a NaN loss, an infinite weight), read back by the
launcher's readers; a diverged model still fails the run through the health check, not through the log."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gossip.config import GossipConfig, RunConfig
from gossip.errors import Diverged
from gossip.metrics import EventLog
from gossip.tasks import TaskContext, build_task
from launch.events import read_events
from launch.progress import PeerState, Progress
from launch.summary import peer_result, print_table, summarise


def strict(line: str) -> dict:
    """json.loads that refuses NaN and Infinity, as strict JSON readers (jq, JavaScript) do."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_non_finite_numbers_are_logged_as_null(tmp_path):
    log = EventLog(tmp_path / "peer-0.jsonl")
    log.write("eval", step=5, loss=math.nan, accuracy=0.1)
    log.write("end", weight=math.inf, test={"loss": -math.inf, "accuracy": 0.25}, speeds=[1.0, math.nan],
              pair=(math.nan, 2), numpy=np.float32("nan"), torch=torch.tensor(float("inf")), fine=np.float64(1.5))
    log.write("step", step=6, loss=0.5)  # the usual, finite case is untouched
    log.close()
    lines = [strict(line) for line in (tmp_path / "peer-0.jsonl").read_text().splitlines()]
    assert [e["event"] for e in lines] == ["eval", "end", "step"]
    assert lines[0]["loss"] is None and lines[0]["accuracy"] == 0.1
    end = lines[1]
    assert end["weight"] is None and end["test"] == {"loss": None, "accuracy": 0.25}
    assert end["speeds"] == [1.0, None] and end["pair"] == [None, 2]
    assert end["numpy"] is None and end["torch"] is None and end["fine"] == 1.5
    assert lines[2]["loss"] == 0.5


def test_the_readers_show_a_null_as_no_value(tmp_path, capsys):
    log = EventLog(tmp_path / "peer-0.jsonl")
    log.write("ready", endpoint="x")
    log.write("step", step=1, round=1, loss=math.nan, bytes_sent=10, speed=math.inf, wait_seconds=math.nan)
    log.write("eval", step=1, round=1, loss=math.nan, accuracy=math.nan)
    log.write("end", step=1, rounds=1, wait_seconds=math.inf, weight=math.nan, test={"loss": math.nan,
                                                                                   "accuracy": 0.5})
    log.close()
    events = read_events(tmp_path / "peer-0.jsonl")
    state = PeerState()
    for event in events:
        state.apply(event)
    assert state.loss is None and state.speed == 0.0 and state.wait_seconds == 0.0  # null keeps the last value
    progress = Progress(tmp_path, nodes=1, steps=1, mode="plain")
    progress.update()
    progress._table()  # the live table formats every cell
    peer = peer_result(0, events)
    assert peer["test_loss"] is None and peer["weight"] is None and peer["wait_seconds"] is None
    print_table({"mode": "gossip-sync", "topology": "ring", "nodes": 1, "task": "digits", "peers": [peer],
                 "accuracy": None, "mean_test_accuracy": None, "consensus_distance": 0.0, "byzantine": [],
                 "failed": [], "chronic_stragglers": {}, "wall_seconds": 1.0, "bytes_sent": 0}, tmp_path)
    assert "    -" in capsys.readouterr().out


def test_a_diverged_peer_logs_on_and_the_run_fails_through_the_health_check(tmp_path):
    """The peers' models went NaN: their logs hold the NaN loss and weight as null, and the summary
    refuses the averaged model with the health check's message (gossip/health.py)."""
    nodes, dim = 2, 8
    cfg = RunConfig(nodes=nodes, task="consensus", dim=dim, steps=4, gossip=GossipConfig.of(world_size=nodes))
    task = build_task("consensus", TaskContext(0, nodes, 0, dim=dim))
    state = {name: torch.full_like(value, math.nan) for name, value in task.model.state_dict().items()}
    for rank in range(nodes):
        log = EventLog(tmp_path / f"peer-{rank}.jsonl")
        log.write("ready", endpoint="x")
        log.write("step", step=4, round=4, loss=math.nan, bytes_sent=0, speed=1.0, wait_seconds=0.0)
        log.write("end", step=4, rounds=4, wall_seconds=1.0, weight=math.nan, test={"loss": math.nan})
        log.close()
        torch.save(state, tmp_path / f"model-{rank}.pt")
        np.savez(tmp_path / f"trace-{rank}.npz", rounds=np.array([4]), values=np.full((1, dim), np.nan),
                 index=np.arange(dim), weights=np.array([1.0]))
    with pytest.raises(Diverged, match="not a usable model: its weights hold NaN or Inf; lower --lr"):
        summarise(cfg, tmp_path, 1.0, plot=False)
