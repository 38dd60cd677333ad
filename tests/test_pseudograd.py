"""ps-avg's compressed contributions (gossip/coordinator/pseudograd.py): what the server rebuilds is what the
worker thinks it rebuilt, bit for bit, and what the codec rounds away goes out with the next contribution."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip.coordinator.pseudograd import ErrorFeedback, decode_contribution
from gossip.flat import FlatParams


def model_flat(seed: int) -> FlatParams:
    torch.manual_seed(seed)
    return FlatParams(nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5)), 1024)  # several rows of the plan


@pytest.mark.parametrize("codec", ["int8", "float16"])
def test_the_server_rebuilds_what_the_worker_expects_and_the_rounding_goes_out_next_time(codec):
    worker, server = model_flat(0), model_flat(1)
    worker.copy_([view.clone() for view in server.views()])  # the worker takes the server's weights W_v
    feedback = ErrorFeedback(worker, codec)
    feedback.start()
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        for view in worker.views():  # local steps
            view.add_(torch.randn(view.shape, generator=generator) * 0.01)
        wanted = [view + residual for view, residual in zip(worker.views(), feedback.residual)]
        change = [target - base for target, base in zip(wanted, feedback.base)]  # what should reach the server
        rebuilt = decode_contribution(server, codec, feedback.encode())
        for chunk, base, residual, target, sent in zip(rebuilt, feedback.base, feedback.residual, wanted, change):
            assert torch.equal(chunk, base)  # the same arithmetic on both sides
            torch.testing.assert_close(chunk + residual, target, rtol=0, atol=1e-6)  # nothing lost: owed
            # rounded by at most half a quantum: of the block's largest change / 127 (int8), of 2^-11 (float16)
            limit = sent.abs().max() / 254 if codec == "int8" else sent.abs().max() * 2.0 ** -11
            assert residual.abs().max() <= limit * 1.01 + 1e-7, (residual.abs().max(), limit)
        # the server moves to the mean of its workers (here: this one), and the worker takes it
        server.copy_(rebuilt)
        worker.copy_([chunk.clone() for chunk in rebuilt])
        feedback.start()


@pytest.mark.slow
def test_diloco_with_int8_pseudo_gradients_sends_a_quarter_and_learns_as_much(launch_run):
    run = ["--mode", "ps-avg", "--steps", "200", "--local-steps", "10", "--outer-optimizer", "nesterov"]
    plain = launch_run(*run, name="plain").summary
    int8 = launch_run(*run, "--compress", "int8", name="int8").summary
    uplink = [sum(p["bytes_sent"] for p in summary["peers"]) for summary in (plain, int8)]
    # int8 values plus one float32 scale per block, and the headers: a little over a quarter
    assert 3.5 < uplink[0] / uplink[1] < 4.0, uplink
    assert int8["server"]["dropped"] == {} and int8["server"]["updates"] == plain["server"]["updates"]
    assert int8["accuracy"] >= plain["accuracy"] - 0.02, (int8["accuracy"], plain["accuracy"])
