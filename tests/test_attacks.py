"""The threat model acted out against real peers (RELIABILITY.md, "Threat model").

A stranger who can reach a peer's port fires every attack of the model at it while the run trains: one
endless multipart message, oversized frames, more connections than the cap, lying weights and counters,
forged control messages. Gossip-sync with fixed deadlines is deterministic, so "unchanged by the
attacker" is exact: every peer's final model equals that of the same run without the attacker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from gossip.compression import encode_difference_, scratch_numel
from gossip.config import GossipConfig, RunConfig
from gossip.net.wire import Layout, encode, params_header
from launch.events import read_events
from tests.conftest import ROOT, free_base_port, reap_peers, start_launcher, wait_until
from tests.hostile import Stranger, forged, victim_layout
from tests.launcher import Launched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NODES = 4
RUN = ["--steps", "150", "--compute-ms", "20"]


def _start(out: Path, *extra: str, run: list[str] = RUN, nodes: int = NODES,
           env: dict[str, str] | None = None) -> tuple[Launched, int]:
    base = free_base_port(nodes + 1)
    ring = () if "--topology" in (*run, *extra) else ("--topology", "ring")  # (the attacks aim at ring neighbours)
    return start_launcher(out, nodes, *run, *ring, *extra, base_port=base, env=env), base


def _finish(launcher: Launched, out: Path) -> tuple[int, str]:
    try:
        _, stderr = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reap_peers(out, grace=5)
    return launcher.returncode, stderr


def _wait_for_round(out: Path, round: int, timeout: float = 60, log: str = "peer-0.jsonl",
                    field: str = "round") -> None:
    mark = f'"{field}": {round}'

    def reached() -> bool:
        try:
            return mark in (out / log).read_text()
        except OSError:
            return False

    wait_until(reached, timeout, f"{log} to reach {field} {round}")


def _assert_same_models(attacked: Path, clean: Path) -> None:
    """Every peer's final model of the attacked run is bit-identical to the clean run's."""
    for rank in range(NODES):
        mine = torch.load(attacked / f"model-{rank}.pt", weights_only=True)
        theirs = torch.load(clean / f"model-{rank}.pt", weights_only=True)
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (rank, name)


def test_a_stranger_changes_nothing_in_a_sync_run(tmp_path):
    clean, attacked = tmp_path / "clean", tmp_path / "attacked"
    held = ["--task", "tests.tasks:held_digits"]
    launcher, _ = _start(clean, *held)
    assert _finish(launcher, clean)[0] == 0

    # the victim stops training at its 10th step until every attack is over (its event loop, which the
    # attacks are against, goes on): however slow the attacks, they meet a running peer
    release = tmp_path / "release"
    launcher, base = _start(attacked, *held, env={"GOSSIP_TEST_RELEASE": str(release)})
    layout = victim_layout(world_size=NODES)
    stranger = Stranger(f"tcp://127.0.0.1:{base}")
    try:
        wait_until(lambda: Path(f"{release}.held").exists() or launcher.poll() is not None, 90, "peer 0 to hold")
        stranger.send(
            forged(layout, "params", 1, round=6, w=1e300),  # would outweigh the whole network
            forged(layout, "params", 1, round=6, w=1.7e308),
            forged(layout, "params", 2, round=10**9),  # a round the run never reaches
            forged(layout, "hello", 1),  # "I restarted": peer 1 is alive and its link never dropped
            forged(layout, "welcome", 3, round=10, step=10),  # peer 0 is not rejoining
            forged(layout, "bye", 1),  # gossip-sync has no bye
            forged(layout, "abort", 1, why="peer 1 diverged (forged)"),  # not over peer 1's own connection
            forged(layout, "params", 3, round=10, fp="0123456789abcdef"),  # "peer 3's model differs"
        )
        assert stranger.endless_message(frame_bytes=32 << 10, frames=20_000)  # 640 MiB in one message: cut
        assert stranger.endless_message(frame_bytes=1 << 20, frames=64)  # larger frames than this model has
        assert stranger.endless_message(frame_bytes=0, frames=3_000_000)  # 2 wire bytes, a 64-byte msg_t each
        assert stranger.idle(3 * NODES + 40)  # more connections than the cap (2 per rank + 16): cut
        # a burst beyond a connection's queue with a PING in it, then a reset: aborted libzmq 4.3.5 itself
        assert stranger.flood_ping_reset(messages=1024, rounds=5) == 5, "the victim stopped listening"
        release.touch()
        code, stderr = _finish(launcher, attacked)
    finally:
        stranger.close()
    assert code == 0, stderr[-3000:]
    _assert_same_models(attacked, clean)
    peers = json.loads((attacked / "summary.json").read_text())["peers"]
    victim = peers[0]
    dropped = victim["dropped"]
    assert dropped.get("weight", 0) == 2 and dropped.get("horizon", 0) == 1, dropped
    # the welcome came over another connection than peer 3's own, the hello than peer 1's: neither was taken
    assert dropped.get("connection", 0) == 1 and dropped.get("hello-held", 0) == 1, dropped
    assert dropped.get("kind", 0) == 1, dropped
    assert dropped.get("cut-oversized", 0) == 2 and dropped.get("cut-connections", 0) >= 1, str(dropped)
    ends = [json.loads((attacked / f"peer-{rank}.jsonl").read_text().splitlines()[-1]) for rank in range(NODES)]
    # nobody was declared dead, and the forged hello was not believed (peer 1's connection stayed open, even
    # where our link to it had flapped before: the end events count such drops, link_drops)
    assert [(end["deaths"], end["readmitted"]) for end in ends] == [(0, 0)] * NODES, [
        (end["deaths"], end["readmitted"], end["link_drops"]) for end in ends]
    assert all(p["dropped"] == {} for p in peers[1:])
    # 640 MiB, and 3 million empty frames, were sent at it; what it kept is bounded by the guard (10.3 MB
    # for this model, plus what arrives within one check: RELIABILITY.md states the figures)
    assert victim["max_rss_mb"] < max(p["max_rss_mb"] for p in peers[1:]) + 40, [p["max_rss_mb"] for p in peers]


def _server_run(out: Path, steps: int, workers: int, *attack: list) -> dict:
    """A ps-sync run; ``attack``'s messages are sent to the server, in the workers' names, at version 10."""
    run = ["--steps", str(steps), "--mode", "ps-sync", "--compute-ms", "20"]
    launcher, base = _start(out, run=run, nodes=workers)
    stranger = Stranger(f"tcp://127.0.0.1:{base + workers}")  # the server listens after the workers
    try:
        if attack:
            _wait_for_round(out, 10, log="server.jsonl", field="version")
            stranger.send(*attack)
        code, stderr = _finish(launcher, out)
    finally:
        stranger.close()
    assert code == 0, stderr[-3000:]
    events = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]
    return next(e for e in events if e["event"] == "end")


def test_guessed_byes_and_a_hello_flood_change_nothing_at_the_parameter_server(tmp_path):
    """Byes naming every step a worker could be at (one was bound to fit and ended the run after 36 of
    450 updates), and a flood of hellos in the workers' names (each took a share of the server's queue, a
    genuine gradient was dropped as flood, and each was answered with the whole model): the server hears a
    worker only over the connection its latest message came on, so none of them is taken or answered."""
    steps, workers, hellos = 150, 3, 2000
    clean = _server_run(tmp_path / "clean", steps, workers)
    layout = victim_layout(world_size=workers)
    byes = [forged(layout, "bye", worker, step=step) for worker in range(workers) for step in range(steps + 1)]
    flood = [forged(layout, "hello", worker % workers, step=worker % steps) for worker in range(hellos)]
    end = _server_run(tmp_path / "attacked", steps, workers, *byes, *flood)
    assert end["updates"] == clean["updates"] == steps and end["implausible"] == {}, end
    assert end["dropped"] == {"connection": len(byes), "hello-held": hellos}, end["dropped"]
    assert end["messages_sent"] == clean["messages_sent"]  # not one answer to a stranger
    # ps-sync sums a version's gradients in their order of arrival: equal to float rounding
    mine = torch.load(tmp_path / "attacked" / "model-final.pt", weights_only=True)
    theirs = torch.load(tmp_path / "clean" / "model-final.pt", weights_only=True)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", [["--mode", "gossip-async"]], ids=["async-push-sum"])
def test_a_massless_message_at_the_horizon_cuts_no_link(tmp_path, mode):
    """A round equal to the run's horizon passes the horizon check; recorded as the sender's latest, it made
    every later genuine message of that sender a replay, and the link was cut for the rest of the run
    (drift of the mean 7.6e-6 in this test, below 1e-12 without the message). A message in a live neighbour's name over a connection
    that is not that neighbour's is now refused, whatever it claims, so the mean stays exact. (Adaptive
    gossip-sync files its messages in the same mailbox, by the same rule: 356 replays before, run by hand
    with ``--mode gossip-sync --deadline adaptive``; the mailbox's own tests cover both.)"""
    out = tmp_path / "run"
    run = ["--steps", "200", "--task", "consensus", "--compute-ms", "20", *mode]
    launcher, base = _start(out, run=run)
    layout = victim_layout(task="consensus", world_size=NODES)
    gossip = dict(zip(mode[::2], mode[1::2], strict=True))
    horizon = RunConfig(nodes=NODES, steps=200, task="consensus", gossip=GossipConfig.of(
        world_size=NODES, mode=gossip["--mode"], deadline=gossip.get("--deadline", "fixed"))).gossip.bounds.max_rounds
    stranger = Stranger(f"tcp://127.0.0.1:{base}")
    try:
        _wait_for_round(out, 20)
        stranger.send(*(forged(layout, "params", sender, round=round, step=0, w=0.0)
                        for sender in (1, 3) for round in (horizon, horizon + 1)))
        code, stderr = _finish(launcher, out)
    finally:
        stranger.close()
    assert code == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_mean_drift"] < 1e-12, summary["final_mean_drift"]
    assert summary["peers"][0]["dropped"] == {"connection": 4}, summary["peers"][0]["dropped"]


