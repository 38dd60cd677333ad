"""The mailboxes' rules: byes, header claims, hellos, welcomes, per-worker shares. Pure: frames built in memory,
liveness on a clock the test advances."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gossip.averagers.mailboxes import LatestMailbox, MassMailbox, PushSumMailbox, RoundMailbox
from gossip.coordinator.mailboxes import PER_WORKER, QueueMailbox
from gossip.errors import PeerFailed, PeerTimeout, ProtocolError
from gossip.liveness import CONFIRM_SECONDS
from gossip.net.wire import MAX_REASON_CHARS, Header, Layout, abort_header, encode, params_header, up_header
from gossip.progress import SwarmProgress
from tests.conftest import wait_until

CHUNK = 256
LAYOUT = Layout.describe([("w", (50,), "float32")], ["float32"], [50], CHUNK)
RING = {0: (1, 3), 1: (0, 2), 2: (1, 3), 3: (2, 0)}


class Clock:
    """A liveness clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def mailbox() -> LatestMailbox:
    box = LatestMailbox(0, 4, LAYOUT, lambda sender, round: sender in RING[0])
    box.peer_timeout = 0.05
    box.clock = Clock()
    return box


def params(sender: int, step: int) -> list:
    header = params_header("params", sender, LAYOUT, CHUNK, round=step, step=step)
    return encode(header, [torch.full((50,), float(step))])


def held(box, frames: list, connection: int | None = None) -> None:
    """Deliver a second hello that must be held for confirmation, not taken (nor its connection proven)."""
    with pytest.raises(ProtocolError) as raised:
        box.deliver(None, frames, connection=connection)
    assert raised.value.reason == "hello-held"


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
    box.clock.advance(0.1)
    assert box.dead() == {3}


def test_a_finished_neighbour_whose_connection_drops_is_not_dead():
    box = mailbox()
    box.deliver(None, params(1, 40))
    box.deliver(None, bye(1, 40))
    box.link(1, up=False)
    box.link(3, up=False)
    box.clock.advance(0.1)  # past peer_timeout
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
    box.clock.advance(0.1)
    assert box.dead() == {1}


def test_a_bye_from_a_stranger_is_dropped():
    box = mailbox()
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, bye(2, 40))  # peer 2 is not our neighbour on the ring
    assert excinfo.value.reason == "not-neighbour"
    box.link(2, up=False)
    box.clock.advance(0.1)
    assert box.dead() == {2}


# -- what a header may claim (the threat model: every number is bounded before it changes any state) --

def push_sum_box(max_rounds: int = 100) -> PushSumMailbox:
    box = PushSumMailbox(0, 4, LAYOUT, lambda sender, round: sender in RING[0], lambda sender, round: 1 / 3)
    box.max_rounds, box.max_weight = max_rounds, 4.0
    return box


def forged_params(sender: int, round: int, weight: float = 1.0, step_seconds: float = 0.0) -> list:
    header = params_header("params", sender, LAYOUT, CHUNK, round=round, step=round, weight=weight,
                           step_seconds=step_seconds)
    return encode(header, [torch.full((50,), 7.0)])


@pytest.mark.parametrize("weight", [4.5, 1e300, 1.7e308])
def test_a_weight_beyond_the_whole_networks_mass_is_dropped(weight):
    box = push_sum_box()
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, forged_params(1, 3, weight=weight))
    assert excinfo.value.reason == "weight"
    assert box.take_all() == {} and box.latest_round == {}
    box.deliver(None, forged_params(1, 3, weight=4.0))  # the network's whole mass is a possible weight
    assert box.take_all()[1].mass == pytest.approx(4.0 / 3)


def test_a_round_beyond_the_run_cannot_make_later_genuine_rounds_replays():
    box = push_sum_box(max_rounds=100)
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, forged_params(1, 10**9))
    assert excinfo.value.reason == "horizon"
    box.deliver(None, forged_params(1, 5))  # the genuine next message is still taken
    assert box.latest_round == {1: 5}


def refused(box, frames: list, connection: int, reason: str = "connection") -> None:
    with pytest.raises(ProtocolError) as raised:
        box.deliver(None, frames, connection=connection)
    assert raised.value.reason == reason


