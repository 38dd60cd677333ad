"""Partner choice by speed class: every round is still a connected regular graph with symmetric, doubly
stochastic weights, every peer derives the same graph, and partners of the same class are preferred."""

from __future__ import annotations

import numpy as np
import pytest

import topologies
from gossip.config import GossipConfig
from gossip.errors import ConfigError
from topologies import ConfigError as TopologyConfigError

CASES = [((1, 1, 1, 1, 0.25, 0.25, 0.25, 0.25), 3), ((1,) * 7 + (0.25,), 3),
         ((1, 1, 0.5, 0.5, 0.25, 0.25, 1, 1, 1, 1, 0.5, 0.5, 1, 1, 1, 1), 4), ((1, 0.5, 0.25, 1, 0.5, 0.25), 2)]
ROUNDS = range(60)


def similar(speeds, degree):
    base = topologies.build(f"random:degree={degree},seed=3", len(speeds))
    return topologies.prefer_similar(base, topologies.speed_classes(speeds))


def test_speed_classes_are_octaves_below_the_fastest():
    assert topologies.speed_classes([2, 1, 0.8, 0.5, 0.25, 2]) == (0, 1, 1, 2, 3, 0)
    with pytest.raises(TopologyConfigError, match="positive speeds"):
        topologies.speed_classes([1, 0])


@pytest.mark.parametrize("speeds,degree", CASES)
def test_every_round_keeps_the_random_topology_guarantees(speeds, degree):
    topology = similar(speeds, degree)
    n = len(speeds)
    for round in ROUNDS:
        adjacency, weights = topology.adjacency(round), topology.mixing_matrix(round)
        assert topologies.is_connected(adjacency) and (adjacency.sum(axis=1) == degree).all()
        np.testing.assert_array_equal(weights, weights.T)
        np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=1e-12)
        assert topology.slem(round) < 1.0
        np.testing.assert_array_equal(weights > 0, adjacency | np.eye(n, dtype=bool))


@pytest.mark.parametrize("speeds,degree", CASES)
def test_every_peer_builds_the_same_graphs(speeds, degree):
    first, second = similar(speeds, degree), similar(list(speeds), degree)
    for round in ROUNDS:
        np.testing.assert_array_equal(first.mixing_matrix(round), second.mixing_matrix(round))


@pytest.mark.parametrize("speeds,degree", [CASES[0], CASES[2], CASES[3]])  # CASES[1]: a lone slow peer must cross
def test_partners_of_the_same_class_are_preferred(speeds, degree):
    classes = np.array(topologies.speed_classes(speeds))
    crossing = classes[:, None] != classes[None, :]

    def mean_crossing_edges(topology) -> float:
        return float(np.mean([(topology.adjacency(r) & crossing).sum() / 2 for r in ROUNDS]))

    plain = topologies.build(f"random:degree={degree},seed=3", len(speeds))
    assert mean_crossing_edges(similar(speeds, degree)) < 0.75 * mean_crossing_edges(plain)


def test_only_the_random_topology_takes_partner_classes():
    with pytest.raises(TopologyConfigError, match="applies to the random topology"):
        topologies.prefer_similar(topologies.build("ring", 4), (0, 0, 1, 1))
    with pytest.raises(ConfigError, match="--partners similar-speed: .*use --topology random"):
        GossipConfig.of(world_size=4, topology="exponential", partners="similar-speed", peer_speeds=(1, 1, 1, 0.25))
    config = GossipConfig.of(world_size=4, topology="random", partners="similar-speed", peer_speeds=(1, 1, 0.25, 0.25))
    assert config.build_topology().classes == (0, 0, 2, 2)
