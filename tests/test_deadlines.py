"""Adaptive waiting: per-neighbour deadlines (median + k * MAD, speed-aware), chronic stragglers, and the
push-sum mailbox that keeps every late message's mass."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from gossip.averagers.mailboxes import MAX_NOTED, MassMailbox
from gossip.deadlines import MIN_OBSERVATIONS, ArrivalDeadlines
from gossip.errors import PeerTimeout, ProtocolError
from gossip.flat import FlatParams
from gossip.net.wire import encode, params_header

pytestmark = pytest.mark.timeout(30)
CEILING = 60.0


def tracker(**overrides) -> ArrivalDeadlines:
    options = dict(k=3.0, floor=0.01, window=8, straggler_fraction=0.75, pace_tolerance=0.5)
    return ArrivalDeadlines(0, **{**options, **overrides})


def test_until_enough_is_known_a_neighbour_is_waited_for_up_to_the_ceiling():
    deadlines = tracker()
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=0.1) == CEILING
    for _ in range(MIN_OBSERVATIONS - 1):
        deadlines.observe(1, 0.02)
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=0.1) == CEILING
    deadlines.observe(1, 0.02)
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=None) == CEILING  # pace not reported yet
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=0.1) < CEILING


def test_deadline_is_median_plus_k_mad():
    deadlines = tracker(k=2.0)
    for lateness in (0.10, 0.12, 0.08, 0.11, 0.50):  # median 0.11; deviations .01 .01 .03 0 .39 -> MAD 0.01
        deadlines.observe(1, lateness)
    assert deadlines.deadline(1, CEILING, 0.1, 0.1) == pytest.approx(0.11 + 2 * 0.01)


def test_floor_ceiling_and_negative_lateness():
    deadlines = tracker(floor=0.05)
    for _ in range(5):
        deadlines.observe(1, -0.3)  # arrived before we waited: lateness 0
        deadlines.observe(2, 10.0)
    assert deadlines.deadline(1, CEILING, 0.1, 0.1) == 0.05
    assert deadlines.deadline(2, 2.0, 0.1, 0.1) == 2.0


def test_a_neighbour_slower_than_the_pace_tolerance_is_not_waited_for():
    deadlines = tracker(pace_tolerance=0.5)
    for _ in range(5):
        deadlines.observe(1, 0.0)
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=0.149) > 0
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=0.151) == 0.0
    assert deadlines.deadline(1, CEILING, own_pace=0.1, sender_pace=0.01) > 0  # faster is fine


def test_a_chronic_straggler_is_reported_once_and_jitter_is_not(caplog):
    deadlines = tracker(window=8, straggler_fraction=0.75)
    with caplog.at_level(logging.WARNING, logger="gossip.deadlines"):
        for round in range(40):
            deadlines.settle(1, missed=round % 3 == 0)  # a third of the rounds: jitter
            deadlines.settle(2, missed=round % 8 != 0)  # seven in eight
    assert deadlines.stragglers == {2}
    assert [r.getMessage() for r in caplog.records] == [
        "peer 0: neighbour 2 missed its deadline in 7 of the last 8 rounds; it is a chronic straggler "
        "(its messages are mixed when they arrive, not waited for)"]
    stats = deadlines.statistics()
    assert stats["stragglers"] == [2] and stats["rounds_waited"] == {"1": 40, "2": 40}
    assert stats["deadline_misses"] == {"1": 14, "2": 35}


# -- the push-sum mailbox ---------------------------------------------------------------------------------

def layout_of(values: torch.Tensor) -> FlatParams:
    model = torch.nn.Module()
    model.value = torch.nn.Parameter(values.clone(), requires_grad=False)
    return FlatParams(model, 1 << 20)


def message(flat: FlatParams, sender: int, round: int, values: torch.Tensor, weight: float) -> list[bytes]:
    header = params_header("params", sender, flat.layout, flat.chunk_bytes, round=round, step=round, weight=weight)
    return [bytes(frame) for frame in encode(header, [values])]


def mailbox(flat: FlatParams, shares: dict[int, float]) -> MassMailbox:
    return MassMailbox(0, 4, flat.layout, lambda sender, round: sender in shares, lambda sender, round: shares[sender])


def test_messages_from_one_sender_merge_without_losing_mass():
    flat = layout_of(torch.zeros(5, dtype=torch.float64))
    box = mailbox(flat, {1: 0.25, 2: 0.5})
    a, b, c = (torch.randn(5, dtype=torch.float64) for _ in range(3))
    box.deliver(None, message(flat, 1, 0, a, weight=1.0))
    box.deliver(None, message(flat, 1, 1, b, weight=3.0))
    box.deliver(None, message(flat, 2, 4, c, weight=2.0))
    held = box.take_all()
    assert held[1].mass == pytest.approx(0.25 * 1 + 0.25 * 3) and held[2].mass == pytest.approx(1.0)
    assert [m for m, _ in held[1].parts] == [0.25, 0.75]  # unmerged, as sent
    assert torch.equal(held[1].parts[0][1][0], a) and torch.equal(held[1].parts[1][1][0], b)
    assert torch.equal(held[2].parts[0][1][0], c)
    assert box.take_all() == {} and box.received == {1: 2, 2: 1} and box.latest_round == {1: 1, 2: 4}
    assert [(s, r) for s, r, _ in box.take_arrivals()] == [(1, 0), (1, 1), (2, 4)]


def test_a_sender_far_ahead_is_merged_without_losing_mass():
    flat = layout_of(torch.zeros(5, dtype=torch.float64))
    box = mailbox(flat, {1: 0.25})
    a, b, c = (torch.randn(5, dtype=torch.float64) for _ in range(3))
    for round, (values, weight) in enumerate([(a, 1.0), (b, 3.0), (c, 2.0)]):
        box.deliver(None, message(flat, 1, round, values, weight=weight))
    held = box.take_all()[1]
    parts = held.parts
    assert len(parts) == 2 and sum(m for m, _ in parts) == pytest.approx(0.25 * (1 + 3 + 2))
    total = sum(m * chunks[0] for m, chunks in parts)
    torch.testing.assert_close(total, 0.25 * a + 0.75 * b + 0.5 * c, rtol=0, atol=1e-14)
    assert held.rounds == [0, 1, 2]  # merged or not, each message's round is named for a replay


def test_a_flooding_sender_is_held_in_bounded_memory():
    """However many messages a sender pushes between two mixes, two parts are held and the first
    ``MAX_NOTED`` rounds noted; the mass is all there."""
    flat = layout_of(torch.zeros(5, dtype=torch.float64))
    box = mailbox(flat, {1: 0.25})
    for round in range(3 * MAX_NOTED):
        box.deliver(None, message(flat, 1, round, torch.full((5,), float(round), dtype=torch.float64), weight=1.0))
    held = box.take_all()[1]
    assert len(held.parts) == 2 and held.rounds == list(range(MAX_NOTED))
    assert held.mass == pytest.approx(0.25 * 3 * MAX_NOTED)


def test_a_replayed_round_and_a_stranger_are_refused():
    flat = layout_of(torch.zeros(3, dtype=torch.float64))
    box = mailbox(flat, {1: 0.5})
    box.deliver(None, message(flat, 1, 2, torch.ones(3, dtype=torch.float64), 1.0))
    with pytest.raises(ProtocolError, match="not newer"):
        box.deliver(None, message(flat, 1, 2, torch.ones(3, dtype=torch.float64), 1.0))
    with pytest.raises(ProtocolError, match="not our neighbour"):
        box.deliver(None, message(flat, 3, 0, torch.ones(3, dtype=torch.float64), 1.0))
    assert box.take_all()[1].mass == 0.5


def test_wait_for_returns_who_missed_each_at_its_own_deadline():
    flat = layout_of(torch.zeros(2, dtype=torch.float64))
    box = mailbox(flat, {1: 0.5, 2: 0.5})
    box.deliver(None, message(flat, 1, 0, torch.ones(2, dtype=torch.float64), 1.0))
    start = time.monotonic()
    missed = box.wait_for(0, {1: start + 5.0, 2: start + 0.2})
    assert missed == {2} and time.monotonic() - start < 4  # 1 was there; 2's own short deadline ended it
    threading.Timer(0.1, box.deliver, (None, message(flat, 2, 0, torch.ones(2, dtype=torch.float64), 1.0))).start()
    assert box.wait_for(0, {2: time.monotonic() + 10.0}) == set()


def test_the_final_wait_names_a_silent_sender():
    flat = layout_of(torch.zeros(2, dtype=torch.float64))
    box = mailbox(flat, {1: 0.5, 2: 0.5})
    box.deliver(None, message(flat, 1, 0, torch.ones(2, dtype=torch.float64), 1.0))
    box.wait_counts({1: 1}, idle_timeout=1.0)
    with pytest.raises(PeerTimeout, match=r"heard nothing from peer\(s\) 2 for 0.3 s"):
        box.wait_counts({1: 1, 2: 1}, idle_timeout=0.3)