def test_a_message_at_the_horizon_over_a_strangers_connection_cannot_make_later_genuine_ones_replays():
    box = push_sum_box(max_rounds=100)
    box.deliver(None, forged_params(1, 3), connection=7)
    refused(box, forged_params(1, 100, weight=0.0), connection=9)  # massless, at the horizon: not peer 1's link
    refused(box, forged_params(1, 101, weight=0.0), connection=9)
    box.deliver(None, forged_params(1, 4), connection=7)  # peer 1's next genuine message is taken
    assert box.latest_round == {1: 4} and box.liveness.foreign == {1: 2}
    box.connection_closed(7)  # its link dropped: it reconnects, and the new connection speaks for it
    box.deliver(None, forged_params(1, 5), connection=11)
    refused(box, forged_params(1, 6), connection=7)  # (a closed connection is nobody's again)
    assert box.latest_round == {1: 5}


def test_a_stop_or_a_restart_in_a_live_senders_name_over_another_connection_changes_nothing():
    box = mailbox()
    box.deliver(None, params(1, 3), connection=7)
    refused(box, params(1, 800), connection=9)  # a step at the horizon would make peer 1's next ones replays
    refused(box, bye(1, 3), connection=9)
    refused(box, encode(Header(kind="welcome", sender=1, round=90, step=90)), connection=9)
    box.deliver(None, params(1, 4), connection=7)
    assert box.latest()[1].message.header.step == 4 and box.dead() == set()


def test_on_a_directed_graph_a_hello_over_a_second_connection_is_held_though_we_never_dialed_the_sender():
    box = push_sum_box()  # peer 1 sends to us; we never dial it, so no link to it is ever reported
    box.deliver(None, encode(Header(kind="hello", sender=1)), connection=7)
    box.deliver(None, forged_params(1, 3), connection=7)
    held(box, encode(Header(kind="hello", sender=1)), connection=9)  # forged: peer 1's connection 7 is open
    assert box.take_restarted() == set()
    held(box, encode(Header(kind="hello", sender=1)), connection=12)  # a real restart: its hello, then...
    box.connection_closed(7)  # ...the close of its old process's connection
    assert box.take_restarted() == {1}


def test_the_server_neither_queues_nor_answers_a_workers_hello_over_another_connection():
    box = QueueMailbox(4, 5, LAYOUT, lambda sender, round: sender < 4, capacity=16, contribution="grad")
    grad = encode(params_header("grad", 0, LAYOUT, CHUNK), [torch.zeros(50)])
    box.deliver(None, encode(Header(kind="hello", sender=0)), connection=3)
    box.deliver(None, grad, connection=3)
    for _ in range(2 * PER_WORKER):  # a flood of hellos and byes in worker 0's name: not one takes its share
        held(box, encode(Header(kind="hello", sender=0)), connection=5)
        refused(box, encode(Header(kind="bye", sender=0, step=1)), connection=5)
    box.deliver(None, encode(Header(kind="hello", sender=0)), connection=3)  # its own "are you alive?"
    assert [box.get(0).header.kind for _ in range(3)] == ["hello", "grad", "hello"] and box.get(0) is None


def test_a_stranger_that_spoke_first_for_a_peer_is_named_when_we_give_up_waiting_for_that_peer():
    box = push_sum_box()
    box.deliver(None, encode(Header(kind="hello", sender=1)), connection=9)  # before peer 1 ever connected
    held(box, encode(Header(kind="hello", sender=1)), connection=7)  # peer 1's own: its name is taken
    refused(box, forged_params(1, 0), connection=7)
    with pytest.raises(PeerTimeout, match=r"for their last messages \(--round-timeout\); 1 message\(s\) in the name "
                                          r"of peer\(s\) 1 were refused .* \(run with --secure\)$"):
        box.wait_counts({1: 1}, idle_timeout=0.05)


def test_a_rejected_message_reports_no_pace():
    box = push_sum_box()
    box.deliver(None, forged_params(1, 5, step_seconds=0.1))
    with pytest.raises(ProtocolError):
        box.deliver(None, forged_params(1, 5, step_seconds=99.0))  # a replay of round 5 with a forged pace
    assert box.reported[1].step_seconds == 0.1