def test_forged_gradients_do_not_move_an_asynchronous_server(tmp_path):
    """Twenty finite gradients of 3.0 everywhere, 30 versions stale, in the workers' names: ps-async took
    them all and ended at chance (0.100). The server hears a worker only over its own connection."""
    out, steps, workers = tmp_path / "ps", 100, 3
    launcher, base = _start(out, run=["--steps", str(steps), "--mode", "ps-async", "--compute-ms", "20"],
                            nodes=workers)
    layout = victim_layout(world_size=workers)
    stranger = Stranger(f"tcp://127.0.0.1:{base + workers}")
    try:
        _wait_for_round(out, 30, log="server.jsonl", field="version")
        stranger.send(*(forged(layout, "grad", n % workers, fill=3.0, round=0) for n in range(20)))
        code, stderr = _finish(launcher, out)
    finally:
        stranger.close()
    assert code == 0, stderr[-3000:]
    events = [json.loads(line) for line in (out / "server.jsonl").read_text().splitlines()]
    end = next(e for e in events if e["event"] == "end")
    assert end["contributed"] == end["updates"] == workers * steps, end  # not one forged gradient applied
    # refused, each; unless the burst (20 models at once) outran the server's reading and the guard cut the
    # stranger's connection with the rest unread (a full-suite run saw 1 cut)
    dropped = dict(end["dropped"])
    cuts = dropped.pop("cut-oversized", 0)
    assert set(dropped) == {"connection"} and (dropped["connection"] == 20 or cuts), end["dropped"]
    summary = json.loads((out / "summary.json").read_text())
    assert all(peer["dropped"] == {} for peer in summary["peers"]) and summary["accuracy"] >= 0.85


