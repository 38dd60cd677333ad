"""Compressed ps-avg (gossip/coordinator/pseudograd.py): the server and its workers hold the same public
weights bit for bit, the server takes each worker's own change, and what the codec rounds away in either
direction goes out with the next message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip.coordinator.pseudograd import Answers, ErrorFeedback
from gossip.flat import FlatParams


def model_flat(seed: int) -> FlatParams:
    torch.manual_seed(seed)
    return FlatParams(nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5)), 1024)  # several rows of the plan


def quantum(change: torch.Tensor, codec: str) -> torch.Tensor:
    """Half a quantum of the codec for ``change``: of its largest value / 127 (int8), of 2^-11 (float16)."""
    return change.abs().max() / 254 if codec == "int8" else change.abs().max() * 2.0 ** -11


@pytest.mark.parametrize("codec", ["int8", "float16"])
def test_both_sides_hold_the_same_public_weights_and_the_rounding_goes_out_next_time(codec):
    server = model_flat(1)
    answers = Answers(server, codec, version=0)
    workers = [model_flat(0), model_flat(2)]
    feedbacks = [ErrorFeedback(flat, codec) for flat in workers]
    for rank, feedback in enumerate(feedbacks):  # they join: P whole
        kind, frames = answers.answer(rank, whole=True)
        assert kind == "weights"
        feedback.take(kind, frames)
    generator = torch.Generator().manual_seed(2)
    for version in range(1, 4):
        contributions = []
        for flat, feedback in zip(workers, feedbacks, strict=True):
            for view in flat.views():  # local steps
                view.add_(torch.randn(view.shape, generator=generator) * 0.01)
            wanted = [view + residual for view, residual in zip(flat.views(), feedback.residual)]
            change = [target - public for target, public in zip(wanted, feedback.public)]  # what should arrive
            rebuilt = answers.decode_contribution(feedback.encode())
            for chunk, weights, public, residual, target, sent in zip(
                    rebuilt, server.views(), feedback.public, feedback.residual, wanted, change):
                # the server takes its own weights plus the worker's change from P, rounded
                torch.testing.assert_close(chunk - weights + public + residual, target, rtol=0, atol=1e-6)
                assert residual.abs().max() <= quantum(sent, codec) * 1.01 + 1e-7  # owed, and at most that
            contributions.append(rebuilt)
        server.copy_([sum(chunks) / len(chunks) for chunks in zip(*contributions)])  # the plain average
        answers.advance(version)
        for rank, feedback in enumerate(feedbacks):
            kind, frames = answers.answer(rank)
            assert kind == answers.kind  # each held the previous version: the change goes
            feedback.take(kind, frames)
            for public, mine, view in zip(answers.rows.public, feedback.public, workers[rank].views()):
                assert torch.equal(public, mine) and torch.equal(view, mine)  # the same arithmetic on both sides
        for public, weights in zip(answers.rows.public, server.views()):  # what P still owes W: rounding only
            assert (weights - public).abs().max() <= 0.01, (weights - public).abs().max()
    assert answers.answer(0)[0] == "weights"  # sent this version already: a second answer is whole
    assert answers.answer(1, whole=True)[0] == "weights"  # a hello is answered with P whole


def test_low_precision_weights_get_every_answer_whole():
    flat = FlatParams(nn.Linear(8, 4).to(torch.bfloat16), 1024)
    answers = Answers(flat, "int8", version=0)
    answers.answer(0, whole=True)
    flat.segments[0].add_(1.0)
    answers.advance(1)
    kind, frames = answers.answer(0)
    assert kind == "weights" and frames[0].dtype == torch.bfloat16


def test_diloco_with_int8_both_ways_sends_a_quarter_and_learns_as_much(launch_run):
    run = ["--mode", "ps-avg", "--steps", "200", "--local-steps", "10", "--outer-optimizer", "nesterov"]
    plain = launch_run(*run, name="plain").summary
    int8 = launch_run(*run, "--compress", "int8", name="int8").summary
    uplink = [sum(p["bytes_sent"] for p in summary["peers"]) for summary in (plain, int8)]
    downlink = [summary["server"]["bytes_sent"] for summary in (plain, int8)]
    # int8 values plus one float32 scale per block, and the headers: a little over a quarter each way (the
    # server sends every worker its weights whole once, when it joins)
    assert 3.5 < uplink[0] / uplink[1] < 4.0, uplink
    assert 3.0 < downlink[0] / downlink[1] < 4.0, downlink
    assert int8["server"]["dropped"] == {} and int8["server"]["updates"] == plain["server"]["updates"]
    assert int8["accuracy"] >= plain["accuracy"] - 0.02, (int8["accuracy"], plain["accuracy"])