def test_a_second_hello_is_a_restart_only_with_the_drop_of_our_link():
    box = push_sum_box()
    box.link(1, up=True)
    box.deliver(None, encode(Header(kind="hello", sender=1)))
    held(box, encode(Header(kind="hello", sender=1)))  # forged: our link to peer 1 never dropped
    assert box.take_restarted() == set() and box.dead() == set()
    box.link(1, up=False)  # ...unless the drop is reported just after it, as when it really restarted
    assert box.take_restarted() == {1}
    box.link(1, up=True)
    box.link(1, up=False)  # a real restart: the old process's connection closes, then the new one says hello
    box.deliver(None, encode(Header(kind="hello", sender=1)))
    assert box.take_restarted() == {1}


def test_a_forged_hello_is_forgotten_once_the_confirmation_window_has_passed():
    box = push_sum_box()
    box.clock = Clock()
    box.link(1, up=True)
    box.deliver(None, encode(Header(kind="hello", sender=1)))
    held(box, encode(Header(kind="hello", sender=1)))  # forged
    box.clock.advance(CONFIRM_SECONDS + 0.01)
    box.link(1, up=False)  # a drop this much later is not the restart the hello announced
    assert box.take_restarted() == set()


def test_a_hello_is_a_restart_only_once_the_connection_of_the_senders_last_message_closed():
    box = push_sum_box()
    box.clock = Clock()
    box.link(1, up=True)
    hello = encode(Header(kind="hello", sender=1))
    box.deliver(None, hello, connection=7)
    box.deliver(None, forged_params(1, 3), connection=7)
    box.link(1, up=False)  # our link to peer 1 flaps: not a restart, and no licence for a later hello
    box.link(1, up=True)
    box.deliver(None, hello, connection=7)  # over its own live connection: the same process
    held(box, hello, connection=9)  # forged, from a stranger's connection, while 7 is open
    box.clock.advance(CONFIRM_SECONDS + 0.01)
    box.connection_closed(9)
    box.connection_closed(7)  # ...and 7 closing this much later does not make it true
    assert box.take_restarted() == set() and box.dead() == set()
    box.deliver(None, forged_params(1, 4), connection=11)  # peer 1 reconnected (its link was cut)
    held(box, hello, connection=12)  # a real restart: the new process's hello, then the old one's close
    box.connection_closed(11)
    assert box.take_restarted() == {1}
    box.deliver(None, forged_params(1, 0), connection=12)  # the new incarnation counts rounds afresh
    box.connection_closed(13)
    held(box, hello, connection=14)  # its connection 12 is open: a forged hello again
    box.link(1, up=False)  # a drop of our link does not confirm it either
    assert box.take_restarted() == set()


def test_a_welcome_counts_only_while_we_rejoin_and_only_when_it_answers_our_hello():
    box = push_sum_box()
    welcome = encode(Header(kind="welcome", sender=1, round=5, step=5, nonce=box.rejoin.nonce))
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, welcome)
    assert excinfo.value.reason == "welcome" and box.rejoin.first == {}
    box.rejoin.rejoining = True
    for guess in (0, box.rejoin.nonce - 1, box.rejoin.nonce + 1):  # one who never read our hello can only guess its nonce
        with pytest.raises(ProtocolError) as excinfo:
            box.deliver(None, encode(Header(kind="welcome", sender=1, round=90, step=90, nonce=guess)))
        assert excinfo.value.reason == "welcome-nonce"
    box.deliver(None, welcome)
    assert box.rejoin.first[1].round == 5


