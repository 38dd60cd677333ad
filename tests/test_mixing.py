"""Mixing coefficients of asynchronous gossip: staleness factors, cut-off and renormalisation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.errors import ConfigError
from gossip.staleness import normalise, stale_weights, staleness_factor

TAUS = [0, 1, 2, 3, 7, 50]


@pytest.mark.parametrize("tau", TAUS)
def test_none_ignores_staleness(tau):
    assert staleness_factor("none", tau, 4.0) == 1.0


@pytest.mark.parametrize("tau,expected", [(0, 1.0), (1, 0.5), (3, 0.25), (7, 0.125), (99, 0.01)])
def test_inverse_is_one_over_one_plus_tau(tau, expected):
    assert staleness_factor("inverse", tau, 4.0) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("tau,temperature,expected", [
    (0, 4.0, 1.0), (4, 4.0, math.exp(-1)), (2, 4.0, math.exp(-0.5)), (3, 1.0, math.exp(-3)), (10, 0.5, math.exp(-20)),
])
def test_exp_is_exp_of_minus_tau_over_temperature(tau, temperature, expected):
    assert staleness_factor("exp", tau, temperature) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("kind", ["none", "inverse", "exp"])
def test_negative_staleness_raises(kind):
    with pytest.raises(ValueError, match="negative"):
        staleness_factor(kind, -1, 4.0)


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="none, inverse, exp"):
        staleness_factor("linear", 1, 4.0)


def test_three_neighbours_by_hand():
    # raw: 1 -> 0.2 * 1/(1+0) = 0.2; 2 -> 0.2 * 1/(1+2) = 0.2/3; 3 is too stale (5 > 4).
    # total = 0.4 + 0.2 + 0.2/3 = 2/3, so self = 0.6, 1 = 0.3, 2 = 0.1.
    self_coef, coefs = stale_weights(0.4, {1: (0.2, 0), 2: (0.2, 2), 3: (0.2, 5)}, "inverse", 4.0, 4)
    assert self_coef == pytest.approx(0.6)
    assert coefs.keys() == {1, 2}
    assert coefs[1] == pytest.approx(0.3) and coefs[2] == pytest.approx(0.1)


def test_exp_example_by_hand():
    self_coef, coefs = stale_weights(0.5, {7: (0.25, 0), 8: (0.25, 2)}, "exp", 2.0, 20)
    total = 0.5 + 0.25 + 0.25 * math.exp(-1)
    assert self_coef == pytest.approx(0.5 / total)
    assert coefs == pytest.approx({7: 0.25 / total, 8: 0.25 * math.exp(-1) / total})


def test_coefficients_sum_to_one():
    self_coef, coefs = stale_weights(1 / 3, {1: (1 / 3, 3), 2: (1 / 3, 1)}, "inverse", 4.0, 20)
    assert self_coef + sum(coefs.values()) == pytest.approx(1.0)
    assert self_coef > coefs[2] > coefs[1] > 0  # fresher counts more


def test_cut_off_keeps_tau_equal_to_max_and_drops_max_plus_one():
    _, coefs = stale_weights(0.5, {1: (0.25, 6), 2: (0.25, 7)}, "none", 4.0, 6)
    assert coefs == pytest.approx({1: 0.25 / 0.75})


def test_everything_too_stale_leaves_only_self():
    assert stale_weights(0.3, {1: (0.35, 9), 2: (0.35, 10)}, "none", 4.0, 8) == (1.0, {})


def test_neighbours_with_zero_weight_are_dropped():
    self_coef, coefs = stale_weights(0.5, {1: (0.0, 0), 2: (0.5, 0)}, "none", 4.0, 20)
    assert coefs.keys() == {2} and self_coef == pytest.approx(0.5)


def test_none_reproduces_the_mixing_row():
    row = {1: (0.25, 3), 2: (0.25, 11)}
    self_coef, coefs = stale_weights(0.5, row, "none", 4.0, 20)
    assert self_coef == pytest.approx(0.5) and coefs == pytest.approx({1: 0.25, 2: 0.25})


@pytest.mark.parametrize("self_weight,weights", [(0.0, {}), (0.0, {1: 0.0}), (-1.0, {1: 0.5}), (math.nan, {1: 1.0}),
                                                 (-0.5, {1: 2.0}), (0.5, {1: -0.1})])
def test_normalise_rejects_a_non_positive_self_weight_or_negative_weights(self_weight, weights):
    with pytest.raises(ValueError, match="non-negative with a positive self weight"):
        normalise(self_weight, weights)


def test_normalise_scales_to_one():
    self_coef, coefs = normalise(2.0, {4: 1.0, 5: 1.0})
    assert self_coef == pytest.approx(0.5) and coefs == pytest.approx({4: 0.25, 5: 0.25})


@settings(max_examples=200, deadline=None)
@given(self_weight=st.floats(1e-6, 1.0),
       neighbours=st.dictionaries(st.integers(0, 64), st.tuples(st.floats(0.0, 1.0), st.integers(0, 100)), max_size=8),
       kind=st.sampled_from(["none", "inverse", "exp"]),
       temperature=st.floats(0.01, 1000.0),
       max_staleness=st.integers(0, 100))
def test_coefficients_are_non_negative_and_sum_to_one(self_weight, neighbours, kind, temperature, max_staleness):
    self_coef, coefs = stale_weights(self_weight, neighbours, kind, temperature, max_staleness)
    assert 0 < self_coef <= 1
    assert all(c >= 0 for c in coefs.values())
    assert self_coef + sum(coefs.values()) == pytest.approx(1.0, rel=1e-12)
    assert coefs.keys() == {j for j, (w, tau) in neighbours.items() if w > 0 and tau <= max_staleness}
