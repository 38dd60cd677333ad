"""Compressed gossip (``--compress``): the codecs, what a receiver checks, and CHOCO-gossip on real peers.

The multi-process runs are compared with an in-process replay of CHOCO-gossip written here from the
update rule alone (the codecs are the only shared code): the traces must agree to float64 rounding, the
network's mean must not move, and the consensus distance must contract.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import gossip
import topologies
from gossip.compression import FLOAT16_MAX, add_decoded_, encode_difference_, scratch_numel
from gossip.config import GossipConfig, RunConfig
from gossip.errors import ConfigError, ProtocolError
from gossip.net.wire import INT8_BLOCK, MAX_INT8_SCALE, Header, Layout, decode, encode, frames_per_row, params_header
from gossip.tasks.consensus import initial_vector
from tests.conftest import consensus_distance as distance
from tests.conftest import load_traces, vector_model

pytestmark = pytest.mark.timeout(240)

NUMEL = 3 * INT8_BLOCK + 17  # a partial last block
CHUNK = 1024  # bytes per frame of the float32 plan: 256 values, so the test layout has several rows


def layout(codec: str) -> Layout:
    return Layout(("float32",), (NUMEL,), "f" * 16, CHUNK, codec)


def message(codec: str, seed: int = 0) -> tuple[list, list[torch.Tensor], torch.Tensor]:
    """(frames on the wire, the sender's public copy after sending, the difference it compressed)."""
    generator = torch.Generator().manual_seed(seed)
    current = torch.randn(NUMEL, generator=generator)
    public = torch.zeros(NUMEL)
    plan = layout(codec).frame_plan(CHUNK)
    frames = []
    for _, start, stop in plan:
        frames += encode_difference_(codec, current[start:stop], public[start:stop], scratch(NUMEL))
    kind = {"float16": "delta-f16", "int8": "delta-i8"}[codec]
    header = params_header(kind, 1, layout(codec), CHUNK)
    return [bytes(f) for f in encode(header, frames)], public, current


def scratch(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A work buffer holding garbage, as a reused one would."""
    return torch.full((scratch_numel(numel),), float("nan"), dtype=dtype)


def replay(frames: list, codec: str) -> torch.Tensor:
    """What a receiver's replica becomes: zeros moved by the decoded message."""
    decoded = decode(frames, layout(codec), world_size=4)
    replica = torch.zeros(NUMEL)
    per_row = frames_per_row(codec)
    for index, (_, start, stop) in enumerate(layout(codec).frame_plan(CHUNK)):
        add_decoded_(replica[start:stop], codec, decoded.chunks[index * per_row:(index + 1) * per_row], scratch(NUMEL))
    return replica


@pytest.mark.parametrize("codec", ["float16", "int8"])
def test_the_receivers_replica_equals_the_senders_public_copy_bit_for_bit(codec):
    frames, public, current = message(codec)
    assert torch.equal(replay(frames, codec), public)
    error = (current - public).abs()
    if codec == "int8":  # round to nearest: at most half a step of each block's scale
        blocks = torch.nn.functional.pad(current, (0, -NUMEL % INT8_BLOCK)).view(-1, INT8_BLOCK)
        half_step = (blocks.abs().amax(1) / 127 / 2).repeat_interleave(INT8_BLOCK)[:NUMEL]
        assert bool((error <= half_step * (1 + 1e-6)).all())
    else:
        assert bool((error <= current.abs() * 2 ** -11).all())


def test_what_a_message_rounds_away_goes_out_with_the_next():
    current, public = torch.tensor([1e5, -1e5, 3.0, 1e-9]), torch.zeros(4)
    first = encode_difference_("float16", current, public, scratch(4))[0]
    assert first.tolist()[:2] == [FLOAT16_MAX, -FLOAT16_MAX]  # clipped, not inf
    for _ in range(3):
        encode_difference_("float16", current, public, scratch(4))
    assert public[:3].tolist() == pytest.approx([1e5, -1e5, 3.0], rel=1e-3)


@pytest.mark.parametrize("codec", ["float16", "int8"])
def test_a_compressed_message_that_lies_about_its_sizes_is_rejected(codec):
    frames, _, _ = message(codec)
    cases = {"frames": [frames[:-1], frames + [frames[-1]]], "length": [frames[:1] + [frames[1][:-1]] + frames[2:]]}
    if codec == "int8":
        cases["length"].append(frames[:2] + [frames[2] + b"\0\0\0\0"] + frames[3:])  # one scale too many
        cases["frames"].append(frames[:1] + frames[1:-2])  # a row without its scales
    for reason, lies in cases.items():
        for lie in lies:
            with pytest.raises(ProtocolError) as error:
                decode(lie, layout(codec), world_size=4)
            assert error.value.reason == reason


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), MAX_INT8_SCALE * 2])
def test_an_int8_message_that_lies_about_its_scales_is_rejected(bad):
    frames, _, _ = message("int8")
    scales = np.frombuffer(frames[2], dtype=np.float32).copy()
    scales[0] = bad
    with pytest.raises(ProtocolError) as error:
        decode(frames[:2] + [scales.tobytes()] + frames[3:], layout("int8"), world_size=4)
    assert error.value.reason == "scale"


