"""What staleness alone costs an AdamW parameter server on charlm: ps-async's update, in one process.

    python bench/async_adam.py --workers 4                # gradients exactly 3 versions stale (ps-async's typical)
    python bench/async_adam.py --workers 4 --fresh        # the same rule, every gradient on the newest weights
    python bench/async_adam.py --workers 2 --lr 1.5e-3 --beta1 0.4    # 1 version stale

N workers (the charlm task's shards for a world of N, its model, batches of 16 sequences) take turns: worker
``v mod N`` computes a gradient on the weights it last pulled, the server's AdamW steps with it (lr and the
cosine schedule by version, as the server's do), and the worker pulls the new weights. Every gradient is then
exactly N - 1 versions stale, the typical staleness of a real ps-async run with N workers (its histogram
peaks there), with no messages, timing or process scheduling in the way. ``--fresh`` pulls before every
gradient instead: staleness 0, otherwise the same run. The defaults are the server's "auto" rule for AdamW
with 4 workers (lr 3e-3 / 4, beta1 max(0, 0.9 - 0.75) = 0.15), 4,000 versions: the samples of a default
4-peer charlm run. Prints the server model's validation loss every quarter of the run.
"""

from __future__ import annotations

import argparse
import time

import torch

from gossip.optim import OptimizerSpec, Schedule
from gossip.tasks import TaskContext
from gossip.tasks.charlm import make_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--fresh", action="store_true", help="every gradient on the newest weights (staleness 0)")
    parser.add_argument("--lr", type=float, default=7.5e-4, help="the server's peak lr")
    parser.add_argument("--beta1", type=float, default=0.15)
    parser.add_argument("--versions", type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = OptimizerSpec("adamw", args.lr, 0.9, (args.beta1, 0.999), 0.1)
    workers = [make_task(TaskContext(rank, args.workers, 0, batch_size=16, optimizer=spec))
               for rank in range(args.workers)]
    server = make_task(TaskContext(0, args.workers, 0, batch_size=16, optimizer=spec))
    schedule = Schedule("cosine", args.versions, args.versions // 20, 0.1)
    weights = list(server.model.parameters())

    def pull(worker) -> None:
        with torch.no_grad():
            for mine, theirs in zip(worker.model.parameters(), weights):
                mine.copy_(theirs)

    for worker in workers:
        pull(worker)
    began = time.time()
    for version in range(1, args.versions + 1):
        worker = workers[(version - 1) % args.workers]
        if args.fresh:
            pull(worker)
        worker.compute_gradients()
        schedule.apply(server.optimizer, version)
        for target, source in zip(weights, worker.model.parameters()):
            target.grad = source.grad.clone()
        server.optimizer.step()
        pull(worker)
        if version % (args.versions // 4) == 0:
            print(f"version {version}: validation loss {server.evaluate()['loss']:.4f} "
                  f"({time.time() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
