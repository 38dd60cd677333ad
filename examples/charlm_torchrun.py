"""A plain PyTorch training loop for a character-level transformer, with gossip averaging added in three
lines (marked ###): a DataLoader, AdamW and a warm-up + cosine ``LambdaLR``, all as PyTorch has them.

Start it with torchrun, one process per peer, on one machine:

    torchrun --standalone --nproc-per-node 4 examples/charlm_torchrun.py

``gossip.attach`` takes the rank and world size from torchrun's variables and meets the other processes
through torchrun's store, so the same script runs on several machines (``torchrun --nnodes 2 ...
--rdzv-backend c10d --rdzv-endpoint HOST:29400``) without a list of endpoints: each peer listens on
(--base-port + rank) at the address it reaches the store from, and averages its weights with its ring
neighbours after every step. The model and the data are the built-in charlm task's pieces; put your own
model and Dataset in their place.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch.utils.data import DataLoader, Dataset

import gossip  ###
from gossip.tasks.charlm import CharTransformer, evaluator, gather, next_char_loss
from gossip.tasks.corpus import read_corpus, windows


class Windows(Dataset):
    """Windows of context + 1 characters of the standard library's sources (inputs, then targets)."""

    def __init__(self, text: torch.Tensor, starts: torch.Tensor, length: int) -> None:
        self.text, self.starts, self.length = text, starts, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> torch.Tensor:
        return gather(self.text, self.starts[index:index + 1], self.length)[0]


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    def factor(step: int) -> float:  # LambdaLR's step counts from 0: the first update uses factor(0)
        if step < warmup:
            return (step + 1) / warmup
        return floor + (1 - floor) * (1 + math.cos(math.pi * min(1.0, (step + 1 - warmup) / (total - warmup)))) / 2
    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--base-port", type=int, default=47000)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, or cuda: this machine's GPU of the process's LOCAL_RANK (default: cuda if any)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # N peers on one machine must not oversubscribe its cores
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every peer
    model = CharTransformer(context=args.context).to(device)  # attach mixes the weights where they are
    averager = gossip.attach(model, base_port=args.base_port)  ###
    rank, world_size = averager.rank, averager.config.world_size

    corpus = read_corpus()
    cut = windows(corpus, args.context)
    text = torch.from_numpy(corpus.text.copy())
    mine = torch.from_numpy(cut.train[rank::world_size])  # this peer's shard
    loader = DataLoader(Windows(text, mine, args.context + 1), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(rank), drop_last=True,
                        pin_memory=device.type == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps // 20, args.steps))

    step = 0
    with averager:
        while step < args.steps:
            for batch in loader:
                optimizer.zero_grad()
                loss = next_char_loss(model, batch.to(device, non_blocking=True))
                loss.backward()
                optimizer.step()
                scheduler.step()
                averager.step(samples=len(batch))  ###
                step += 1
                if step == args.steps:
                    break
    metrics = evaluator(model, gather(text, torch.from_numpy(cut.eval), args.context + 1).to(device))()
    # one write of the whole line: the peers share torchrun's stdout, and print's text and newline are two
    print(f"peer {rank}: validation loss {metrics['loss']:.4f} nats ({metrics['bits_per_char']:.3f} bits per "
          f"character) after {step} steps, {averager.rounds} gossip rounds\n", end="", flush=True)


if __name__ == "__main__":
    main()
