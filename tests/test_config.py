"""Configuration: defaults, one clear ConfigError per invalid value, and the JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from gossip.config import MODES, SECTION_OF, GossipConfig, RendezvousConfig, RunConfig
from gossip.errors import ConfigError
from gossip.sections import SECTIONS, STALENESS_WEIGHTS, Compression, Network, Timeouts


def test_defaults_construct():
    gossip = GossipConfig()
    run = RunConfig()
    assert (gossip.rank, gossip.world_size, gossip.mode) == (0, 1, "gossip-sync")
    assert run.gossip.world_size == run.nodes
    assert run.speed(0) == 1.0


def test_each_field_sits_in_one_section_and_flat_names_reach_it():
    names = [f.name for kind in SECTIONS.values() for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)) and not set(names) & {f.name for f in dataclasses.fields(GossipConfig)}
    nested = GossipConfig(world_size=4, mode="gossip-sync", compression=Compression(compress="int8"),
                          network=Network(base_port=31000, link_latency_ms=(0, 1, 2, 3)),
                          timeouts=Timeouts(round_timeout=5.0))
    flat = GossipConfig.of(world_size=4, compress="int8", base_port=31000, link_latency_ms=(0, 1, 2, 3),
                           round_timeout=5.0)
    assert nested == flat and GossipConfig.of(**flat.flat()) == flat and set(flat.flat()) == set(SECTION_OF)
    changed = flat.replace(rank=2, queue_depth=3, overlap=False)
    assert (changed.rank, changed.network.queue_depth, changed.sync.overlap) == (2, 3, False)
    assert changed.network.base_port == 31000 and flat.network.queue_depth == 8  # the rest kept, the original too
    assert GossipConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(changed)))) == changed


def test_a_check_that_reads_two_sections_or_the_world_size_runs_where_they_meet():
    with pytest.raises(ConfigError, match="--link-latency-ms lists 2 values for 4 peers"):
        GossipConfig.of(world_size=4, link_latency_ms=(1, 2))
    with pytest.raises(ConfigError, match="--compress int8 cannot be combined with --deadline adaptive"):
        GossipConfig.of(world_size=4, compress="int8", deadline="adaptive")
    with pytest.raises(ConfigError, match="^GossipConfig.network must be a Network, got"):
        GossipConfig(network={"base_port": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^unknown option 'chunk_mib'; did you mean 'chunk_mb'"):
        GossipConfig().replace(chunk_mib=1)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("fields,expected", [
    ({"rank": 4, "world_size": 4}, "rank 4 is outside 0..3"),
    ({"rank": -1, "world_size": 4}, "rank -1 is outside 0..3"),
    ({"rank": 1.0, "world_size": 4}, "rank must be an integer"),
    ({"mode": "gossip"}, "unknown mode 'gossip'; choose one of: " + ", ".join(MODES)),
    ({"staleness_weight": "linear"}, "choose one of: " + ", ".join(STALENESS_WEIGHTS)),
    ({"gossip_every": 0}, "--gossip-every must be >= 1, got 0"),
    ({"gossip_every": True}, "--gossip-every must be an integer, got True"),
    ({"gossip_every": 2.0}, "--gossip-every must be an integer, got 2.0"),
    ({"max_staleness": -1}, "--max-staleness must be >= 0"),
    ({"queue_depth": 0}, "--queue-depth must be >= 1"),
    ({"world_size": 0}, "must be >= 1, got 0"),
    ({"base_port": 0}, "--base-port must be >= 1, got 0"),
    ({"base_port": 65535, "world_size": 2, "topology": "full"},  # room for a parameter server
     "--base-port 65535 with --nodes 2: the peers and the server would listen up to port 65537, beyond 65535; use "
     "--base-port at most 65533"),
    ({"world_size": 70000, "topology": "full"}, "--nodes 70000 needs 70001 ports from --base-port on"),
    ({"seed": -1}, "--seed must be in 0..4294967295, got -1"),
    ({"chunk_mb": 0.01}, "--chunk-mb 0.01 is out of range; use a value in 0.0625..64"),
    ({"chunk_mb": 65}, "--chunk-mb 65 is out of range"),
    ({"chunk_mb": math.nan}, "--chunk-mb nan is out of range"),
    ({"chunk_mb": "8"}, "--chunk-mb 8 is out of range"),
    ({"staleness_temperature": 0.0}, "--staleness-temperature must be a positive number, got 0.0"),
    ({"round_timeout": math.inf}, "--round-timeout must be a positive number of seconds up to 604800 (one week), "
                                  "got inf"),
    ({"send_timeout": True}, "--send-timeout must be a positive number of seconds up to 604800 (one week), got True"),
    ({"endpoints": ("tcp://a:1",), "world_size": 2, "topology": "full"}, "1 endpoints given for 2 peers; give one per peer"),
    ({"overlap": False, "mode": "gossip-async"}, "--no-overlap applies to --mode gossip-sync"),
    ({"overlap": "no"}, "overlap must be True or False, got 'no'"),
])
def test_invalid_gossip_config(fields, expected):
    with pytest.raises(ConfigError) as info:
        GossipConfig.of(**fields)
    assert expected in str(info.value)


def run_config(nodes: int = 4, **fields) -> RunConfig:
    return RunConfig(nodes=nodes, gossip=GossipConfig.of(world_size=nodes), **fields)


@pytest.mark.parametrize("fields,expected", [
    ({"nodes": 0}, "--nodes must be >= 1, got 0"),
    ({"steps": True}, "--steps must be an integer, got True"),
    ({"batch_size": 0}, "--batch-size must be >= 1"),
    ({"eval_every": -1}, "--eval-every must be >= 0"),
    ({"speeds": (1.0, 1.0)}, "--speeds lists 2 values for 4 nodes; give one per node, e.g. 1,1,1,0.25"),
    ({"speeds": (1.0, 1.0, 0.0, 1.0)}, "--speeds must be positive numbers (1 = full speed, 0.25 = 4x slower); got 0.0"),
    ({"speeds": (1.0, -2.0, 1.0, 1.0)}, "--speeds must be positive numbers"),
    ({"speeds": (1.0, math.nan, 1.0, 1.0)}, "--speeds must be positive numbers"),
    ({"speeds": (1.0, "1", 1.0, 1.0)}, "--speeds must be positive numbers"),
    ({"compute_ms": -1.0}, "--compute-ms -1.0 must be a finite number >= 0"),
    ({"compute_ms": math.inf}, "--compute-ms inf must be a finite number >= 0"),
    ({"momentum": 1.0}, "--momentum 1.0 must be in [0, 1)"),
    ({"momentum": -0.1}, "--momentum -0.1 must be in [0, 1)"),
    ({"lr": 0}, "--lr must be a positive number, got 0"),
    ({"lr": True}, "--lr must be a positive number, got True"),
])
def test_invalid_run_config(fields, expected):
    with pytest.raises(ConfigError) as info:
        RunConfig(**fields) if "nodes" in fields else run_config(**fields)
    assert expected in str(info.value)


def test_world_size_must_match_nodes():
    with pytest.raises(ConfigError, match="differs from nodes 3"):
        RunConfig(nodes=3, gossip=GossipConfig.of(world_size=4))


def test_speeds_example_has_one_value_per_node():
    with pytest.raises(ConfigError) as info:
        run_config(3, speeds=(1.0,))
    assert str(info.value).endswith("e.g. 1,1,0.25")


def test_boundary_values_are_accepted():
    GossipConfig.of(chunk_mb=0.0625)
    GossipConfig.of(chunk_mb=64)
    GossipConfig.of(rank=3, world_size=4, max_staleness=0, base_port=65531)  # 65535 left for a server
    run_config(momentum=0.0, compute_ms=0.0, eval_every=0, speeds=(1, 0.25, 1e6, 1.0))


WEEK = "up to 604800 (one week)"


@pytest.mark.parametrize("fields,expected", [
    ({"round_timeout": 1e300}, f"--round-timeout must be a positive number of seconds {WEEK}, got 1e+300"),
    ({"round_timeout": 604800.5}, f"--round-timeout must be a positive number of seconds {WEEK}, got 604800.5"),
    ({"send_timeout": math.inf}, f"--send-timeout must be a positive number of seconds {WEEK}, got inf"),
    ({"startup_timeout": math.nan}, f"--startup-timeout must be a positive number of seconds {WEEK}, got nan"),
    ({"shutdown_timeout": 1e10}, f"--shutdown-timeout must be a positive number of seconds {WEEK}, got 10000000000.0"),
    ({"round_seconds": 1e300}, f"--round-seconds must be a positive number of seconds {WEEK}, got 1e+300"),
    ({"deadline_floor": 1e300}, f"--deadline-floor must be a positive number of seconds {WEEK}, got 1e+300"),
    ({"peer_timeout": 1e20}, "--peer-timeout must be a positive number of seconds up to 6553 (ZeroMQ's heartbeat "
                             "limit), got 1e+20"),
    ({"peer_timeout": 6554}, "--peer-timeout must be a positive number of seconds up to 6553"),  # HEARTBEAT_TTL
    ({"peer_timeout": 0}, "--peer-timeout must be a positive number of seconds"),
])
def test_timeouts_and_waits_are_bounded(fields, expected):
    """threading, asyncio, time.sleep and ZeroMQ refuse waits beyond their limits with an OverflowError
    (or EINVAL) in the middle of a run: a flag asking for one is refused with one line instead."""
    with pytest.raises(ConfigError) as info:
        GossipConfig.of(**fields)
    assert expected in str(info.value)


@pytest.mark.parametrize("fields,expected", [
    ({"compute_ms": 1e300}, "--compute-ms must be in 0..6.048e+08 (a step of at most one week), got 1e+300"),
    ({"compute_ms": 1e6, "speeds": (1, 1, 1, 0.001)}, "--compute-ms must be in 0..604800 (a step of at most one "
                                                      "week at the slowest --speeds, 0.001), got 1000000.0"),
    ({"speeds": (1, 1, 1, 1e-300)}, "--speeds must be in 1e-06..1e+06 (1e-06: a million times slower); got 1e-300"),
    ({"speeds": (1, 1, 1, 1e7)}, "--speeds must be in 1e-06..1e+06"),
])
def test_emulated_sleeps_are_bounded(fields, expected):
    with pytest.raises(ConfigError) as info:
        run_config(**fields)
    assert expected in str(info.value)


@pytest.mark.parametrize("timeout", [1e300, math.inf, math.nan, 0.0])
def test_the_rendezvous_timeout_is_bounded(timeout):
    with pytest.raises(ConfigError, match=r"--rendezvous-timeout must be a positive number of seconds up to 604800 "
                                          r"\(one week\), got "):
        RendezvousConfig(rendezvous_timeout=timeout)


def test_the_longest_waits_are_accepted():
    GossipConfig.of(round_timeout=604800, startup_timeout=604800.0, send_timeout=604800, shutdown_timeout=604800,
                 round_seconds=604800, deadline_floor=604800, peer_timeout=6553)
    RendezvousConfig(rendezvous_timeout=604800)
    run_config(compute_ms=604800e3)
    run_config(compute_ms=604.8, speeds=(1, 1, 1, 1e-6))


def test_json_round_trip_gives_an_equal_object():
    cfg = RunConfig(nodes=3, task="digits", steps=17, out="runs/x", speeds=(1.0, 0.5, 0.25), compute_ms=2.5,
                    lr=0.1, momentum=0.0, gossip=GossipConfig.of(
                        rank=2, world_size=3, mode="gossip-async", async_rule="latest", staleness_weight="exp", staleness_temperature=2.0,
                        endpoints=("tcp://a:1", "tcp://b:2", "tcp://c:3"), chunk_mb=0.5, gossip_every=3))
    again = RunConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg
    assert isinstance(again.speeds, tuple) and isinstance(again.gossip.network.endpoints, tuple)
    assert RunConfig.from_dict(json.loads(RunConfig().to_json())) == RunConfig()


def test_json_round_trip_keeps_the_heterogeneity_options():
    cfg = RunConfig(nodes=4, rounds=7, link_mbit=(0, 0, 0, 100.0), gossip=GossipConfig.of(
        world_size=4, topology="random", schedule="time", round_seconds=0.25, weight_by="samples",
        deadline="adaptive", deadline_k=2.0, partners="similar-speed", peer_speeds=(1, 1, 1, 0.25),
        link_latency_ms=(0, 5.0, 0, 20.0)))
    again = RunConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg and again.total_rounds == 7
    assert isinstance(again.link_mbit, tuple) and isinstance(again.gossip.network.link_latency_ms, tuple)



def test_json_round_trip_keeps_the_aggregation_options():
    cfg = RunConfig(nodes=6, gossip=GossipConfig.of(world_size=6, topology="torus", aggregate="trimmed-mean",
                                                 trim_fraction=0.3, byzantine=(3, 5), byzantine_scale=1e3))
    again = RunConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg and isinstance(again.gossip.robust.byzantine, tuple)


@pytest.mark.parametrize("fields,expected", [
    ({"aggregate": "mode"}, "--aggregate 'mode' is not valid; choose one of: mean, median, trimmed-mean, norm-clip"),
    ({"trim_fraction": 0.5}, "--trim-fraction must be in (0, 0.5), got 0.5"),
    ({"trim_fraction": 0.0}, "--trim-fraction must be in (0, 0.5), got 0.0"),
    ({"aggregate": "median", "weight_by": "samples"}, "--aggregate median cannot be combined with --weight-by samples"),
    ({"aggregate": "trimmed-mean", "deadline": "adaptive"}, "push-sum masses assume a linear mean"),
    ({"aggregate": "median", "mode": "gossip-async", "async_rule": "latest", "staleness_weight": "inverse"},
     "--staleness-weight does not apply; use --max-staleness"),
    ({"aggregate": "median", "mode": "gossip-async"}, "--aggregate median in gossip-async needs --async-rule latest"),
    ({"mode": "gossip-async", "staleness_weight": "inverse"}, "add --async-rule latest"),
    ({"async_rule": "newest"}, "--async-rule 'newest' is not valid; choose one of: push-sum, latest"),
    ({"aggregate": "median", "mode": "ps-async"}, "--mode ps-async applies each gradient on its own, which has no "
                                                  "median: use --aggregate norm-clip"),
    ({"aggregate": "trimmed-mean", "mode": "ps-dcasgd"}, "use --aggregate norm-clip"),
    ({"aggregate": "norm-clip"}, "--aggregate norm-clip bounds the gradients a parameter server applies, and the "
                                 "gossip modes mix models: use --aggregate median or trimmed-mean"),
    ({"aggregate": "norm-clip", "mode": "ps-avg"}, "and its workers send weights: use --aggregate median or"),
    ({"aggregate": "median", "world_size": 2}, "--aggregate median needs at least 2 neighbours per peer"),
    ({"aggregate": "median", "topology": "exponential"}, "--topology exponential with --nodes 6 gives peer 0 1"),
    ({"byzantine": (6,)}, "--byzantine must list peer ranks in 0..5, got 6"),
    ({"byzantine": (1.0,)}, "--byzantine must list peer ranks in 0..5"),
    ({"byzantine_scale": 0.0}, "--byzantine-scale must be a positive number"),
])
def test_invalid_aggregation_options(fields, expected):
    with pytest.raises(ConfigError) as info:
        GossipConfig.of(**{"world_size": 6, **fields})
    assert expected in str(info.value)


def test_robust_aggregation_is_accepted_where_it_applies():
    for mode, rule in (("gossip-sync", "push-sum"), ("gossip-async", "latest")):
        for topology in ("ring", "torus", "random", "full"):
            GossipConfig.of(world_size=6, mode=mode, async_rule=rule, topology=topology, aggregate="median",
                         byzantine=(0, 5))
    GossipConfig.of(world_size=3, aggregate="trimmed-mean", trim_fraction=0.49)
    for mode in ("ps-sync", "ps-avg"):
        for rule in ("median", "trimmed-mean"):
            GossipConfig.of(world_size=4, mode=mode, aggregate=rule, byzantine=(3,))
    for mode in ("ps-sync", "ps-async", "ps-ssp", "ps-dcasgd"):
        GossipConfig.of(world_size=4, mode=mode, aggregate="norm-clip", byzantine=(0,))


def test_for_rank_sets_only_the_rank():
    cfg = run_config(4, steps=9)
    third = cfg.for_rank(2)
    assert third.gossip.rank == 2 and cfg.gossip.rank == 0
    assert dataclasses.replace(third, gossip=cfg.gossip) == cfg
    with pytest.raises(ConfigError, match="outside 0..3"):
        cfg.for_rank(4)


def test_endpoint_from_host_and_base_port():
    cfg = GossipConfig.of(world_size=4, host="10.0.0.7", base_port=31000)
    assert [cfg.endpoint(r) for r in range(4)] == [f"tcp://10.0.0.7:{31000 + r}" for r in range(4)]


def test_explicit_endpoints_win():
    endpoints = ("tcp://h1:5000", "tcp://h2:6000")
    cfg = GossipConfig.of(world_size=2, topology="full", endpoints=endpoints, base_port=31000)
    assert [cfg.endpoint(r) for r in range(2)] == list(endpoints)


@pytest.mark.parametrize("chunk_mb", [0.0625, 0.1, 1 / 3, 1.0, 8.0, 9.999, 64.0])
def test_chunk_bytes_is_a_multiple_of_64(chunk_mb):
    chunk_bytes = GossipConfig.of(chunk_mb=chunk_mb).network.chunk_bytes
    assert chunk_bytes % 64 == 0 and 0 < chunk_bytes <= chunk_mb * (1 << 20) < chunk_bytes + 64


@pytest.mark.parametrize("settings,spec,overlaps", [
    ({}, "exponential", False),  # gossip-sync's plain lockstep mix: SGP's graph, without overlap
    ({"overlap": True}, "exponential", True),
    ({"topology": "ring"}, "ring", True),
    ({"topology": "exponential"}, "exponential", False),
    ({"topology": "torus", "overlap": False}, "torus", False),
    ({"mode": "gossip-async"}, "ring", True),
    ({"deadline": "adaptive"}, "ring", True),
    ({"weight_by": "samples"}, "ring", True),
    ({"compress": "int8"}, "ring", True),
    ({"aggregate": "median"}, "ring", True),
    ({"gossip_every": 10}, "ring", True),
    ({"schedule": "time"}, "ring", True),
    ({"partners": "similar-speed", "peer_speeds": (1, 1, 1, 0.25)}, "random", True),  # (the graph it applies to)
])
def test_the_auto_topology_and_overlap_follow_the_mix(settings, spec, overlaps):
    gossip = GossipConfig.of(world_size=4, **settings)
    assert (gossip.topology_spec, gossip.overlaps) == (spec, overlaps)
    assert gossip.build_topology().spec.split(":")[0] == spec


def test_a_configuration_written_before_auto_loads_and_a_graph_given_where_none_is_read_is_refused():
    """A config.json from before "auto" holds what auto gives (the ring and overlap in a ps-* run): accepted.
    A graph other than what auto gives, in a run that reads none, is refused as any unused flag is."""
    data = json.loads(json.dumps(dataclasses.asdict(RunConfig(gossip=GossipConfig.of(world_size=4, mode="ps-sync")))))
    data["gossip"]["graph"]["topology"], data["gossip"]["sync"]["overlap"] = "ring", True
    assert RunConfig.from_dict(data).gossip.topology_spec == "ring"
    data["gossip"]["graph"]["topology"] = "exponential"
    with pytest.raises(ConfigError, match="--topology applies to the gossip modes"):
        RunConfig.from_dict(data)
