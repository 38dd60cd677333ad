"""A library user's program for the tests: ``torchrun --standalone --nproc-per-node N
tests/attach_script.py BASE_PORT STEPS`` passes no rank, world size or endpoint (``gossip.attach`` takes them
from torchrun); ``python tests/attach_script.py BASE_PORT STEPS RANK WORLD_SIZE`` passes them. Each peer's one weight starts at its rank and nothing trains, so the mixing alone moves
it; every process prints one JSON line with what it ended with."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

import gossip


def main() -> None:
    base_port, steps = int(sys.argv[1]), int(sys.argv[2])
    given = dict(zip(("rank", "world_size"), map(int, sys.argv[3:5])))
    model = nn.Linear(1, 1, bias=False)
    averager = gossip.attach(model, base_port=base_port, lazy_snapshot=False, **given)
    with torch.no_grad():
        model.weight.fill_(float(averager.rank))
    with averager:
        for _ in range(steps):
            averager.step()
    report = json.dumps({"rank": averager.rank, "world_size": averager.config.world_size, "rounds": averager.rounds,
                         "weight": model.weight.item(), "endpoints": list(averager.config.network.endpoints)})
    os.write(1, f"{report}\n".encode())  # one write: the processes share torchrun's stdout


if __name__ == "__main__":
    main()
