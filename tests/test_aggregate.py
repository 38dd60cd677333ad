"""Robust aggregation: the trim rule, exact small cases, the properties that make it robust, and the
fault injection it is measured with."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gossip
import gossip.aggregate as agg
from gossip.aggregate import aggregate, aggregate_into_, sorted_rows, trim_count
from gossip.averagers.latest import LatestGossip
from gossip.averagers.neighbours import byzantine_garbage
from gossip.config import GossipConfig
from gossip.flat import FlatParams
from gossip.net.wire import decode, encode, params_header
from tests.conftest import endpoints, run_peers, vector_model

ROBUST = ("median", "trimmed-mean")
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@st.composite
def value_sets(draw, min_inputs: int = 3):
    """n >= min_inputs tensors of one shape, as float32."""
    n = draw(st.integers(min_inputs, 9))
    m = draw(st.integers(1, 6))
    rows = draw(st.lists(st.lists(finite, min_size=m, max_size=m), min_size=n, max_size=n))
    return [torch.tensor(row, dtype=torch.float32) for row in rows]


@pytest.mark.parametrize("n,rule,fraction,trim", [
    (1, "median", 0.2, 0), (2, "median", 0.2, 0), (3, "median", 0.2, 1), (4, "median", 0.2, 1),
    (5, "median", 0.2, 2), (6, "median", 0.2, 2), (3, "trimmed-mean", 0.2, 1), (4, "trimmed-mean", 0.2, 1),
    (5, "trimmed-mean", 0.2, 1), (10, "trimmed-mean", 0.2, 2), (9, "trimmed-mean", 0.2, 1),
    (9, "trimmed-mean", 0.49, 4), (7, "trimmed-mean", 0.01, 1), (5, "mean", 0.2, 0),
])
def test_trim_count(n, rule, fraction, trim):
    assert trim_count(n, rule, fraction) == trim


def test_trim_count_names_the_choices_for_an_unknown_rule():
    with pytest.raises(ValueError, match="choose one of: mean, median, trimmed-mean"):
        trim_count(3, "mode", 0.2)


def test_small_cases_by_hand():
    rows = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, -1.0]), torch.tensor([2.0, 100.0]), torch.tensor([10.0, 0.0])]
    assert aggregate(rows[:3], 1).tolist() == [2.0, 5.0]  # median of 3
    assert aggregate(rows, 1).tolist() == [2.5, 2.5]  # median of 4: the mean of the two middle values
    assert aggregate(rows, 0).tolist() == [4.0, 26.0]  # trim 0 is the mean
    five = [torch.tensor([float(v)]) for v in (7, 1, 3, 9, 5)]
    assert aggregate(five, 1).tolist() == [5.0]  # trimmed mean of 3, 5, 7
    with pytest.raises(ValueError, match="cannot drop 2 of 4"):
        aggregate(rows, 2)


def test_the_sorting_network_and_torch_sort_agree(monkeypatch):
    rows = list(torch.randn(9, 1000, generator=torch.Generator().manual_seed(0)))
    expected = torch.stack(rows).sort(dim=0).values
    assert all(torch.equal(a, b) for a, b in zip(sorted_rows(rows), expected))
    monkeypatch.setattr(agg, "NETWORK_MAX", 4)  # the torch.sort path
    assert all(torch.equal(a, b) for a, b in zip(sorted_rows(rows), expected))


@settings(max_examples=200, deadline=None)
@given(value_sets(), st.sampled_from(ROBUST), st.randoms(use_true_random=False))
def test_permutation_invariant(rows, rule, rng):
    trim = trim_count(len(rows), rule, 0.2)
    shuffled = rows[:]
    rng.shuffle(shuffled)
    assert torch.equal(aggregate(rows, trim), aggregate(shuffled, trim))


@settings(max_examples=200, deadline=None)
@given(value_sets(min_inputs=1), st.sampled_from(ROBUST), st.floats(0.01, 0.49))
def test_within_the_range_of_the_inputs(rows, rule, fraction):
    result = aggregate(rows, trim_count(len(rows), rule, fraction))
    stacked = torch.stack(rows)
    assert bool((stacked.min(dim=0).values <= result).all() and (result <= stacked.max(dim=0).values).all())


@settings(max_examples=100, deadline=None)
@given(st.lists(finite, min_size=1, max_size=6), st.integers(1, 9), st.sampled_from(ROBUST))
def test_equal_inputs_give_that_value_exactly(row, n, rule):
    value = torch.tensor(row, dtype=torch.float32)
    assert torch.equal(aggregate([value.clone() for _ in range(n)], trim_count(n, rule, 0.2)), value)


@settings(max_examples=300, deadline=None)
@given(value_sets(), st.sampled_from(ROBUST), st.sampled_from([1e30, -1e30]), st.data())
def test_one_input_at_1e30_moves_the_result_no_more_than_the_honest_spread(rows, rule, garbage, data):
    """Replace one of n >= 3 inputs by +-1e30: the result stays within the range of the honest inputs, so it
    moves by at most their spread (max - min per coordinate); also when the garbage is an extra input."""
    n = len(rows)
    honest = torch.stack(rows)
    spread = honest.max(dim=0).values - honest.min(dim=0).values
    before = aggregate(rows, trim_count(n, rule, 0.2))
    bad = data.draw(st.integers(0, n - 1))
    poisoned = rows[:bad] + [torch.full_like(rows[0], garbage)] + rows[bad + 1:]
    after = aggregate(poisoned, trim_count(n, rule, 0.2))
    assert bool(((after - before).abs() <= spread).all())
    extra = aggregate(rows + [torch.full_like(rows[0], garbage)], trim_count(n + 1, rule, 0.2))
    assert bool(((extra - before).abs() <= spread).all())


def test_aggregate_into_works_chunk_by_chunk_in_blocks(monkeypatch):
    monkeypatch.setattr(agg, "BLOCK_BYTES", 64)  # 16 float32 per block: many blocks, and a ragged last one
    gen = torch.Generator().manual_seed(1)
    models = [[torch.randn(100, generator=gen), torch.randn(37, generator=gen)] for _ in range(3)]
    own = [c.clone() for c in models[0]]
    moved_on = [c + 1.0 for c in own]  # local progress made during the exchange
    aggregate_into_(moved_on, [own, *models[1:]], "median", 0.2, relative_to=own)
    for k in range(2):
        median = torch.stack([m[k] for m in models]).median(dim=0).values  # odd n: the middle value
        torch.testing.assert_close(moved_on[k], median + 1.0)  # the aggregate's change, progress kept
    target = [c.clone() for c in models[0]]
    aggregate_into_(target, [target, *models[1:]], "median", 0.2)  # in place: the target is an input
    for k in range(2):
        assert torch.equal(target[k], torch.stack([m[k] for m in models]).median(dim=0).values)


@pytest.mark.parametrize("rule", ROBUST)
def test_one_two_and_three_inputs(rule):
    """1 input: the own model. 2: their mean (nothing to outvote; keeping the own model would switch mixing
    off at a peer left with one live neighbour). 3: the median, the outlier outvoted."""
    own, other, far = torch.tensor([1.0, 4.0]), torch.tensor([3.0, 0.0]), torch.tensor([1e30, -1e30])
    for models, expected in (([own], [1.0, 4.0]), ([own, other], [2.0, 2.0]), ([own, other, far], [3.0, 0.0])):
        target = [own.clone()]
        aggregate_into_(target, [[m] for m in models], rule, 0.2)
        assert target[0].tolist() == expected, (len(models), target[0])
    moved_on = [own + 0.5]  # gossip-sync: the change the aggregate makes to the snapshot, progress kept
    aggregate_into_(moved_on, [[own], [other]], rule, 0.2, relative_to=[own])
    assert moved_on[0].tolist() == [2.5, 2.5]


def ring_run(start: list[float], rule: str, massless: int | None = None) -> list[float]:
    """One gossip-sync round of 4 peers on a ring in this process (loopback): the model of each peer after
    it; peer ``massless`` claims push-sum weight 0 in its message."""
    eps = endpoints(4)

    def peer(rank: int) -> float:
        model = vector_model(torch.full((3,), start[rank], dtype=torch.float64))
        with gossip.attach(model, rank=rank, world_size=4, endpoints=tuple(eps), topology="ring",
                           aggregate=rule) as averager:
            if rank == massless:
                send = averager._send_snapshot
                averager._send_snapshot = lambda *args, **kwargs: send(*args, **{**kwargs, "weight": 0.0})
            averager.step()  # round 0 is sent; close() mixes it
        assert model.value.unique().numel() == 1
        return float(model.value[0])

    return run_peers(4, peer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", ROBUST)
def test_a_neighbour_claiming_weight_0_does_not_switch_mixing_off(rule):
    """A header's weight is a claim: under a robust rule every input counts once, so peer 2's weight 0
    changes nothing (it used to be left out, leaving peers 1 and 3 with 2 inputs: no mixing at all)."""
    start = [0.0, 10.0, 1.0, 5.0]
    expected = [5.0, 1.0, 5.0, 1.0]  # the median of each peer and its two ring neighbours
    assert ring_run(start, rule) == expected
    assert ring_run(start, rule, massless=2) == expected


class HeldSnapshot:
    """What ``LatestMailbox.latest()`` holds for one neighbour: a fresh snapshot of round 0."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.message = SimpleNamespace(header=SimpleNamespace(round=0), chunks=chunks)

    def staleness(self, step: int) -> int:
        return 0