def test_forged_hellos_on_a_directed_graph_readmit_nobody(tmp_path):
    """On the exponential graph a peer never dials its in-neighbours, so no link to them is ever reported;
    a hello in an in-neighbour's name was believed at once as a restart: all five peers re-admitted one,
    10% of the mass was lost (drift 0.0071). The in-neighbour's own open connection now holds its name."""
    out, nodes = tmp_path / "exp", 5
    run = ["--steps", "200", "--mode", "gossip-async", "--task", "consensus", "--topology", "exponential",
           "--compute-ms", "20"]
    launcher, base = _start(out, run=run, nodes=nodes)
    layout = victim_layout(task="consensus", world_size=nodes)
    strangers = [Stranger(f"tcp://127.0.0.1:{base + rank}") for rank in range(nodes)]
    try:
        _wait_for_round(out, 20)  # every in-neighbour (offsets 1, 2, 4, a round each) has spoken by now
        for rank, stranger in enumerate(strangers):
            stranger.send(*(forged(layout, "hello", (rank - offset) % nodes) for offset in (1, 2, 4)))
        code, stderr = _finish(launcher, out)
    finally:
        for stranger in strangers:
            stranger.close()
    assert code == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_mean_drift"] < 1e-12, summary["final_mean_drift"]
    ends = [json.loads((out / f"peer-{rank}.jsonl").read_text().splitlines()[-1]) for rank in range(nodes)]
    assert [e["readmitted"] for e in ends] == [0] * nodes
    assert [p["dropped"] for p in summary["peers"]] == [{"hello-held": 3}] * nodes


