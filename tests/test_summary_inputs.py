"""The launcher's summary, fed files no honest run leaves: it writes summary.json naming what is wrong and
ends in one line, never a traceback. Pure: crafted and mangled copies of two real runs' files
(``tests/fixtures/outputs``, which says how they were made) go straight to the summary functions.

The two crashes reproduced first: a consensus run in which a restarted peer believed forged welcomes
naming round 400 and jumped from round 32 to 400, so that the peers' traces shared no round (an
``IndexError``); and a ps-sync run under ``--keep-going`` whose server took forged byes for its workers'
and ended after 36 of 450 updates, after which every worker failed (a ``ValueError``: no model to stack).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gossip.config import PS_MODES, RunConfig
from gossip.errors import GossipError
from launch.summary import summarise
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "outputs"


def copy_run(name: str, dest: Path, **settings: object) -> tuple[RunConfig, Path]:
    """A copy of fixture run ``name`` in ``dest``, its config.json's top-level ``settings`` replaced."""
    shutil.copytree(FIXTURES / name, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(settings)
    (dest / "config.json").write_text(json.dumps(config))
    return RunConfig.from_dict(config), dest


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, events: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def strict_summary(out: Path) -> dict:
    """summary.json, read as strict JSON (no NaN or Infinity)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in summary.json")
    return json.loads((out / "summary.json").read_text(), parse_constant=refuse)


def test_a_peer_whose_rounds_jumped_past_the_others_is_named_and_the_summary_is_written(tmp_path, capsys):
    cfg, out = copy_run("consensus", tmp_path / "run", steps=450)
    first = read_lines(out / "peer-2.jsonl")
    rejoined = [dict(e, step=e["step"] + 400, round=e["round"] + 400) for e in first if e["event"] == "step"]
    end = dict(first[-1], step=412, rounds=412)
    write_lines(out / "peer-2.jsonl", [*first[:-1], {"event": "error", "time": 1.0, "message": "killed"},
                                       {"event": "start", "time": 2.0, "rank": 2},
                                       {"event": "resume", "time": 2.0, "found": True, "step": 32, "rounds": 32},
                                       {"event": "ready", "time": 2.0, "step": 400, "round": 400}, *rejoined, end])
    with np.load(out / "trace-2.npz") as data:
        arrays = {key: data[key] for key in data.files}
    np.savez(out / "trace-2.npz", **{**arrays, "rounds": arrays["rounds"] + 400})

    summary = summarise(cfg, out, 1.0, plot=False)

    assert summary == strict_summary(out) and summary["error"] is None  # the peers' models make a result
    assert summary["consensus_trace"] == [] and summary["mean_drift"] is None
    assert summary["peers"][2]["restarts"] == 1 and summary["peers"][2]["rounds"] == 412
    [problem] = summary["problems"]
    assert "share no round" in problem and "peer 2: rounds 400-412" in problem and "peer 0: rounds 0-12" in problem
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("warning: the peers' consensus traces share no round") and "\n" not in warning


def test_a_ps_runs_bytes_sent_count_the_servers_answers_too(tmp_path, capsys):
    """The server sends each worker the weights back: leaving its bytes out made a ps-* run look half as
    costly as a gossip run that sends the same messages."""
    cfg, out = copy_run("ps-sync", tmp_path / "run")
    ends = [read_lines(out / f"peer-{rank}.jsonl")[-1] for rank in range(cfg.nodes)]
    server_end = read_lines(out / "server.jsonl")[-1]
    assert all(e["event"] == "end" for e in [*ends, server_end]) and server_end["bytes_sent"] > 0

    summary = summarise(cfg, out, 1.0, plot=False)

    assert summary["bytes_sent"] == sum(e["bytes_sent"] for e in ends) + server_end["bytes_sent"]
    assert f"bytes sent (workers, server) {summary['bytes_sent'] / 1e6:.1f} MB" in capsys.readouterr().out


def ps_run_whose_server_ended_early(dest: Path) -> tuple[RunConfig, Path]:
    """The ps-sync fixture as the attack left it: the server ended after 36 updates, both workers trained
    on and died (--keep-going) without a model or trace."""
    cfg, out = copy_run("ps-sync", dest, steps=450, keep_going=True)
    server = read_lines(out / "server.jsonl")
    server[-1].update(versions=36, updates=36)
    write_lines(out / "server.jsonl", server)
    for rank in (0, 1):
        events = read_lines(out / f"peer-{rank}.jsonl")[:-2]  # no eval, no end
        late = dict(events[-1], time=server[-1]["time"] + 5.0, step=40, round=40)
        write_lines(out / f"peer-{rank}.jsonl", [*events, late, {"event": "error", "time": late["time"] + 30,
                                                                "message": "the server did not answer for 30 s"}])
        (out / f"model-{rank}.pt").unlink()
        (out / f"trace-{rank}.npz").unlink()
    return cfg, out


def test_a_ps_run_whose_server_ended_early_and_whose_workers_died_fails_in_one_line(tmp_path):
    cfg, out = ps_run_whose_server_ended_early(tmp_path / "run")
    with pytest.raises(GossipError) as failure:
        summarise(cfg, out, 1.0, plot=False, failed=["peer 0", "peer 1"])
    message = str(failure.value)
    assert message.startswith("no worker finished: peer 0, peer 1 died (--keep-going went on without them; peer 0 "
                              "stopped on: 'the server did not answer for 30 s'); the server ended after 36 updates")
    assert "\n" not in message and message.endswith("see peer-<rank>.log and server.log for why, and rerun")
    summary = strict_summary(out)
    assert summary["error"] == message and summary["failed"] == ["peer 0", "peer 1"]
    assert summary["server"]["updates"] == 36 and summary["consensus_distance"] is None
    assert any("the server ended after 36 updates while worker(s) 0, 1 still trained" in p for p in summary["problems"])


class ExitedProcess:
    """What the launcher's watch sees of a process that already exited with ``code``."""

    def __init__(self, pid: int, code: int) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int:
        return self.code

    def wait(self, timeout: float) -> int:
        return self.code

    def send_signal(self, signum: int) -> None:
        raise AssertionError("no live process to signal")


def test_the_launcher_ends_that_run_with_one_error_line_and_status_1(tmp_path, capsys):
    from launch.local import Member, supervise

    cfg, out = ps_run_whose_server_ended_early(tmp_path / "run")
    for rank in (0, 1):
        (out / f"peer-{rank}.log").write_text("gossip-peer: error: the server did not answer for 30 s\n")
    (out / "server.log").write_text("")
    members = [Member(f"peer {rank}", [], out / f"peer-{rank}.log", ExitedProcess(10 + rank, 1)) for rank in (0, 1)]
    members.append(Member("server", [], out / "server.log", ExitedProcess(12, 0)))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    code = supervise(cfg, out, lambda: members, "off", plot=False)

    assert code == 1 and {s: signal.getsignal(s) for s in handlers} == handlers
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[:2] == [f"gossip-launch: peer {rank} failed (exit 1): gossip-peer: error: the server did not answer "
                       "for 30 s; going on without it (--keep-going)" for rank in (0, 1)]
    assert err[2].startswith("gossip-launch: error: no worker finished: peer 0, peer 1 died") and len(err) == 3
    assert err[2].endswith(f"[details: {out / 'summary.json'}]")


def test_a_bug_in_the_summary_still_ends_in_one_line_and_a_summary_json(tmp_path, monkeypatch):
    import launch.summary

    cfg, out = copy_run("consensus", tmp_path / "run")

    def broken(*args: object) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(launch.summary, "build_summary", broken)
    with pytest.raises(launch.summary.RunFailed, match=r"^the summary failed \(KeyError: 'oops', at "
                       r"test_summary_inputs.py:\d+\): a bug in launch/summary.py; the run's files in .* are intact"):
        summarise(cfg, out, 1.0, plot=False)
    assert strict_summary(out)["error"].startswith("the summary failed (KeyError")


def test_launch_summary_refuses_a_config_that_is_not_one_in_one_line(tmp_path, capsys):
    from launch.summary import main

    _, out = copy_run("consensus", tmp_path / "run")
    (out / "config.json").write_text("[" * 100_000)
    assert main([str(out), "--no-plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"python -m launch.summary: error: {out / 'config.json'} is not a run's config.json "
                          "(RecursionError") and "\n" not in err


def test_a_peers_last_log_line_reaches_the_launchers_error_printable_and_short(tmp_path):
    from launch.local import LAST_LINE_CHARS, last_error_line

    log = tmp_path / "peer-0.log"
    log.write_bytes(b"x" * 100_000 + b"\nerror: \x1b[2Jforged \xff" + b"y" * 1000 + b"\n\n")
    line = last_error_line(log)
    assert line.startswith("error: ?[2Jforged \ufffdyyy") and line.endswith("...") and len(line) == LAST_LINE_CHARS
    assert last_error_line(tmp_path / "absent.log") == "no log"


def test_every_reader_of_a_log_takes_only_checked_events(tmp_path):
    from launch.events import parse_event, read_log
    from launch.progress import Progress

    wrong_step = (b'{"event": "step", "time": 3, "step": "7", "round": 10000000000000000000000, "loss": true, '
                  b'"bytes_sent": -1, "speed": [1], "wait_seconds": {}}')  # 6 fields of the wrong type
    wrong_end = (b'{"event": "end", "time": 4, "rounds": 3, "test": {"accuracy": "high"}, "staleness": {"\xc2\xb2": 1}, '
                 b'"weight": 0, "stragglers": [1, -2], "bytes_sent": 5}')  # 4
    lines = [b'{"event": "start", "time": 1.0}', b"\xff\xfe garbage", b"[" * 100_000, b'{"event": "step", "loss": NaN}',
             b"42", b'{"time": 2.0}', wrong_step, wrong_end, b'{"event": "end", "test": {"accu']
    (tmp_path / "peer-0.jsonl").write_bytes(b"\n".join(lines))
    events, problems = read_log(tmp_path / "peer-0.jsonl")
    assert events == [{"event": "start", "time": 1.0}, {"event": "step", "time": 3},
                      {"event": "end", "time": 4, "rounds": 3, "bytes_sent": 5}]
    assert problems == ["peer-0.jsonl line 2: not a JSON event ('\\ufffd\\ufffd garbage')",
                        "peer-0.jsonl line 3: not a JSON event ('[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[...)",
                        "peer-0.jsonl line 4: not a JSON event ('{\"event\": \"step\", \"loss\": NaN}')",
                        "peer-0.jsonl line 5: not an event: 42", "peer-0.jsonl line 6: not an event: {'time': 2.0}",
                        "peer-0.jsonl: 10 more such lines",
                        "peer-0.jsonl ends in a cut-off line (the file was cut short)"]
    step_problems = parse_event(wrong_step)[1]
    assert step_problems[0] == "the 'step' event's 'step' is '7', not a count from 0 to 2^63 - 1"
    assert [p.split("'")[4] for p in step_problems] == ["step", "round", "loss", "bytes_sent", "speed", "wait_seconds"]
    assert [p.split("'")[4] for p in parse_event(wrong_end)[1]] == ["test", "staleness", "weight", "stragglers"]
    progress = Progress(tmp_path, nodes=1, steps=10, mode="plain")
    progress.update()
    assert progress.peers[0].status == "done" and progress.peers[0].round == 3
    progress._line()
    progress._table()


def test_the_fixture_runs_summarise_cleanly(tmp_path):
    for name in ("consensus", "ps-sync"):
        cfg, out = copy_run(name, tmp_path / name)
        summary = summarise(cfg, out, 1.0, plot=False)
        assert summary["error"] is None and summary["problems"] == [], summary["problems"]
        assert summary["consensus_trace"] and summary["final_mean_drift"] is not None


# ---- many mangled copies: whatever the files hold, the summary names it and raises nothing else ----

JUNK = [True, [["x"]]]  # of no checked field's type (launch/events.py FIELDS)
ANYTHING = [None, "x", {}, [], 0, -1, 10**30, 1e308, {"0": -1}, [0, 1], "NaN", {"event": "end"}]


def _files(out: Path, suffix: str) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.name.endswith(suffix) and p.is_file())


def _target(rng: random.Random, out: Path, suffix: str, taken: set[str]) -> Path | None:
    free = [p for p in _files(out, suffix) if p.name not in taken]
    if not free:
        return None
    path = rng.choice(free)
    taken.add(path.name)
    return path


def _expected_end(path: Path) -> tuple[str, ...]:
    return ("server.jsonl",) if path.name == "server.jsonl" else (path.name,)


def mangle(op: str, rng: random.Random, out: Path, taken: set[str]) -> tuple[str, ...] | None:
    """Apply one kind of damage to one file not damaged yet; returns what the summary's problems or error
    must then say (each string in one line), or None where any outcome is right as long as nothing raises."""
    suffix = {"model": ".pt", "trace": ".npz"}.get(op.split("-")[0], ".jsonl")
    if op in ("delete", "truncate", "directory"):
        suffix = rng.choice([".jsonl", ".pt", ".npz"])
    path = _target(rng, out, suffix, taken)
    if path is None:
        return None
    if op == "delete":
        path.unlink()
        return (path.name,)
    if op == "directory":
        path.unlink()
        path.mkdir()
        return (path.name,)
    if op == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:rng.randrange(len(data))])
        return (path.name,)
    if op == "model":  # a state that is not the task's model
        state = torch.load(path, weights_only=True)
        name = rng.choice(list(state))
        damage = rng.choice(["shape", "dtype", "extra", "missing", "list", "not-tensor", "garbage"])
        if damage == "shape":
            state[name] = torch.zeros(3, 1)
        elif damage == "dtype":
            state[name] = state[name].to(torch.float16)
        elif damage == "extra":
            state["forged.weight"] = torch.zeros(1)
        elif damage == "missing":
            del state[name]
        elif damage == "not-tensor":
            state[name] = [1.0]
        if damage == "garbage":
            path.write_bytes(rng.randbytes(rng.randrange(1, 5000)))
        else:
            torch.save(list(state.values()) if damage == "list" else state, path)
        return (path.name,)
    if op == "model-nan":  # a NaN in a peer's model spoils the average (the server's own model is the product)
        state = torch.load(path, weights_only=True)
        name = next(n for n, t in state.items() if t.is_floating_point())
        state[name].view(-1)[0] = math.nan
        torch.save(state, path)
        if path.name == "model-final.pt":
            return ("model-final.pt", "not a usable model")
        parameter_server = json.loads((out / "config.json").read_text())["gossip"]["mode"] in PS_MODES
        return None if parameter_server else ("not a usable model",)  # (a damaged server.jsonl changes nothing)
    if op == "trace":
        with np.load(path) as data:
            arrays = {key: data[key] for key in data.files}
        damage = rng.choice(["beyond", "transpose", "weight", "index", "float-rounds", "empty", "drop", "object"])
        n = len(arrays["rounds"])
        if damage == "beyond":
            arrays["rounds"] = arrays["rounds"] + rng.choice([400, 10**6, 2**62])
            np.savez(path, **arrays)
            return (path.name, "names round")
        if damage == "transpose":
            arrays["values"] = arrays["values"].T
        elif damage == "weight":
            arrays["weights"][rng.randrange(n)] = rng.choice([0.0, -1.0, np.nan, np.inf])
        elif damage == "index":
            arrays["index"][rng.randrange(len(arrays["index"]))] = rng.choice([-1, 10**9])
        elif damage == "float-rounds":
            arrays["rounds"] = arrays["rounds"].astype(np.float64)
        elif damage == "empty":
            arrays = {key: value[:0] for key, value in arrays.items()}
        elif damage == "drop":
            del arrays[rng.choice(list(arrays))]
        elif damage == "object":
            arrays["values"] = np.array([object()] * n, dtype=object)
        np.savez(path, **arrays)
        return (path.name,)
    lines = path.read_bytes().split(b"\n")[:-1]
    where = rng.randrange(len(lines))
    if op == "garbage-line":
        junk = bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randrange(1, 80)))
        lines.insert(where, b"#" + junk)
        path.write_bytes(b"\n".join(lines) + b"\n")
        return (f"{path.name} line {where + 1}:",)
    if op == "not-an-event":
        lines[where] = rng.choice([b"42", b'"end"', b"[1, 2]", b"null", b'{"time": 1.0}', b'{"event": 7}'])
        path.write_bytes(b"\n".join(lines) + b"\n")
        return (f"{path.name} line {where + 1}: not an event",)
    events = [json.loads(line) for line in lines]
    if op == "drop-end":
        events = [e for e in events if e["event"] != "end"]
        write_lines(path, events)
        return ("server did not finish",) if path.name == "server.jsonl" else (path.name, "no end event")
    if op == "duplicate-log":  # as a restarted peer's log holds two incarnations
        write_lines(path, events + events)
        return None
    if op == "end-beyond":
        if path.name == "server.jsonl":
            return None
        key = rng.choice(["rounds", "step"])
        events[-1][key] = 10**12
        write_lines(path, events)
        return (f"reports {10**12} {'rounds' if key == 'rounds' else 'steps'}",)
    from launch.events import FIELDS

    index = rng.randrange(len(events))
    event = events[index]
    field = rng.choice(sorted(event))
    if op == "field-junk":  # a value of the wrong type in any field: named where the launcher reads it
        event[field] = rng.choice(JUNK)
        write_lines(path, events)
        if field == "event":
            return (f"{path.name} line {index + 1}: not an event",)
        return (f"{path.name} line {index + 1}:", repr(field)) if field in FIELDS.get(event["event"], {}) else None
    assert op == "field-anything"
    event[field] = rng.choice(ANYTHING)
    write_lines(path, events)
    return None


