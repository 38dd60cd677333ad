"""A running peer under fire: 11,000 hostile messages of every kind while it trains."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from gossip.connect import RECV_QUEUE
from tests.conftest import free_base_port, reap_peers, start_launcher, wait_until
from tests.hostile import attack, forged, victim_layout

pytestmark = pytest.mark.timeout(300)


NODES, STEPS = 4, 400


def _attacked_run(out, proof_every: int = 0) -> tuple[dict, Counter[str]]:
    """A 4-peer ring that trains 400 steps while peer 0 takes ``attack``'s 11,000 hostile messages from
    round 5 on (with ``proof_every``, a hello in peer 2's name before every that many); the run's summary
    and what was sent."""
    base = free_base_port(NODES)
    launcher = start_launcher(out, NODES, "--steps", str(STEPS), "--compute-ms", "15", "--topology", "ring",
                              base_port=base)
    try:
        wait_until(lambda: '"round": 5' in _read(out / "peer-0.jsonl"), 90, "peer 0 to reach round 5")
        layout = victim_layout(world_size=NODES)
        sent = attack(f"tcp://127.0.0.1:{base}", layout, NODES, count=11_000,
                      proof=forged(layout, "hello", 2) if proof_every else None, proof_every=proof_every)
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        reap_peers(out, grace=5)
    assert launcher.returncode == 0, stderr[-2000:]
    return json.loads((out / "summary.json").read_text()), sent


def test_a_peer_under_fire_keeps_training_and_counts_every_drop(tmp_path):
    out, nodes, steps = tmp_path / "run", NODES, STEPS
    summary, sent = _attacked_run(out)
    victim, bystander = summary["peers"][0], summary["peers"][1]
    ends = [json.loads(_read(out / f"peer-{rank}.jsonl").splitlines()[-1]) for rank in range(nodes)]
    dropped = victim["dropped"]
    # every hostile message the victim read was dropped under the reason its kind names, and nothing else
    # was: no honest message (random bytes could decode as a map with bad fields: "field"). The flood runs
    # ahead of the victim's validation, and once one connection holds more than the protocol allows the
    # inbound guard cuts it (no count of queued messages throttles it: gossip/net/transport.py says why);
    # what that connection still held is lost with it, never mixed, and the flood goes on over a new one.
    cuts = dropped.pop("cut-oversized", 0)
    assert set(dropped) <= set(sent) | {"field"}, (dropped, dict(sent))
    read = sum(dropped.values())
    # A cut loses what the connection held in libzmq: more than the guard's limit of RECV_QUEUE + 2 of the
    # largest messages the protocol allows, one of them perhaps incomplete, so at least RECV_QUEUE + 1 whole
    # ones (no hostile message is larger); without a cut nothing is lost.
    lost = 11_000 - read
    assert (lost == 0) if cuts == 0 else (lost >= cuts * (RECV_QUEUE + 1)), (cuts, lost, dropped, dict(sent))
    assert dropped.get("header", 0) + dropped.get("field", 0) <= sent["header"], (dropped, dict(sent))
    for reason, count in sent.items():
        if reason != "header":
            assert dropped.get(reason, 0) <= count, (reason, dropped, dict(sent))
    # each peer hears a hello and one message per round from each of its two ring neighbours, and sends as
    # many: the victim took in the hostile ones it read besides, and lost or repeated none of its
    # neighbours' messages (their connections were never cut)
    honest = 2 * (1 + steps)
    assert all(e["event"] == "end" and e["rounds"] == steps for e in ends), ends
    assert [e["messages_sent"] for e in ends] == [honest] * nodes
    assert [e["messages_received"] for e in ends] == [read + honest] + [honest] * (nodes - 1)
    assert victim["test_accuracy"] >= 0.90 and summary["final_model"]["accuracy"] >= 0.90
    assert victim["max_rss_mb"] < 1.5 * bystander["max_rss_mb"]  # the flood did not pile up in memory
    assert bystander["dropped"] == {}


def test_a_flood_that_proves_its_connection_is_cut_all_the_same(tmp_path):
    # A stranger can send acceptable messages too: a hello in the name of a peer that has not spoken to the
    # victim (peer 2 is no neighbour of peer 0 on the ring) is one. Sent before every 50 hostile messages,
    # it makes the flood's connection one that "delivered a valid message". The guard
    # makes no exception for such a connection: taking its waiting messages before judging it (tried on
    # 2026-11-26, to spare gossip-async's latest rule its cuts) let this flood hold the victim at 381 MB
    # against 280 MB for the others; the guard as it is cut it 33 times and held it to 297 MB.
    summary, sent = _attacked_run(tmp_path / "run", proof_every=50)
    assert sent["proof"] == 220
    victim, bystanders = summary["peers"][0], summary["peers"][1:]
    assert victim["dropped"].get("cut-oversized", 0) > 0, victim["dropped"]
    # the guard's bound for one connection is 10.3 MB here (RELIABILITY.md), plus what arrives within a check.
    # Measured: the victim 17-28 MB above the others run alone, 55 MB once in the whole suite (where every peer
    # started from a larger forked launcher: 355 MB against 283); the exception above held it 101 MB above.
    assert victim["max_rss_mb"] < max(p["max_rss_mb"] for p in bystanders) + 75, (victim, bystanders)
    assert summary["final_model"]["accuracy"] >= 0.90


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