def test_after_a_rejoin_a_late_welcome_is_served_while_we_wait_and_one_from_a_later_round_is_not_waited_for():
    """On a time-varying graph a restarted peer waits for its first round's neighbours' welcomes only (peer 1,
    round 5, where it goes on). Peer 2 welcomes it later, in round 3: it waits for our rounds 3 and 4, so its
    welcome must reach the averager (``serve``) while we wait for round 5. Peer 3 welcomes it in round 7:
    it sent us nothing for round 5, and round 5 must not wait for it."""
    box = RoundMailbox(0, 4, LAYOUT, lambda sender, round: True, window=4)
    box.anchored = False
    box.rejoin.rejoining = True
    box.deliver(None, encode(Header(kind="welcome", sender=1, round=5, step=5, nonce=box.rejoin.nonce)))
    box.end_rejoin_wait({1}, late=True)
    box.anchor(5)
    served: list[dict] = []
    outcome: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: outcome.setdefault(
        "messages", box.wait_round(5, (1, 2, 3), timeout=30, serve=served.append)))
    waiter.start()
    box.deliver(None, params(1, 5))
    box.deliver(None, encode(Header(kind="welcome", sender=2, round=3, step=3, nonce=box.rejoin.nonce)))
    wait_until(lambda: served, 10, "the late welcome served")
    assert [{j: h.round for j, h in late.items()} for late in served] == [{2: 3}]
    box.deliver(None, params(2, 4))  # sent after re-admitting us, for a round we skipped: dropped quietly
    box.deliver(None, encode(Header(kind="welcome", sender=3, round=7, step=7, nonce=box.rejoin.nonce)))
    assert waiter.is_alive()  # still waiting for peer 2's round 5
    box.deliver(None, params(2, 5))
    waiter.join(10)
    assert not waiter.is_alive() and sorted(outcome["messages"]) == [1, 2]
    with pytest.raises(ProtocolError) as excinfo:  # peer 3 re-admitted us in round 7: its round 4 is no such one
        box.deliver(None, params(3, 4))
    assert excinfo.value.reason == "stale-round"


def test_a_welcome_that_answers_our_hello_takes_its_senders_name_back_from_a_stranger_that_spoke_first():
    box = push_sum_box()  # a new incarnation, rejoining: it has heard nobody yet
    box.rejoin.rejoining = True
    box.deliver(None, encode(Header(kind="hello", sender=1)), connection=9)  # a stranger is quicker than peer 1
    refused(box, forged_params(1, 3), connection=7)  # peer 1's connection is not the one that spoke first...
    box.deliver(None, encode(Header(kind="welcome", sender=1, round=5, step=5, nonce=box.rejoin.nonce)), connection=7)
    assert box.rejoin.first[1].round == 5  # ...but its welcome proves it: only who read our hello knows the nonce
    box.deliver(None, forged_params(1, 6), connection=7)
    refused(box, forged_params(1, 7), connection=9)  # and the stranger's connection speaks for nobody now


def test_a_welcome_echoes_the_nonce_of_the_hello_it_answers_and_each_incarnation_draws_its_own():
    box, other = push_sum_box(), push_sum_box()
    assert 0 < box.rejoin.nonce < 1 << 53 and box.rejoin.nonce != other.rejoin.nonce
    assert box.nonce_of(1) == 0
    box.deliver(None, encode(Header(kind="hello", sender=1, nonce=other.rejoin.nonce)), connection=7)
    assert box.nonce_of(1) == other.rejoin.nonce
    held(box, encode(Header(kind="hello", sender=1, nonce=12345)), connection=9)  # a stranger's: not taken
    assert box.nonce_of(1) == other.rejoin.nonce
    box.connection_closed(7)  # peer 1 restarted: its new incarnation's hello came first, its old connection closed
    assert box.take_restarted() == {1} and box.nonce_of(1) == 12345


def test_one_flooding_worker_cannot_crowd_out_the_others_at_the_server():
    box = QueueMailbox(4, 5, LAYOUT, lambda sender, round: sender < 4, capacity=16, contribution="grad")
    grad = lambda sender: encode(params_header("grad", sender, LAYOUT, CHUNK), [torch.zeros(50)])  # noqa: E731
    for _ in range(PER_WORKER):
        box.deliver(None, grad(0))
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, grad(0))
    assert excinfo.value.reason == "flood"
    for worker in (1, 2, 3):
        box.deliver(None, grad(worker))  # the honest workers' gradients still get in
    assert [box.get(0).header.sender for _ in range(PER_WORKER + 3)] == [0] * PER_WORKER + [1, 2, 3]


def acknowledgement(sender: int, rounds: int) -> list:
    return encode(Header(kind="bye-ack", sender=sender, round=rounds, step=rounds))