OPS = ["delete", "directory", "truncate", "model", "model-nan", "trace", "garbage-line", "not-an-event", "drop-end",
       "duplicate-log", "end-beyond", "field-junk", "field-anything"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=st.sampled_from(["consensus", "ps-sync"]),
       damage=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**32)), min_size=1, max_size=3))
@example(run="ps-sync", damage=[("delete", 1), ("model-nan", 0)])  # server.jsonl gone, a worker's model spoilt
def test_whatever_the_files_hold_the_summary_names_it_and_raises_nothing_else(run, damage):
    from launch.summary import BUG, RunFailed, build_summary

    with tempfile.TemporaryDirectory() as tmp:
        cfg, out = copy_run(run, Path(tmp) / "run")
        taken: set[str] = set()
        expected = [(op, mangle(op, random.Random(seed), out, taken)) for op, seed in damage]
        summary = build_summary(cfg, out, 1.0, [])[0]  # no exception, whatever the files hold
        said = [*summary["problems"], summary["error"] or ""]
        for op, words in expected:
            assert words is None or any(all(w in line for w in words) for line in said), (op, words, said)
        assert BUG not in (summary["error"] or "")
        try:
            result = summarise(cfg, out, 1.0, plot=False)
        except RunFailed as exc:
            assert str(exc) == summary["error"] and "\n" not in str(exc)
        except GossipError as exc:  # Diverged: the product model is not one, or learned nothing
            assert str(exc) == summary["error"] and "\n" not in str(exc)
        else:
            assert result["error"] is None
        assert strict_summary(out)["problems"] == summary["problems"]