def async_peer(own: float, held: dict[int, float], dead: set[int]) -> LatestGossip:
    """Peer 0 of a 4-peer ring in gossip-async with --aggregate median, without sockets."""
    config = GossipConfig.of(world_size=4, mode="gossip-async", async_rule="latest", aggregate="median")
    flat = FlatParams(vector_model(torch.full((3,), own, dtype=torch.float64)), 1 << 16)
    peer = LatestGossip.__new__(LatestGossip)  # no sockets: _mix_latest reads only what is set here
    snapshots = {j: HeldSnapshot([torch.full((3,), v, dtype=torch.float64)]) for j, v in held.items()}
    peer.__dict__.update(config=config, flat=flat, rank=0, rounds=0, local_step=1, dead=set(dead),
                         staleness=Counter(), ignored_stale=0, last_mix={}, mix_seconds=0.0,
                         topology=config.build_topology(), mailbox=SimpleNamespace(latest=lambda: snapshots))
    return peer


def value(peer: LatestGossip) -> float:
    return float(list(peer.flat.views())[0][0])


def test_gossip_async_waits_for_3_inputs_while_2_neighbours_live_and_then_mixes_with_what_it_has():
    """One fresh snapshot held, both ring neighbours alive: a race or a slow neighbour, so the peer waits for
    the other instead of trusting one alone (it may be garbage). Its other neighbour dead: it mixes with the
    one it has, instead of never mixing again."""
    racing = async_peer(0.0, {1: 1e30}, dead=set())
    assert racing._mix_latest() is None and value(racing) == 0.0
    alone = async_peer(0.0, {1: 4.0}, dead={3})
    alone._mix_latest()
    assert value(alone) == 2.0  # the mean of its own model and the one neighbour's
    both = async_peer(0.0, {1: 4.0, 3: 1e30}, dead=set())
    both._mix_latest()
    assert value(both) == 4.0  # the median of 3: the garbage outvoted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_byzantine_garbage_passes_every_wire_check(dtype):
    """The fault injection must get through validation, so that only aggregation can stop it."""
    flat = FlatParams(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3)).to(dtype), 256)
    snapshot = flat.snapshot()
    garbage = byzantine_garbage(snapshot, 1e30, seed=7)
    message = decode(encode(params_header("params", 1, flat.layout, flat.chunk_bytes), garbage), flat.layout, 4)
    largest = min(1e30, torch.finfo(dtype).max / 10)
    for got, sent in zip(message.chunks, snapshot):
        assert got.dtype == dtype and bool(torch.isfinite(got).all())
        assert float(got.abs().max()) > largest / 4 and float(got.abs().max()) <= largest * 1.01
        assert not torch.equal(got, sent)
    assert all(torch.equal(a, b) for a, b in zip(garbage, byzantine_garbage(snapshot, 1e30, seed=7)))  # seeded
