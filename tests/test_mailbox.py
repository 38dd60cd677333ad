"""The gossip-async mailbox's handling of a neighbour that finishes ("bye"). Pure: frames built in memory."""

from __future__ import annotations

import time

import pytest
import torch

from gossip.errors import ProtocolError
from gossip.mailbox import LatestMailbox
from gossip.wire import Header, Layout, encode, params_header

CHUNK = 256
LAYOUT = Layout.describe([("w", (50,), "float32")], ["float32"], [50], CHUNK)
RING = {0: (1, 3), 1: (0, 2), 2: (1, 3), 3: (2, 0)}


def mailbox() -> LatestMailbox:
    box = LatestMailbox(0, 4, LAYOUT, lambda sender, round: sender in RING[0])
    box.peer_timeout = 0.05
    return box


def params(sender: int, step: int) -> list:
    header = params_header("params", sender, LAYOUT, CHUNK, round=step, step=step)
    return encode(header, [torch.full((50,), float(step))])


def bye(sender: int, step: int) -> list:
    return encode(Header(kind="bye", sender=sender, round=step, step=step))


def test_a_finished_neighbours_last_snapshot_grows_no_staler():
    box = mailbox()
    box.local_step = 10
    box.deliver(None, params(1, 40))
    box.deliver(None, params(3, 40))
    box.local_step = 12
    box.deliver(None, bye(1, 40))  # peer 1 finished with the snapshot we hold
    box.local_step = 30
    held = box.latest()
    assert held[1].staleness(box.local_step) == 2  # frozen at the bye: 12 - 10
    assert held[3].staleness(box.local_step) == 20  # still running: keeps ageing


def test_a_bye_for_another_step_freezes_nothing_and_a_newer_snapshot_undoes_it():
    box = mailbox()
    box.local_step = 5
    box.deliver(None, params(1, 40))
    box.deliver(None, bye(1, 41))  # its last snapshot is not the one we hold (lost, or a forged bye)
    box.local_step = 25
    assert box.latest()[1].staleness(25) == 20
    box.deliver(None, bye(3, 7))
    box.deliver(None, params(3, 8))  # it sends again: not finished after all
    box.link(3, up=False)
    time.sleep(0.1)
    assert box.dead() == {3}


def test_a_finished_neighbour_whose_connection_drops_is_not_dead():
    box = mailbox()
    box.deliver(None, params(1, 40))
    box.deliver(None, bye(1, 40))
    box.link(1, up=False)
    box.link(3, up=False)
    time.sleep(0.1)  # past peer_timeout
    assert box.dead() == {3}
    assert set(box.latest()) == {1}  # its final model stays in the mix


def test_a_restarted_neighbour_is_no_longer_finished():
    box = mailbox()
    box.deliver(None, encode(Header(kind="hello", sender=1)))
    box.deliver(None, params(1, 40))
    box.deliver(None, bye(1, 40))
    box.deliver(None, encode(Header(kind="hello", sender=1)))  # a new incarnation
    assert box.take_restarted() == {1}
    assert box.latest() == {}
    box.link(1, up=False)
    time.sleep(0.1)
    assert box.dead() == {1}


def test_a_bye_from_a_stranger_is_dropped():
    box = mailbox()
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, bye(2, 40))  # peer 2 is not our neighbour on the ring
    assert excinfo.value.reason == "not-neighbour"
    box.link(2, up=False)
    time.sleep(0.1)
    assert box.dead() == {2}
