"""An ordinary PyTorch training loop with gossip averaging added in three lines (marked ###).

Run one process per peer, e.g. in three terminals:

    python examples/ordinary_loop.py --rank 0 --world-size 3
    python examples/ordinary_loop.py --rank 1 --world-size 3
    python examples/ordinary_loop.py --rank 2 --world-size 3

or let the script start them all on this machine:  python examples/ordinary_loop.py --world-size 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

import gossip  ###
from gossip.tasks.digits import load_split


def train(rank: int, world_size: int, base_port: int, steps: int) -> float:
    x_train, y_train, x_test, y_test = load_split()
    x, y = x_train[rank::world_size], y_train[rank::world_size]  # this peer's shard
    torch.manual_seed(0)  # the same initial weights on every peer
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averager = gossip.attach(model, rank=rank, world_size=world_size, base_port=base_port)  ###
    generator = torch.Generator().manual_seed(rank)
    with averager:
        for step in range(steps):
            batch = torch.randint(len(x), (32,), generator=generator)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            averager.step(samples=len(batch))  ###
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"peer {rank}: test accuracy {accuracy:.3f} after {steps} steps, {averager.rounds} gossip rounds")
    return accuracy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, help="this peer's rank; omit to start every rank here")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--base-port", type=int, default=47000, help="peer r listens on 127.0.0.1:BASE_PORT+r")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.rank is not None:
        train(args.rank, args.world_size, args.base_port, args.steps)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # N peers on one machine must not oversubscribe its cores
    peers = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world-size", str(args.world_size),
                               "--base-port", str(args.base_port), "--steps", str(args.steps)], env=env,
                              stdout=subprocess.PIPE, text=True)
             for r in range(args.world_size)]
    for peer in peers:  # each peer's report printed whole: N processes sharing one pipe can interleave lines
        sys.stdout.write(peer.communicate(timeout=300)[0])
    return max(peer.returncode for peer in peers)


if __name__ == "__main__":
    sys.exit(main())