def test_connections_proven_by_forged_hellos_cannot_keep_a_restarted_neighbour_out(tmp_path):
    """A hello in a live neighbour's name made a stranger's connection "proven", which the connection cap
    never cuts: such connections filled the slot a killed neighbour freed, and its restarted process's
    connection was the one cut, again and again. A held hello proves nothing now: the cap cuts the
    stranger's oldest connection instead, and the neighbour rejoins."""
    out = tmp_path / "run"
    launcher, base = _start(out, run=["--steps", "400", "--compute-ms", "20", "--checkpoint-every", "20",
                                      "--keep-going", "--peer-timeout", "1", "--round-timeout", "10"])
    layout = victim_layout(world_size=NODES)
    stranger = Stranger(f"tcp://127.0.0.1:{base}")
    cap = 2 * NODES + 16  # the victim's neighbours 1 and 3 hold two of its slots
    monitors, again = [], None

    def proven_connection() -> None:
        sock = stranger.connect()
        monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        sock.send_multipart(forged(layout, "hello", 1))
        time.sleep(0.05)

    try:
        _wait_for_round(out, 20)
        for _ in range(cap - 2):
            proven_connection()
        time.sleep(0.5)
        assert not any(monitor.poll(0) for monitor in monitors)  # within the cap so far: nothing was cut
        os.kill(json.loads((out / "peers.json").read_text())[3]["pid"], signal.SIGKILL)
        wait_until(lambda: "peer 3 is dead" in (out / "peer-0.log").read_text(), 60, "peer 0 to declare peer 3 dead")
        proven_connection()  # the slot peer 3's connection held
        time.sleep(0.5)
        again = subprocess.Popen([sys.executable, "-m", "gossip.peer", str(out / "config.json"), "--rank", "3",
                                  "--resume"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while _events(out / "peer-3.jsonl").count("ready") < 2 and again.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        # (looked at before the run ends, which closes every connection)
        cut = [bool(monitor.poll(0)) for monitor in monitors[:-1]]
        for monitor in monitors:
            monitor.close(linger=0)
        code, stderr = _finish(launcher, out)
        again.wait(timeout=60)
    finally:
        stranger.close()
        if again is not None and again.poll() is None:
            again.kill()
    assert code == 0 and again.returncode == 0, stderr[-3000:]
    assert any(cut), cut  # before: only peer 3's connection, and the stranger's last one, were ever cut
    end = json.loads((out / "peer-0.jsonl").read_text().splitlines()[-1])
    assert end["readmitted"] == 1, end  # peer 0 took peer 3 back


def test_a_stranger_cannot_end_or_skew_an_asynchronous_push_sum_run(tmp_path):
    """Push-sum keeps the network's mean exactly, so any mass a forged message added, or a forged bye made a
    peer refuse, would show in the final drift of the mean on the consensus task."""
    out = tmp_path / "async"
    run = ["--steps", "200", "--mode", "gossip-async", "--task", "consensus", "--compute-ms", "20"]
    launcher, base = _start(out, run=run)
    layout = victim_layout(task="consensus", world_size=NODES)
    stranger = Stranger(f"tcp://127.0.0.1:{base}")
    try:
        _wait_for_round(out, 20)
        stranger.send(
            forged(layout, "params", 1, round=150, w=1e300),
            forged(layout, "params", 3, round=150, w=1.7e308),
            forged(layout, "params", 3, round=10**9),
            forged(layout, "bye", 1, round=60, step=60),  # "peer 1 finished after 60 rounds": it trains on
            forged(layout, "bye", 1, round=150, step=150),
            forged(layout, "bye-ack", 3, round=150),  # an answer to a bye peer 0 never said
        )
        code, stderr = _finish(launcher, out)
    finally:
        stranger.close()
    assert code == 0, stderr[-3000:]  # before: peer 0 waited 60 s for peer 1's "last messages" and failed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_mean_drift"] < 1e-12 and summary["consensus_distance"] < 1e-6, summary
    dropped = summary["peers"][0]["dropped"]
    # the byes and the bye-ack came over another connection than their named senders': refused at once
    assert dropped == {"weight": 2, "horizon": 1, "connection": 3}, dropped
    end = json.loads((out / "peer-0.jsonl").read_text().splitlines()[-1])
    assert end["forged_byes"] == 0, end["forged_byes"]


def _restarted_run(out: Path, steps: int, forged_round: int | None) -> tuple[int, str]:
    """Peer 3 of a 4-peer ring is killed in round 30 and restarted; with ``forged_round``, a stranger sends
    hellos and welcomes (naming that round) in its neighbours' names to its port all through the restart."""
    launcher, base = _start(out, run=["--steps", str(steps), "--compute-ms", "20", "--checkpoint-every", "10",
                                      "--max-restarts", "1", "--round-timeout", "15"])
    layout = victim_layout(world_size=NODES)
    stranger = Stranger(f"tcp://127.0.0.1:{base + 3}")
    try:
        _wait_for_round(out, 30, log="peer-3.jsonl")
        os.kill(json.loads((out / "peers.json").read_text())[3]["pid"], signal.SIGKILL)
        if forged_round is not None:
            stranger.connect(reconnect_ms=10)
            forgeries = [forged(layout, kind, sender, round=forged_round, step=forged_round)
                         for kind in ("hello", "welcome") for sender in (0, 2)]
            deadline = time.monotonic() + 60  # from the kill until the new incarnation has rejoined, and a little
            while time.monotonic() < deadline and _events(out / "peer-3.jsonl").count("ready") < 2:
                stranger.send(*forgeries)
                time.sleep(0.01)
            for _ in range(50):
                stranger.send(*forgeries)
                time.sleep(0.01)
        return _finish(launcher, out)
    finally:
        stranger.close()


def test_forged_welcomes_while_a_peer_restarts_are_not_taken(tmp_path):
    """A restarted peer takes the round each neighbour welcomes it back in. Welcomes in its two neighbours'
    names, naming a round near the run's end, sent all through its restart: it jumped there, its
    neighbours waited a whole round timeout for it and were restarted in turn. A welcome must now echo the
    nonce of the restarted incarnation's hello, which only those it said hello to have read; and one that
    does takes its sender's name back from a stranger whose hellos reached the new incarnation first."""
    steps, forged_round = 300, 290
    clean, attacked = tmp_path / "clean", tmp_path / "attacked"
    assert _restarted_run(clean, steps, None)[0] == 0
    code, stderr = _restarted_run(attacked, steps, forged_round)
    assert code == 0, stderr[-3000:]
    assert stderr.count("restarted it with --resume") == 1, stderr[-2000:]
    events = [json.loads(line) for line in (attacked / "peer-3.jsonl").read_text().splitlines()]
    resumed = next(e for e in events if e["event"] == "resume")
    rejoined = [e for e in events if e["event"] == "ready"][-1]
    assert resumed["step"] <= rejoined["round"] < forged_round, (resumed, rejoined)
    summary = json.loads((attacked / "summary.json").read_text())
    assert summary["failed"] == [], summary["failed"]
    assert all(p["steps"] == steps for p in summary["peers"] if p["rank"] != 3), summary["peers"]
    assert sum(summary["peers"][3]["dropped"].values()) > 0  # the stranger's messages reached it, and were refused
    # a restart is not deterministic (where the peer rejoins depends on timing): the product model is compared
    # with the same run's without the stranger, by test accuracy, within 0.02 (359 test images: 7 of them)
    baseline = json.loads((clean / "summary.json").read_text())["accuracy"]
    assert abs(summary["accuracy"] - baseline) <= 0.02, (summary["accuracy"], baseline)


def _events(path: Path) -> list[str]:
    """The kinds of the events a peer logged so far (``launch.events.read_events``: a missing file or a
    line still being written reads as nothing)."""
    return [event["event"] for event in read_events(path)]


def _compressed(layout: Layout, codec: str, sender: int, round: int) -> list:
    """A well-formed compressed message in ``sender``'s name: the change of a zero public copy to ones."""
    frames = []
    for _, start, stop in layout.frame_plan(8 << 20):
        public = torch.zeros(stop - start)
        frames += encode_difference_(codec, torch.ones(stop - start), public, torch.empty(scratch_numel(stop - start)))
    kind = {"float16": "delta-f16", "int8": "delta-i8"}[codec]
    return encode(params_header(kind, sender, layout, 8 << 20, round=round, step=round), frames)


def test_a_stranger_cannot_move_a_compressed_run(tmp_path):
    """Compressed gossip checks what it decodes as strictly as the weights: lying sizes and scales, NaN, the
    other codec and the uncompressed kind are dropped before any replica moves, so the run (lockstep,
    deterministic) ends bit-identical to the same run without the stranger."""
    extra = ("--compress", "int8")
    clean, attacked = tmp_path / "clean", tmp_path / "attacked"
    launcher, _ = _start(clean, *extra)
    assert _finish(launcher, clean)[0] == 0

    launcher, base = _start(attacked, *extra)
    layout = victim_layout(world_size=NODES)
    stranger = Stranger(f"tcp://127.0.0.1:{base}")
    try:
        _wait_for_round(attacked, 5)
        valid = _compressed(layout, "int8", 1, 7)
        scales = np.frombuffer(bytes(valid[2]), dtype=np.float32)
        lies = [valid[:2] + [np.array([bad] + list(scales[1:]), dtype=np.float32).tobytes()]
                for bad in (np.nan, -1.0, np.inf, 1e30)]  # scale: NaN, negative, infinite, beyond 2^64 / 127
        stranger.send(*lies,
                      valid[:1] + [bytes(valid[1])[:-1]] + valid[2:],  # a values frame one byte short: length
                      valid[:2],  # the scales left out: frames
                      _compressed(layout, "float16", 1, 7),  # the other codec: named
                      forged(layout, "params", 1, round=7))  # uncompressed weights: not this run's kind
        code, stderr = _finish(launcher, attacked)
    finally:
        stranger.close()
    assert code == 0, stderr[-3000:]
    _assert_same_models(attacked, clean)
    dropped = json.loads((attacked / "summary.json").read_text())["peers"][0]["dropped"]
    assert dropped == {"scale": 4, "length": 1, "frames": 1, "codec": 1, "kind": 1}, dropped
