"""What one charlm step costs: forward, backward and an AdamW step of the built-in task, on one thread.

    python bench/charlm_step.py                 # the default model and two larger ones, about a minute
    python bench/charlm_step.py --steps 50 --sizes 2x128x64x16
    python bench/charlm_step.py --device cuda --sizes 2x128x64x16,6x384x256x64,12x768x256x32
    python bench/charlm_step.py --sizes 2x128x64x16 --peers 4   # as one of 4 gossip-sync peers: SwarmAdamW

Each size is LAYERSxWIDTHxCONTEXTxBATCH. The task is built as a peer builds it (``gossip.tasks.charlm``,
the charlm recipe's AdamW), then ``--warmup`` steps are run untimed and ``--steps`` timed one by one; the
table gives the median and the 10th-90th percentiles in milliseconds, the parameters, and one evaluation
(256 windows of held-out text). ``--peers N``: the task as rank 0 of N gossip-sync peers at the defaults
builds it, whose AdamW is ``SwarmAdamW`` for N (``gossip/swarm_adamw.py``). Run it alone: other processes on
the cores change the numbers.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from gossip.config import GossipConfig, RunConfig
from gossip.tasks import build_task, context_for


def time_size(layers: int, width: int, context: int, batch: int, steps: int, warmup: int,
              device: torch.device, peers: int = 1) -> dict:
    cfg = RunConfig(task="charlm", nodes=peers, layers=layers, model_dim=width, heads=max(1, width // 32),
                    context=context, batch_size=batch, gossip=GossipConfig.of(world_size=peers))
    task = build_task("charlm", context_for(cfg, 0, device))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        task.train_step()
    times = []
    for _ in range(steps):
        sync()
        begin = time.perf_counter()
        task.train_step()  # .item() of the loss waits for the GPU too
        sync()
        times.append(time.perf_counter() - begin)
    begin = time.perf_counter()
    task.evaluate()
    sync()
    evaluation = time.perf_counter() - begin
    deciles = statistics.quantiles(times, n=10)
    return {"parameters": sum(p.numel() for p in task.model.parameters()), "median_ms": 1000 * statistics.median(times),
            "p10_ms": 1000 * deciles[0], "p90_ms": 1000 * deciles[-1], "eval_ms": 1000 * evaluation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda text: text.split(","), default=["2x128x64x16", "4x128x128x32",
                                                                             "4x256x128x32"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    parser.add_argument("--peers", type=int, default=1, help="time rank 0 of this many gossip-sync peers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"machine: {platform.machine()}, {platform.processor() or platform.system()}; torch {torch.__version__}, "
          f"{where}")
    print("| layers x width x context x batch | parameters | ms per step (median) | 10th-90th percentile | "
          "one evaluation |")
    print("| --- | --- | --- | --- | --- |")
    for size in args.sizes:
        layers, width, context, batch = map(int, size.split("x"))
        r = time_size(layers, width, context, batch, args.steps, args.warmup, args.device, args.peers)
        print(f"| {size} | {r['parameters'] / 1e6:.2f} M | {r['median_ms']:.1f} | "
              f"{r['p10_ms']:.1f}-{r['p90_ms']:.1f} | {r['eval_ms']:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