def test_a_forged_bye_is_undone_by_its_senders_next_message_and_no_mass_is_refused():
    box = push_sum_box()
    box.deliver(None, forged_params(1, 3))
    box.deliver(None, bye(1, 9))  # a stranger says peer 1 finished after 9 rounds; peer 1 trains on
    assert box.bye_rounds == {1: 9}
    box.deliver(None, forged_params(1, 4, weight=2.0))  # peer 1's next message: a bye is a sender's last word
    assert box.bye_rounds == {} and box.forged_byes == 1
    assert box.take_all()[1].mass == pytest.approx((1.0 + 2.0) / 3)  # both messages' mass, none refused
    box.deliver(None, bye(1, 5))  # its genuine bye later: one past the last round it sent
    assert box.bye_rounds == {1: 5} and box.forged_byes == 1


def test_a_bye_ack_counts_only_once_we_said_bye():
    box = push_sum_box()
    box.deliver(None, forged_params(3, 2))
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, acknowledgement(3, 3))  # an answer to a bye we never said
    assert excinfo.value.reason == "bye-ack" and box.bye_rounds == {}
    assert box.take_contradicted() == {3} and box.take_contradicted() == set()  # peer 3 gets a message next
    box.draining = True
    box.deliver(None, acknowledgement(3, 3))
    assert box.bye_rounds == {3: 3}
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, acknowledgement(3, 4))
    assert excinfo.value.reason == "after-bye" and box.bye_rounds == {3: 3}


def test_a_genuine_bye_replaces_a_forged_one_that_claims_more_rounds():
    box = push_sum_box()
    box.deliver(None, forged_params(1, 3))
    box.deliver(None, bye(1, 60))  # forged: peer 1 sends nothing more before its own bye (flow control)
    with pytest.raises(ProtocolError) as excinfo:
        box.deliver(None, bye(1, 70))  # another count that is not what arrived
    assert excinfo.value.reason == "after-bye"
    box.deliver(None, bye(1, 4))  # peer 1's own: one past round 3, the last it sent us
    assert box.bye_rounds == {1: 4}


def test_a_delivery_wakes_a_waiter_without_a_predicate_even_when_a_predicate_waiter_still_misses_one():
    """A delivery wakes the waiters only when one of them misses nothing any more, judged by the predicates
    they registered; a wait that registered none (``wait_for``, its deadlines) is woken by every delivery,
    whatever another thread still misses."""
    box = MassMailbox(0, 4, LAYOUT, lambda sender, round: sender in RING[0], lambda sender, round: 0.5)
    outcome: dict[str, object] = {}
    hellos = threading.Thread(target=lambda: outcome.setdefault("hellos", box.wait_hellos({1, 3}, timeout=30)))
    late = threading.Thread(target=lambda: outcome.setdefault(
        "late", box.wait_for(0, {1: time.monotonic() + 30})))
    hellos.start()
    late.start()
    wait_until(lambda: box._waiting and box._blind, 10, "both threads waiting")
    box.deliver(None, params(1, 0))  # round 0 from peer 1: what wait_for waits for; no hello from 3 yet
    late.join(10)
    assert not late.is_alive() and outcome["late"] == set()
    assert hellos.is_alive()  # still missing peer 3's hello
    box.deliver(None, encode(Header(kind="hello", sender=3)))
    hellos.join(10)
    assert not hellos.is_alive() and outcome["hellos"] is None


def abort(sender: int, reason: str) -> list:
    return encode(abort_header(sender, reason))


def test_an_abort_over_the_senders_own_connection_stops_us_at_once_with_its_reason():
    box = mailbox()
    box.deliver(None, params(1, 3), connection=7)
    box.deliver(None, abort(1, "peer 1 diverged: its weights hold NaN or Inf after step 4; lower the learning rate"),
                connection=7)
    with pytest.raises(PeerFailed, match=r"^peer 1 diverged: its weights hold NaN or Inf after step 4"):
        box.raise_if_stopped()