def test_a_float16_message_with_nan_is_rejected():
    frames, _, _ = message("float16")
    values = np.frombuffer(frames[1], dtype=np.float16).copy()
    values[3] = np.nan
    with pytest.raises(ProtocolError) as error:
        decode(frames[:1] + [values.tobytes()] + frames[2:], layout("float16"), world_size=4)
    assert error.value.reason == "non-finite"


@pytest.mark.parametrize("sent,ours", [("int8", "float16"), ("float16", "int8"), ("int8", "none")])
def test_a_peer_with_another_codec_is_named(sent, ours):
    frames, _, _ = message(sent)
    with pytest.raises(ProtocolError, match="every peer must use the same --compress") as error:
        decode(frames, dataclasses.replace(layout(sent), codec=ours), world_size=4)
    assert error.value.reason == "codec"


def test_a_compressed_kind_without_payload_is_rejected():
    header = dataclasses.replace(params_header("delta-i8", 1, layout("int8"), CHUNK))
    with pytest.raises(ProtocolError):
        decode([header.pack()], layout("int8"), world_size=4)
    with pytest.raises(ProtocolError):
        decode([Header(kind="delta-f16", sender=1).pack()], layout("float16"), world_size=4)


@pytest.mark.parametrize("change,message_part", [
    ({"mode": "gossip-async"}, "applies to --mode gossip-sync"),
    ({"deadline": "adaptive"}, "--deadline adaptive"),
    ({"weight_by": "samples"}, "--weight-by samples"),
    ({"aggregate": "median"}, "--aggregate median"),
    ({"byzantine": (1,)}, "--byzantine"),
    ({"compress": "int4"}, "compress"),
    ({"consensus_step": 0.0}, "--consensus-step"),
    ({"consensus_step": 1.5}, "--consensus-step"),
])
def test_compression_refuses_what_it_cannot_keep_exact(change, message_part):
    with pytest.raises(ConfigError, match=message_part):
        GossipConfig.of(world_size=4, **{"compress": "int8", **change})


def test_compression_refuses_restarts():
    with pytest.raises(ConfigError, match="--max-restarts"):
        RunConfig(max_restarts=1, gossip=GossipConfig.of(world_size=4, compress="int8"))


def choco(start: np.ndarray, spec: str, rounds: int, codec: str, step: float = 1.0,
          outer: tuple[float, float] | None = None) -> list[np.ndarray]:
    """CHOCO-gossip in one process, from the update rule: x^_i += Q(x_i - x^_i) for every peer, then
    x_i += gamma sum_j W_ij (x^_j - x^_i). With ``outer`` = (lr, mu) every peer then takes an outer Nesterov
    step from its anchor a_i: d = a_i - x_i, m_i <- mu m_i + d, x_i <- a_i - lr (d + mu m_i), a_i <- x_i.
    Returns x after each round (x[0] = start)."""
    topology = topologies.build(spec, len(start))
    x = [torch.tensor(row) for row in start]
    public = [torch.zeros_like(row) for row in x]
    anchors, momenta = [row.clone() for row in x], [torch.zeros_like(row) for row in x]
    history = [start]
    replicas: dict[int, torch.Tensor] = {}
    for round in range(rounds):
        sent = [encode_difference_(codec, x[i], public[i], scratch(len(x[i]), x[i].dtype)) for i in range(len(x))]
        w = topology.mixing_matrix(round)
        for i in range(len(x)):
            shares = 0.0
            for j in sorted(topology.in_neighbours(i, round)):
                replica = replicas.setdefault(j, torch.zeros_like(x[j]))  # every copy of x^_j is the same
                if i == min(topology.in_neighbours(j, round)):
                    add_decoded_(replica, codec, sent[j], scratch(len(replica), replica.dtype))
                x[i].add_(replica, alpha=step * float(w[i, j]))
                shares += float(w[i, j])
            x[i].add_(public[i], alpha=-step * shares)
        if outer is not None:
            lr, mu = outer
            for i in range(len(x)):
                change = anchors[i] - x[i]
                momenta[i] = mu * momenta[i] + change
                x[i] = anchors[i] - lr * (change + mu * momenta[i])
                anchors[i] = x[i].clone()
        history.append(np.stack([row.numpy().copy() for row in x]))
    return history


