"""Checkpoints survive a crash in the middle of a write, a full disk costs the new one only, a state
with NaN or Inf is never written, the previous good checkpoint is kept beside the newest, and a checkpoint
that does not read or fit is rejected in one line before anything is loaded, with a fallback to the
previous one, then to the neighbours' models (a gossip peer) or one clear error (the parameter server)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gossip import checkpoint
from gossip.config import GossipConfig, RunConfig
from gossip.errors import CheckpointError
from gossip.metrics import EventLog
from gossip.peer import checkpoint_path, load_checkpoint, save_checkpoint, validate_checkpoint
from gossip.tasks import Task, TaskContext, build_task
from gossip.tasks.digits import make_task as make_digits
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
        # killed between its two renames, the newest is the .prev one: restore takes it
        state, used, rejected = checkpoint.restore(path, lambda state, file: None)
        assert rejected == [] and state["version"] >= 1
        assert torch.equal(state["weights"], torch.full((1_000_000,), float(state["version"])))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "checkpoint.pt"]
    assert set(leftovers) <= {".checkpoint.pt.tmp", "checkpoint.prev.pt"}  # the torn temporary is never read


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


def test_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint-0.pt"
    for version in (1, 2, 3):
        checkpoint.save({"version": version, "weights": torch.full((10,), float(version))}, path)
    assert checkpoint.load(path)["version"] == 3
    assert checkpoint.load(checkpoint.previous_path(path))["version"] == 2
    assert checkpoint.previous_path(path).name == "checkpoint-0.prev.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0.prev.pt", "checkpoint-0.pt"]


# -- a real peer's checkpoints (the digits task, its save and load path in gossip/peer.py) -----------------

def digits(rank: int = 0) -> Task:
    return build_task("digits", TaskContext(rank, 2, seed=0))


def trained(steps: int = 3) -> Task:
    task = digits()
    for _ in range(steps):  # momentum buffers exist only after a step
        task.train_step()
    return task


def averager(step: int, weight: float = 1.0, rank: int = 0) -> SimpleNamespace:
    """What ``save_checkpoint`` reads of an averager."""
    fake = SimpleNamespace(rank=rank, local_step=step, rounds=step, samples=32 * step, weight=weight)
    fake.state_dict = lambda: {"step": fake.local_step, "rounds": fake.rounds, "samples": fake.samples,
                               "weight": fake.weight, "found": True}
    return fake


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def damage_model_weight(task: Task) -> None:
    with torch.no_grad():
        next(task.model.parameters())[0] = float("nan")


def damage_momentum(task: Task) -> None:
    buffer = next(iter(task.optimizer.state.values()))["momentum_buffer"]
    buffer.view(-1)[0] = float("inf")


@pytest.mark.parametrize("damage,counter,reason", [
    (damage_model_weight, {}, r"^'model'\['.*'\] holds NaN or Inf$"),
    (damage_momentum, {}, r"^'optimizer'\['state'\]\[0\]\['momentum_buffer'\] holds NaN or Inf$"),
    (None, {"weight": float("nan")}, r"^counter 'counters.weight' is nan \(a float\), not a finite number > 0$"),
    (None, {"weight": 0.0}, r"^counter 'counters.weight' is 0.0 \(a float\), not a finite number > 0$"),
    (None, {"local_step": -1}, r"^counter 'counters.step' is -1 \(a int\), not a non-negative integer$"),
])
def test_a_state_with_nan_or_a_bad_counter_is_not_written_and_the_previous_stays(tmp_path, damage, counter,
                                                                                 reason):
    task, events = trained(), EventLog(tmp_path / "peer-0.jsonl")
    save_checkpoint(tmp_path, task, averager(10), events)
    good = {k: v.clone() for k, v in task.model.state_dict().items()}
    task.train_step()
    save_checkpoint(tmp_path, task, averager(20), events)
    if damage is not None:
        damage(task)
    bad = averager(30)
    for name, value in counter.items():
        setattr(bad, name, value)
    save_checkpoint(tmp_path, task, bad, events)  # refused: no exception, training would go on
    events.close()
    skipped = [e for e in read_events(tmp_path / "peer-0.jsonl") if e["event"] == "checkpoint-skipped"]
    assert len(skipped) == 1 and skipped[0]["step"] == bad.local_step
    assert re.search(reason, skipped[0]["reason"]), skipped[0]["reason"]
    # the newest is still step 20's and the previous step 10's; both load through the peer's path
    fresh, log = digits(), EventLog(tmp_path / "resume.jsonl")
    assert load_checkpoint(tmp_path, 0, fresh, log)["step"] == 20
    os.replace(checkpoint_path(tmp_path, 0), tmp_path / "elsewhere.pt")
    assert load_checkpoint(tmp_path, 0, fresh, log)["step"] == 10
    assert all(torch.equal(fresh.model.state_dict()[k], good[k]) for k in good)
    log.close()


def saved_state(tmp_path: Path) -> dict:
    task = trained()
    events = EventLog(tmp_path / "peer-0.jsonl")
    save_checkpoint(tmp_path, task, averager(20), events)
    events.close()
    return checkpoint.load(checkpoint_path(tmp_path, 0))


def wrong_shape(state: dict) -> None:
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(3, 5)


def missing_counter(state: dict) -> None:
    del state["counters"]["rounds"]


def string_counter(state: dict) -> None:
    state["counters"]["step"] = "20"


def nan_in_optimizer(state: dict) -> None:
    next(iter(state["optimizer"]["state"].values()))["momentum_buffer"].view(-1)[0] = float("nan")


def unknown_key(state: dict) -> None:
    state["model"]["extra.weight"] = torch.zeros(1)


def wrong_dtype(state: dict) -> None:
    name = next(iter(state["model"]))
    state["model"][name] = state["model"][name].double()


def momentum_of_another_shape(state: dict) -> None:
    entry = next(iter(state["optimizer"]["state"].values()))
    entry["momentum_buffer"] = torch.zeros(7, 7)


def no_model(state: dict) -> None:
    del state["model"]


def step_beyond_the_run(state: dict) -> None:
    state["counters"]["step"] = 10 ** 30


def unknown_top_level_key(state: dict) -> None:
    state["payload"] = {"anything": 1}


def one_value_claiming_a_billion(state: dict) -> None:
    # a few bytes in the file, 1e9 elements to check: an hour of --resume with 1e13
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(1).expand(1_000_000_000)


@pytest.mark.parametrize("damage,expected", [
    (wrong_shape, r"'model'\['.*'\] is \(3, 5\) float32, the model's is \(\d+, \d+\) float32"),
    (missing_counter, r"counter 'counters.rounds' is missing"),
    (string_counter, r"counter 'counters.step' is '20' \(a str\), not a non-negative integer"),
    (nan_in_optimizer, r"'optimizer'\['state'\]\[0\]\['momentum_buffer'\] holds NaN or Inf"),
    (unknown_key, r"'model' does not fit the model: it has unknown 'extra.weight'"),
    (wrong_dtype, r"'model'\['.*'\] is \(\d+, \d+\) float64, the model's is \(\d+, \d+\) float32"),
    (momentum_of_another_shape, r"'optimizer' state 'momentum_buffer' of parameter 0 has shape \(7, 7\), "
                                r"the parameter's is \(\d+, \d+\)"),
    (no_model, r"it lacks 'model'"),
    (step_beyond_the_run, r"counter 'counters.step' is 10+ \(a int\), above this run's 400"),
    (unknown_top_level_key, r"it has unknown 'payload' \(a checkpoint of something else\)"),
    (one_value_claiming_a_billion, r"'model'\['.*'\] claims 1,000,000,000 elements over 4 bytes of storage"),
])
def test_a_checkpoint_that_does_not_fit_is_one_line_naming_the_file(tmp_path, damage, expected):
    state = saved_state(tmp_path)
    damage(state)
    path = tmp_path / "checkpoint-0.pt"
    with pytest.raises(CheckpointError, match=f"^checkpoint {path} is unusable: {expected}") as info:
        validate_checkpoint(state, path, digits(), bounds={"counters.step": 400})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "nan", "shape"])
def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_bad(tmp_path, damage):
    task, events = trained(), EventLog(tmp_path / "peer-0.jsonl")
    save_checkpoint(tmp_path, task, averager(10, weight=0.75), events)
    good = {k: v.clone() for k, v in task.model.state_dict().items()}
    momentum = {k: v["momentum_buffer"].clone() for k, v in task.optimizer.state_dict()["state"].items()}
    task.train_step()
    save_checkpoint(tmp_path, task, averager(20), events)
    newest = checkpoint_path(tmp_path, 0)
    if damage == "garbage":  # torn or overwritten on disk
        newest.write_bytes(b"\0" * 100)
    else:  # readable, but NaN or another model's shapes
        state = checkpoint.load(newest)
        name = next(iter(state["model"]))
        state["model"][name] = state["model"][name].fill_(float("nan")) if damage == "nan" else torch.zeros(2)
        torch.save(state, newest)
    fresh = digits()
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    resumed = load_checkpoint(tmp_path, 0, fresh, events)
    events.close()
    assert resumed == {"found": True, "step": 10, "rounds": 10, "samples": 320, "weight": 0.75}
    assert all(torch.equal(fresh.model.state_dict()[k], good[k]) for k in good)
    assert not all(torch.equal(before[k], good[k]) for k in good)
    restored = fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(restored[k]["momentum_buffer"], momentum[k]) for k in momentum)
    log = read_events(tmp_path / "peer-0.jsonl")
    rejected = [e["message"] for e in log if e["event"] == "checkpoint-rejected"]
    assert len(rejected) == 1 and str(newest) in rejected[0] and "renamed to checkpoint-0.bad.pt" in rejected[0]
    assert ("cannot read checkpoint" if damage == "garbage" else "is unusable") in rejected[0]
    resume = [e for e in log if e["event"] == "resume"][0]
    assert resume["found"] and resume["file"].endswith("checkpoint-0.prev.pt")
    # the bad one was set aside: the next checkpoint rotates the good step-10 one into .prev, not the bad one
    events = EventLog(tmp_path / "peer-0.jsonl")
    save_checkpoint(tmp_path, fresh, averager(30), events)
    events.close()
    assert checkpoint.load(checkpoint.previous_path(newest))["counters"]["step"] == 10
    assert (tmp_path / "checkpoint-0.bad.pt").exists()


def test_resume_with_both_checkpoints_bad_starts_without_one(tmp_path):
    (tmp_path / "checkpoint-0.pt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}, "counters": {"step": 1}}, tmp_path / "checkpoint-0.prev.pt")  # lacks 'optimizer'
    task, events = digits(), EventLog(tmp_path / "peer-0.jsonl")
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    assert load_checkpoint(tmp_path, 0, task, events) == {"found": False}  # the neighbours' models, then
    events.close()
    assert all(torch.equal(task.model.state_dict()[k], before[k]) for k in before)
    log = read_events(tmp_path / "peer-0.jsonl")
    assert [e["message"].split(":")[0] for e in log if e["event"] == "checkpoint-rejected"] == [
        f"cannot read checkpoint {tmp_path / 'checkpoint-0.pt'}",
        f"checkpoint {tmp_path / 'checkpoint-0.prev.pt'} is unusable"]
    assert [e for e in log if e["event"] == "resume"][0]["found"] is False


# -- the parameter server, in-process (no sockets are opened before serve()) ------------------------------

def server_config(mode: str = "ps-async") -> RunConfig:
    return RunConfig(nodes=2, gossip=GossipConfig.of(world_size=2, mode=mode), checkpoint_every=1).for_rank(0)


def test_the_parameter_server_falls_back_to_its_previous_checkpoint_or_fails_in_one_line(tmp_path):
    from gossip.coordinator.server import ParameterServer, run_server

    cfg = server_config("ps-dcasgd")
    server = ParameterServer(cfg, tmp_path, EventLog(tmp_path / "server.jsonl"))
    try:
        for version in (10, 20):
            server.core.version = version
            server.save_checkpoint()
    finally:
        server.close(finish=False)
    path = tmp_path / "checkpoint-server.pt"
    state = checkpoint.load(path)
    state["core"]["clocks"] = [0, "1"]
    torch.save(state, path)
    again = ParameterServer(cfg, tmp_path, EventLog(tmp_path / "server.jsonl"))
    try:
        again.resume()
    finally:
        again.close(finish=False)
    assert again.core.version == 10
    # both bad: no neighbours to take a model from, so one line naming each file, no traceback
    (tmp_path / "checkpoint-server.pt").write_bytes(b"garbage")
    state = checkpoint.load(tmp_path / "checkpoint-server.prev.pt")
    state["core"]["update"]["compensation"]["backups"] = {0: [torch.zeros(1)]}
    torch.save(state, tmp_path / "checkpoint-server.prev.pt")
    with pytest.raises(CheckpointError) as info:
        run_server(cfg, tmp_path, resume=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith("the parameter server cannot resume: cannot read checkpoint ")
    assert f"checkpoint {tmp_path / 'checkpoint-server.prev.pt'} is unusable: the DC-ASGD backup of worker 0" in message


# -- one real run: a peer restarted with --resume whose two checkpoints are both bad ----------------------

DAMAGE_DIR, DAMAGE = "GOSSIP_TEST_DAMAGE_DIR", "GOSSIP_TEST_DAMAGE"


def damages_its_checkpoints_then_dies(ctx: TaskContext) -> Task:
    """Digits; peer 1, in its 25th step (after its checkpoints of steps 10 and 20), damages both checkpoints
    as GOSSIP_TEST_DAMAGE says, then exits abruptly, once: "garbage-nan" overwrites the newest with
    garbage and gives the previous one NaN weights; "hostile" gives the newest a tensor of a billion
    elements over one float of storage (stride 0) and the previous one a key no checkpoint has."""
    task = make_digits(ctx)
    out = Path(os.environ[DAMAGE_DIR])
    if ctx.rank != 1 or (out / "damaged").exists():
        return task
    steps, inner = 0, task.loss

    def loss() -> torch.Tensor:
        nonlocal steps
        steps += 1
        if steps == 25:
            newest = torch.load(out / "checkpoint-1.pt", weights_only=True)
            state = torch.load(out / "checkpoint-1.prev.pt", weights_only=True)
            if os.environ[DAMAGE] == "hostile":
                one_value_claiming_a_billion(newest)
                torch.save(newest, out / "checkpoint-1.pt")
                unknown_top_level_key(state)
            else:
                (out / "checkpoint-1.pt").write_bytes(b"garbage")
                for tensor in state["model"].values():
                    tensor.fill_(float("nan"))
            torch.save(state, out / "checkpoint-1.prev.pt")
            (out / "damaged").touch()
            os._exit(9)
        return inner()

    task.loss = loss
    return task


@pytest.mark.parametrize("damage,newest,previous", [
    ("garbage-nan", "cannot read checkpoint {newest}", "checkpoint {previous} is unusable: 'model'[*] holds NaN or Inf"),
    ("hostile", "checkpoint {newest} is unusable: 'model'[*] claims 1,000,000,000 elements over 4 bytes of storage",
     "checkpoint {previous} is unusable: it has unknown 'payload' (a checkpoint of something else)"),
])
def test_a_peer_resumed_from_two_bad_checkpoints_rejoins_with_its_neighbours_models(launch_run, tmp_path,
                                                                                  monkeypatch, damage, newest,
                                                                                  previous):
    monkeypatch.setenv(DAMAGE_DIR, str(tmp_path / "run"))
    monkeypatch.setenv(DAMAGE, damage)
    run = launch_run("--steps", "100", "--compute-ms", "10", "--checkpoint-every", "10", "--max-restarts", "1",
                     "--task", "tests.test_checkpoint:damages_its_checkpoints_then_dies", nodes=3, timeout=100)
    assert "peer 1 failed (exit 9)" in run.stderr and "restarted it with --resume (1 of 1)" in run.stderr
    log = run.events(1)
    rejected = [e["message"] for e in log if e["event"] == "checkpoint-rejected"]
    assert len(rejected) == 2, rejected
    paths = {"newest": run.out / "checkpoint-1.pt", "previous": run.out / "checkpoint-1.prev.pt"}
    for message, expected in zip(rejected, (newest, previous), strict=True):
        head, _, tail = expected.format(**paths).partition("*")
        assert message.startswith(head) and tail in message, (message, expected)
    assert [e["found"] for e in log if e["event"] == "resume"] == [False]
    assert "Traceback" not in (run.out / "peer-1.log").read_text()
    ends = [e for rank in range(3) for e in run.events(rank) if e["event"] == "end"]
    assert len(ends) == 3 and all(e["step"] == 100 for e in ends)
    assert min(e["test"]["accuracy"] for e in ends) >= 0.8
