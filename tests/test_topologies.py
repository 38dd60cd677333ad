"""Tests for ``topologies``: one suite every registered topology must pass, then per-topology facts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topologies
from topologies import ConfigError, Topology, build, is_connected, names, random_graph, register, registry

WORLD_SIZES = (2, 3, 4, 5, 8, 16)
ROUNDS = range(6)
TOL = 1e-12

# Beyond each topology's default spec, a few argument-taking specs.
EXTRA_SPECS = [("torus:4x2", 8), ("torus:2x8", 16), ("random:degree=4,seed=7", 16),
               ("random:degree=5,seed=1", 8), ("random:degree=2,seed=3", 5), ("random:degree=12,seed=2", 16)]


def _suite_cases() -> list:
    cases = [(name, n) for name in names() for n in WORLD_SIZES] + EXTRA_SPECS
    return [pytest.param((spec, n), id=f"{spec}-n{n}") for spec, n in cases]


@pytest.fixture(params=_suite_cases())
def topology(request: pytest.FixtureRequest) -> Topology:
    spec, world_size = request.param
    try:
        return build(spec, world_size)
    except ConfigError as error:  # a future topology may not accept every size
        pytest.skip(f"{spec} with {world_size} nodes is not valid: {error}")


def test_every_registered_topology_builds_at_16_nodes() -> None:
    assert {"exponential", "full", "random", "ring", "star", "torus"} <= set(names())
    for name in names():
        assert build(name, 16).world_size == 16


# -- the common suite -----------------------------------------------------------------------------

def test_mixing_matrix_is_doubly_stochastic(topology: Topology) -> None:
    n = topology.world_size
    for round in ROUNDS:
        weights = topology.mixing_matrix(round)
        assert weights.shape == (n, n) and weights.dtype == np.float64
        assert (weights >= 0).all()
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=TOL)
        np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=TOL)


def test_symmetric_exactly_when_undirected(topology: Topology) -> None:
    symmetric = [np.array_equal(topology.mixing_matrix(r), topology.mixing_matrix(r).T) for r in ROUNDS]
    assert all(symmetric) if not topology.directed else not all(symmetric)


def test_weights_support_is_self_and_in_neighbours(topology: Topology) -> None:
    n = topology.world_size
    for round in ROUNDS:
        weights, adjacency = topology.mixing_matrix(round), topology.adjacency(round)
        np.testing.assert_array_equal(weights > 0, adjacency | np.eye(n, dtype=bool))
        for rank in range(n):
            incoming, outgoing = topology.in_neighbours(rank, round), topology.out_neighbours(rank, round)
            assert incoming == tuple(j for j in range(n) if j != rank and weights[rank, j] > 0)
            assert all(rank in topology.out_neighbours(j, round) for j in incoming)
            assert all(rank in topology.in_neighbours(k, round) for k in outgoing)
            assert topology.neighbours(rank, round) == tuple(sorted(set(incoming) | set(outgoing)))
            assert topology.degree(rank, round) == len(topology.neighbours(rank, round))
            if not topology.directed:
                assert incoming == outgoing


def test_edges_match_adjacency(topology: Topology) -> None:
    adjacency = topology.adjacency(1)
    edges = topology.edges(1)
    if topology.directed:
        assert edges == {(j, i) for i, j in zip(*np.nonzero(adjacency), strict=True)}
    else:
        assert edges == {frozenset((int(i), int(j))) for i, j in zip(*np.nonzero(adjacency), strict=True)}


def test_connected(topology: Topology) -> None:
    union = np.zeros((topology.world_size,) * 2, dtype=bool)
    for round in ROUNDS:
        union |= topology.adjacency(round)
        if not topology.directed:  # every undirected topology here is connected in every round
            assert is_connected(topology.adjacency(round))
    assert is_connected(union)


def test_time_invariant_graphs_do_not_change(topology: Topology) -> None:
    if not topology.time_varying:
        for round in ROUNDS:
            np.testing.assert_array_equal(topology.mixing_matrix(round), topology.mixing_matrix(0))


def test_spectral_quantities(topology: Topology) -> None:
    for round in ROUNDS:
        slem, contraction = topology.slem(round), topology.contraction(round)
        weights = topology.mixing_matrix(round)
        # W doubly stochastic: W - J has W's spectrum with one eigenvalue 1 (of the vector of ones) made 0
        centred = np.linalg.eigvals(weights - 1.0 / topology.world_size)
        assert slem == pytest.approx(float(np.max(np.abs(centred))), abs=1e-9)
        assert contraction >= slem - TOL
        assert topology.spectral_gap(round) == pytest.approx(1.0 - slem)
        if np.array_equal(weights, weights.T):
            assert contraction == pytest.approx(slem, abs=1e-9)
        if not topology.directed:
            assert slem < 1.0 - 1e-9  # connected and aperiodic (positive self-weights)


def test_matrices_are_cached_and_read_only(topology: Topology) -> None:
    weights = topology.mixing_matrix(3)
    assert topology.mixing_matrix(3) is weights
    with pytest.raises(ValueError):
        weights[0, 0] = 2.0
    with pytest.raises(ValueError):
        topology.adjacency(3)[0, 0] = True


def test_spec_round_trips(topology: Topology) -> None:
    rebuilt = build(topology.spec, topology.world_size)
    assert rebuilt.spec == topology.spec
    assert repr(topology) == f"Topology({topology.spec!r}, n={topology.world_size})"
    for round in (0, 4):
        np.testing.assert_array_equal(rebuilt.mixing_matrix(round), topology.mixing_matrix(round))


def test_rank_and_round_are_validated(topology: Topology) -> None:
    n = topology.world_size
    for bad_rank in (n, -1, 1.5):
        with pytest.raises(ConfigError, match="out of range"):
            topology.neighbours(bad_rank)
    with pytest.raises(ConfigError, match="non-negative"):
        topology.mixing_matrix(-1)
    assert topology.in_neighbours(np.int64(n - 1), np.int64(2)) == topology.in_neighbours(n - 1, 2)


# -- per-topology facts ---------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "world_size", "expected"), [
    ("ring", 2, [1, 1]),
    ("ring", 3, [2] * 3),
    ("ring", 16, [2] * 16),
    ("torus:4x2", 8, [3] * 8),
    ("torus:4x4", 16, [4] * 16),
    ("torus:1x7", 7, [2] * 7),
    ("torus:1x2", 2, [1, 1]),
    ("full", 5, [4] * 5),
    ("star", 6, [5, 1, 1, 1, 1, 1]),
    ("random:degree=3,seed=0", 8, [3] * 8),
    ("random:degree=7,seed=5", 16, [7] * 16),
    ("random:degree=1,seed=0", 2, [1, 1]),
    ("exponential", 2, [1, 1]),
    ("exponential", 5, [2] * 5),
])
def test_degrees(spec: str, world_size: int, expected: list[int]) -> None:
    topology = build(spec, world_size)
    for round in ROUNDS:
        assert [topology.degree(rank, round) for rank in range(world_size)] == expected


def test_torus_default_shape_is_the_squarest() -> None:
    assert [build("torus", n).spec for n in (4, 8, 12, 16, 7)] == [
        "torus:2x2", "torus:2x4", "torus:3x4", "torus:4x4", "torus:1x7"]
    torus = build("torus:2x4", 8)  # rank = row * cols + col
    assert torus.neighbours(0) == (1, 3, 4)
    assert torus.neighbours(5) == (1, 4, 6)


@pytest.mark.parametrize("world_size", [4, 5, 8, 13, 16])
def test_ring_slem_is_analytic(world_size: int) -> None:
    expected = 1 / 3 + 2 / 3 * math.cos(2 * math.pi / world_size)
    assert build("ring", world_size).slem() == pytest.approx(expected, abs=1e-12)


def test_known_slems() -> None:
    assert build("ring", 8).slem() == pytest.approx(0.8047378541243650, abs=1e-12)
    assert build("ring", 3).slem() == pytest.approx(0.0, abs=1e-12)  # the triangle is complete
    for n in (2, 5, 16):
        assert build("full", n).slem() == pytest.approx(0.0, abs=1e-12)
        np.testing.assert_array_equal(build("full", n).mixing_matrix(), np.full((n, n), 1 / n))
        assert build("star", n).slem() == pytest.approx(0.0 if n == 2 else 1 - 1 / n, abs=1e-12)
    assert build("torus:4x4", 16).slem() == pytest.approx(0.6, abs=1e-12)  # W = I - L/5, L's gap 2


def test_metropolis_hastings_weights_on_a_star() -> None:
    weights = build("star", 4).mixing_matrix()
    np.testing.assert_allclose(weights[0], [0.25] * 4)
    np.testing.assert_allclose(weights[1], [0.25, 0.75, 0, 0])


@pytest.mark.parametrize("world_size", [2, 4, 8, 16, 32])
def test_exponential_averages_exactly_after_log2_rounds(world_size: int) -> None:
    topology = build("exponential", world_size)
    product = np.eye(world_size)
    for round in range(int(math.log2(world_size))):
        product = topology.mixing_matrix(round) @ product
    np.testing.assert_allclose(product, np.full((world_size, world_size), 1 / world_size), atol=TOL)


def test_exponential_peers_follow_powers_of_two() -> None:
    topology = build("exponential", 8)
    assert topology.offsets == (1, 2, 4)
    for round in range(7):
        shift = 2 ** (round % 3)
        for rank in range(8):
            assert topology.in_neighbours(rank, round) == ((rank - shift) % 8,)
            assert topology.out_neighbours(rank, round) == ((rank + shift) % 8,)
            assert topology.mixing_matrix(round)[rank, rank] == 0.5
            assert topology.degree(rank, round) == (1 if shift == 4 else 2)  # +4 and -4 are one peer
    assert not is_connected(topology.adjacency(1))  # offset 2 on 8 ranks: two 4-cycles
    assert is_connected(topology.adjacency(1) | topology.adjacency(2) | topology.adjacency(3))  # any m rounds
    assert build("exponential", 5).offsets == (1, 2, 4)  # m = ceil(log2 5) = 3
    assert (build("exponential", 2).directed, build("exponential", 3).directed) == (False, True)


def test_random_graph_is_a_function_of_seed_and_round() -> None:
    first, again = build("random:degree=3,seed=4", 16), build("random:degree=3,seed=4", 16)
    other_seed = build("random:degree=3,seed=5", 16)
    np.testing.assert_array_equal(first.adjacency(3), again.adjacency(3))
    assert len({first.adjacency(round).tobytes() for round in range(10)}) == 10
    assert not np.array_equal(first.adjacency(3), other_seed.adjacency(3))
    assert first.time_varying and not build("random:degree=3", 4).time_varying  # K4 is the only one


def test_random_default_degree_fits_every_size() -> None:
    assert [build("random", n).spec for n in (2, 3, 4, 5, 7, 8)] == [
        "random:degree=1,seed=0", "random:degree=2,seed=0", "random:degree=3,seed=0",
        "random:degree=4,seed=0", "random:degree=4,seed=0", "random:degree=3,seed=0"]


@pytest.mark.parametrize(("world_size", "degree"), [(8, 3), (16, 6), (17, 8), (20, 13), (64, 31)])
def test_random_fallback_is_regular_and_connected(monkeypatch: pytest.MonkeyPatch, world_size: int,
                                                  degree: int) -> None:
    monkeypatch.setattr(random_graph, "MAX_REPAIRS", 0)  # any clash now sends sampling to the fallback
    topology = build(f"random:degree={degree},seed=1", world_size)
    for round in range(3):
        adjacency = topology.adjacency(round)
        assert (adjacency.sum(axis=1) == degree).all() and is_connected(adjacency)


def _valid_random_sizes() -> st.SearchStrategy[tuple[int, int]]:
    def degrees(world_size: int) -> st.SearchStrategy[tuple[int, int]]:
        valid = [d for d in range(2, world_size) if d * world_size % 2 == 0] or [1]
        return st.sampled_from(valid).map(lambda degree: (world_size, degree))
    return st.integers(2, 40).flatmap(degrees)


@settings(max_examples=60, deadline=None)
@given(size=_valid_random_sizes(), seed=st.integers(0, 2**63), round=st.integers(0, 2**40))
def test_random_is_always_regular_connected_and_doubly_stochastic(size: tuple[int, int], seed: int,
                                                                  round: int) -> None:
    world_size, degree = size
    topology = build(f"random:degree={degree},seed={seed}", world_size)
    adjacency, weights = topology.adjacency(round), topology.mixing_matrix(round)
    assert (adjacency.sum(axis=1) == degree).all() and is_connected(adjacency)
    np.testing.assert_array_equal(weights, weights.T)
    np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=TOL)
    assert (weights >= 0).all() and topology.slem(round) < 1.0


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(2, 200), round=st.integers(0, 10**6))
def test_exponential_is_a_permutation_average(world_size: int, round: int) -> None:
    topology = build("exponential", world_size)
    weights = topology.mixing_matrix(round)
    np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=TOL)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=TOL)
    assert all(len(topology.in_neighbours(rank, round)) == 1 for rank in (0, world_size - 1))


# -- registry and errors --------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "world_size", "message"), [
    ("rng", 8, "unknown topology 'rng'; choose one of: exponential, full, random, ring, star, torus"),
    ("torus:3x3", 8, ("torus:3x3 has 9 cells but there are 8 nodes; use a shape R x C with R*C = 8, "
                      "e.g. torus:2x4 or torus:4x2")),
    ("torus:0x8", 8, "has 0 cells"),
    ("torus:2by4", 8, "torus takes a shape RxC"),
    ("torus:rows=2", 8, "torus takes a shape RxC"),
    ("random:degree=3", 7, ("random:degree=3 needs an even number of nodes (3*7 is odd); "
                            "use degree=2 or 4, or an even number of nodes")),
    ("random:degree=5", 4, "needs at least 6 nodes, got 4; use degree <= 3"),
    ("random:degree=1", 4, "use degree >= 2"),
    ("random:seed=-1", 8, "use a seed >= 0"),
    ("random:deg=3", 8, "random does not take 'deg'; it takes degree, seed"),
    ("random:degree=three", 8, "'three' is not an integer"),
    ("random:degree=2.5", 8, "is not an integer"),
    ("random:degree=3,degree=4", 8, "given twice"),
    ("random:degree", 8, "is not key=value"),
    ("ring:size=3", 8, "ring takes no arguments"),
    ("ring", 1, "ring needs at least 2 nodes, got 1"),
    ("torus", 0, "torus needs at least 2 nodes, got 0"),
    ("ring", 2.0, "needs an integer number of nodes"),
    ("ring", "8", "needs an integer number of nodes"),
    ("ring", True, "needs an integer number of nodes"),
    ("", 8, "malformed topology spec"),
    (":x=1", 8, "malformed topology spec"),
    ("ring:", 8, "malformed topology spec"),
    (None, 8, "must be a string"),
])
def test_invalid_specs_say_what_is_valid(spec: str, world_size: int, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        build(spec, world_size)
    assert message in str(raised.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert topologies.ConfigError is ConfigError


def test_specs_tolerate_whitespace() -> None:
    assert build(" random : degree = 4 , seed = 2 ", 10).spec == "random:degree=4,seed=2"
    assert build("torus: 4 x 2", 8).spec == "torus:4x2"


def test_register_adds_a_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_TOPOLOGIES", dict(registry._TOPOLOGIES))  # undone after the test

    @register("path")
    class Path(Topology):
        def _adjacency(self, round: int) -> np.ndarray:
            adjacency = np.eye(self.world_size, k=1, dtype=bool)
            return adjacency | adjacency.T

    path = build("path", 4)
    assert "path" in names() and repr(path) == "Topology('path', n=4)"
    assert path.neighbours(0) == (1,) and path.neighbours(1) == (0, 2)
    np.testing.assert_allclose(path.mixing_matrix()[0], [2 / 3, 1 / 3, 0, 0])
    with pytest.raises(ValueError, match="already taken"):
        register("path")(type("OtherPath", (Path,), {}))
    with pytest.raises(ValueError, match="lowercase"):
        register("Bad:Name")
