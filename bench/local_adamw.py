"""What local AdamW alone costs on charlm: every peer's own AdamW with the copies averaged exactly after every
step, against one AdamW on the mean gradient (ps-sync's and DDP's update), in one process.

    python bench/local_adamw.py --workers 4
    python bench/local_adamw.py --workers 8

N workers (the charlm task's shards for a world of N, its model, batches of 16 sequences, AdamW at the
recipe's lr 3e-3, weight decay 0.1, 5% warm-up and cosine decay to a tenth over ``--steps``) run two ways
from the same initial model:

- ``local``: each worker steps its own AdamW on its own batch, then every copy is set to the exact mean of
  the copies (gossip on the full graph, mixed before the next step: no topology, no staleness, no network);
  the AdamW moments stay each worker's own, as in gossip-sync.
- ``global``: one AdamW steps with the mean of the N workers' gradients on the same batches: ps-sync.

Whatever gap is left between them is what local AdamW costs, which no graph can close. Prints the validation
loss of the (mean) model every quarter of the run for both.
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
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = OptimizerSpec("adamw", args.lr, 0.9, (0.9, 0.999), 0.1)
    schedule = Schedule("cosine", args.steps, args.steps // 20, 0.1)
    local = [make_task(TaskContext(rank, args.workers, 0, batch_size=16, optimizer=spec))
             for rank in range(args.workers)]
    shards = [make_task(TaskContext(rank, args.workers, 0, batch_size=16, optimizer=spec))
              for rank in range(args.workers)]  # the global run's batches: the same shards, in the same order
    server = make_task(TaskContext(0, args.workers, 0, batch_size=16, optimizer=spec))
    for task in local + shards:  # one initial model, as the launcher's peers start from
        assert all(torch.equal(a, b) for a, b in zip(task.model.parameters(), server.model.parameters()))
    began = time.time()
    for step in range(1, args.steps + 1):
        for worker in local:
            schedule.apply(worker.optimizer, step)
            worker.train_step()
        average_([w.model for w in local])
        global_step(server, shards, schedule, step)
        if step % (args.steps // 4) == 0:
            print(f"step {step}: local {local[0].evaluate()['loss']:.4f}, global {server.evaluate()['loss']:.4f} "
                  f"({time.time() - began:.0f} s)", flush=True)


def average_(models: list[torch.nn.Module]) -> None:
    """Set every copy to the exact mean of the copies."""
    with torch.no_grad():
        for tensors in zip(*(m.parameters() for m in models)):
            mean = torch.stack(tensors).mean(dim=0)
            for t in tensors:
                t.copy_(mean)


def global_step(server, shards, schedule, step: int) -> None:
    """One AdamW step of ``server`` with the mean of the shards' gradients, each at the server's weights."""
    weights = list(server.model.parameters())
    for target in weights:
        target.grad = torch.zeros_like(target)
    for shard in shards:
        with torch.no_grad():
            for mine, theirs in zip(shard.model.parameters(), weights):
                mine.copy_(theirs)
        shard.compute_gradients()
        for target, source in zip(weights, shard.model.parameters()):
            target.grad.add_(source.grad, alpha=1.0 / len(shards))
    schedule.apply(server.optimizer, step)
    server.optimizer.step()


if __name__ == "__main__":
    main()