def test_a_forged_abort_is_held_and_undone_by_its_named_senders_next_message():
    box = mailbox()
    box.deliver(None, params(1, 3), connection=7)
    box.deliver(None, abort(1, "forged"), connection=8)  # another connection than peer 1's: not believed
    box.raise_if_stopped({1})  # nothing yet, even waiting for peer 1
    box.clock.advance(1.0)  # past peer_timeout: held against a peer 1 that stays silent while we wait for it...
    box.raise_if_stopped({3})  # ...but not while we wait only for others
    with pytest.raises(PeerFailed, match="^forged$"):
        box.raise_if_stopped({1})
    box.deliver(None, params(1, 4), connection=7)  # peer 1 speaks: it did not stop
    box.raise_if_stopped({1})
    box.link(1, True)  # a live link to the peer named: a forgery, however long the peer is silent
    box.deliver(None, abort(1, "forged again"), connection=8)
    box.clock.advance(10.0)
    box.raise_if_stopped({1})


def test_a_model_layout_unlike_ours_stops_us_naming_both_layouts_once_its_connection_is_known():
    other = Layout.describe([("w", (60,), "float32")], ["float32"], [60], CHUNK)
    box = mailbox()
    box.deliver(None, encode(Header(kind="hello", sender=3)), connection=5)
    theirs = encode(params_header("params", 3, other, CHUNK, round=1, step=1), [torch.zeros(60)])
    with pytest.raises(ProtocolError, match="has model layout"):
        box.deliver(None, theirs, connection=5)  # dropped as ever, and remembered
    with pytest.raises(PeerFailed) as raised:
        box.raise_if_stopped()
    assert str(raised.value) == (f"the peers' models differ: peer 3's has layout {other.fingerprint}, peer 0's "
                                 f"{LAYOUT.fingerprint}; every peer must build the same model")


def test_an_abort_reason_is_one_printable_ascii_line_of_bounded_length():
    header = abort_header(2, "bad\nline\x1b[31m é" + "x" * 1000)
    assert header.reason.isascii() and header.reason.isprintable() and len(header.reason) <= MAX_REASON_CHARS
    assert header.reason.startswith("bad line")
    with pytest.raises(ProtocolError, match="'why'"):
        mailbox().deliver(None, encode(Header(kind="abort", sender=1, reason="\x1b[2J")))
    with pytest.raises(ProtocolError, match="lacks a reason"):
        mailbox().deliver(None, encode(Header(kind="abort", sender=1)))
    with pytest.raises(ProtocolError, match="carries a reason"):
        mailbox().deliver(None, encode(Header(kind="bye", sender=1, reason="hello")))


@pytest.mark.parametrize("rule", ["latest", "push-sum"])
def test_the_asynchronous_mailboxes_learn_who_has_started_and_a_waiter_wakes_when_that_grows(rule):
    """gossip-async's start: a hello, any message, an "up"'s flags and a step in a header's vector each say
    a peer is up; an "up" files nothing, reports no pace and claims no step."""
    expects = lambda sender, round: sender in (1, 5)  # noqa: E731
    box = (LatestMailbox(0, 6, LAYOUT, expects) if rule == "latest"
           else PushSumMailbox(0, 6, LAYOUT, expects, lambda sender, round: 1 / 3))
    box.progress = SwarmProgress(6, rank=0)
    box.deliver(None, encode(Header(kind="hello", sender=1)))
    assert box.progress.started() == {0, 1}
    grown = []
    waiter = threading.Thread(target=lambda: grown.append(box.wait_started(2, timeout=20)))
    waiter.start()
    box.deliver(None, encode(up_header(1, [2, 3], world_size=6)))
    waiter.join(20)
    assert grown == [set()] and box.progress.started() == {0, 1, 2, 3}
    assert box.reported == {} and box.progress.vector() == (0,) * 6
    header = params_header("params", 5, LAYOUT, CHUNK, round=1, step=1, progress=(0, 0, 0, 0, 7, 1))
    box.deliver(None, encode(header, [torch.ones(50)]))
    assert box.progress.started() == {0, 1, 2, 3, 4, 5}
    assert box.wait_started(5, timeout=0.01) == set()
    box.progress = SwarmProgress(6, rank=0)
    assert box.wait_started(1, timeout=0.01) == {1, 2, 3, 4, 5}  # nothing came: who is still missing