@pytest.mark.parametrize("codec,extra", [("int8", ()), ("float16", ()), ("int8", ("--no-overlap",))])
def test_compressed_gossip_keeps_the_mean_and_reaches_consensus(launch_run, codec, extra):
    nodes, rounds = 4, 40
    run = launch_run("--task", "consensus", "--steps", str(rounds), "--dim", "64", "--compress", codec, *extra,
                     nodes=nodes)
    recorded, x = load_traces(run.out, nodes)
    np.testing.assert_array_equal(recorded, np.arange(rounds + 1))
    start = np.stack([initial_vector(rank, 64, 0).numpy() for rank in range(nodes)])
    np.testing.assert_array_equal(x[0], start)
    expected = choco(start, "ring", rounds, codec)
    for t in range(rounds + 1):
        np.testing.assert_allclose(x[t], expected[t], rtol=0, atol=1e-12, err_msg=f"round {t}")
    assert max(np.abs(x[t].mean(0) - start.mean(0)).max() for t in range(rounds + 1)) < 1e-12
    assert run.summary["final_mean_drift"] < 1e-12
    floor = {"int8": 1e-12, "float16": 1e-6}[codec]  # float16 cannot send a difference below 2^-24
    assert distance(x[-1]) < max(floor, distance(x[0]) * 1e-6), [distance(v) for v in x[::8]]


@pytest.mark.parametrize("extra", [(), ("--no-overlap",)])
def test_compressed_gossip_with_an_outer_step_follows_its_closed_form_and_keeps_the_mean(launch_run, extra):
    """Decentralized DiLoCo with int8 messages, on the task without inner steps: each round is CHOCO's mix of
    the public copies followed by every peer's own outer Nesterov step (lr 0.7, momentum 0.9), to float64
    rounding; the pseudo-gradients cancel over the network, so its mean holds, and the copies still agree."""
    nodes, rounds = 4, 40
    run = launch_run("--task", "consensus", "--steps", str(rounds), "--dim", "64", "--compress", "int8",
                     "--outer-optimizer", "nesterov", *extra, nodes=nodes)
    recorded, x = load_traces(run.out, nodes)
    np.testing.assert_array_equal(recorded, np.arange(rounds + 1))
    start = np.stack([initial_vector(rank, 64, 0).numpy() for rank in range(nodes)])
    expected = choco(start, "ring", rounds, "int8", outer=(0.7, 0.9))
    plain = choco(start, "ring", rounds, "int8")
    assert max(np.abs(expected[t] - plain[t]).max() for t in range(rounds + 1)) > 0.1  # the outer step shows
    for t in range(rounds + 1):
        np.testing.assert_allclose(x[t], expected[t], rtol=0, atol=1e-12, err_msg=f"round {t}")
    assert max(np.abs(x[t].mean(0) - start.mean(0)).max() for t in range(rounds + 1)) < 1e-12
    ends = [next(e for e in run.events(rank) if e["event"] == "end") for rank in range(nodes)]
    assert [end.get("outer_steps") for end in ends] == [rounds] * nodes, ends
    assert distance(x[-1]) < distance(x[0]) * 1e-3, [distance(v) for v in x[::8]]


def test_compressed_gossip_sends_a_quarter_of_the_bytes(launch_run):
    # (on the ring, the graph compressed gossip runs on; uncompressed gossip-sync's own default sends half)
    sent = {codec: launch_run("--steps", "20", "--topology", "ring", "--compress", codec, name=codec).summary["bytes_sent"]
            for codec in ("none", "float16", "int8")}
    assert 0.5 < sent["float16"] / sent["none"] < 0.52, sent
    assert 0.25 < sent["int8"] / sent["none"] < 0.27, sent


@pytest.mark.parametrize("spec", ["random:degree=3", "exponential"])
def test_compression_needs_a_fixed_undirected_topology(spec):
    with pytest.raises(ConfigError, match="fixed undirected topology"):
        gossip.attach(vector_model(torch.zeros(4)), rank=0, world_size=8, topology=spec, compress="int8")


def test_compressed_gossip_goes_on_without_a_dead_neighbour(launch_run):
    run = launch_run("--compress", "int8", "--task", "tests.tasks:worker_1_dies", "--keep-going", "--peer-timeout",
                     "1", "--steps", "200", "--compute-ms", "5")
    assert "peer 1 failed (exit 9)" in run.stderr and "going on without it (--keep-going)" in run.stderr
    ends = {rank: [json.loads(line) for line in (run.out / f"peer-{rank}.jsonl").read_text().splitlines()][-1]
            for rank in (0, 2, 3)}
    assert all(end["event"] == "end" and end["step"] == 200 for end in ends.values()), ends
    assert ends[0]["dead_neighbours"] == [1] and ends[2]["dead_neighbours"] == [1]
    assert min(end["test"]["accuracy"] for end in ends.values()) >= 0.9, ends
