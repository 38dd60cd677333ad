"""What local AdamW alone costs on charlm: every peer's own AdamW with the copies mixed after every step,
against one AdamW on the mean gradient (ps-sync's and DDP's update), in one process.

    python bench/local_adamw.py --workers 4
    python bench/local_adamw.py --workers 8
    python bench/local_adamw.py --workers 8 --graph exponential --no-global [--lr LR] [--tracking]
    python bench/local_adamw.py --workers 8 --graph exponential --second-moment swarm [--seed S]
    python bench/local_adamw.py --workers 4 --graph ring --second-moment oracle --no-global

N workers (the charlm task's shards for a world of N, its model, batches of 16 sequences, AdamW at the
recipe's lr 3e-3 or ``--lr``, weight decay 0.1, 5% warm-up and cosine decay to a tenth over ``--steps``) run
two ways from the same initial model:

- ``local``: each worker steps its own AdamW on its own batch, then the copies are mixed, x_i <- sum_j W_ij
  x_j (no staleness, no network): with ``--graph full`` set to their exact mean, so no topology can do
  better; with ``--graph exponential`` on SGP's one-peer exponential graph, round t's W being the one
  ``topologies`` gives gossip-sync's default (the real run without overlap follows the same x <- W x). The
  AdamW moments stay each worker's own, as in gossip-sync. ``--second-moment swarm``: each worker's
  AdamW is ``SwarmAdamW`` for N peers (``gossip/swarm_adamw.py``), gossip-sync's default on the
  exponential graph; ``oracle``: divided instead by the second moment of the workers' exact mean gradient,
  what SwarmAdamW estimates; ``own`` (the default here): PyTorch's AdamW. ``--graph ring``: the ring's
  Metropolis-Hastings W.
- ``global``: one AdamW steps with the mean of the N workers' gradients on the same batches: ps-sync
  (``--no-global`` leaves it out).

``--tracking``: gradient tracking (DIGing: Nedic, Olshevsky & Shi, "Achieving geometric convergence for
distributed optimization over time-varying graphs", SIAM J. Optim. 2017; with Adam, GT-Adam: Carnevale et
al., 2022). Each worker keeps y_i, its estimate of the mean gradient, y_i <- y_i + g_i - g_i', g_i' its
previous gradient; AdamW steps on y_i instead of g_i, and the y_i are mixed with the same W as the weights
(twice the bytes of plain gossip). sum_i y_i = sum_i g_i at every step, so its mean is the mean gradient,
but each y_i carries the unmixed noise of its last two gradients.

Prints the validation loss of the mean model every quarter of the run for both.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from gossip.optim import OptimizerSpec, Schedule
from gossip.tasks import TaskContext
from gossip.tasks.charlm import make_task
from topologies import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="the launcher's --seed: the initial model and batches")
    parser.add_argument("--graph", choices=("full", "exponential", "ring"), default="full")
    parser.add_argument("--tracking", action="store_true", help="AdamW on a gradient tracker, mixed too")
    parser.add_argument("--no-global", dest="run_global", action="store_false", help="leave out one AdamW")
    parser.add_argument("--second-moment", choices=("own", "swarm", "oracle"), default="own",
                        help="the workers' AdamW: PyTorch's, SwarmAdamW for N peers, or divided by the second "
                             "moment of the workers' exact mean gradient")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = OptimizerSpec("adamw", args.lr, 0.9, (0.9, 0.999), 0.1)
    mine = replace(spec, peers=args.workers if args.second_moment == "swarm" else 1)
    oracle = OracleSecondMoment() if args.second_moment == "oracle" else None
    schedule = Schedule("cosine", args.steps, args.steps // 20, 0.1)
    topology = build(args.graph, args.workers)
    local = [make_task(TaskContext(rank, args.workers, args.seed, batch_size=16, optimizer=mine))
             for rank in range(args.workers)]
    shards = [make_task(TaskContext(rank, args.workers, args.seed, batch_size=16, optimizer=spec))
              for rank in range(args.workers)]  # the global run's batches: the same shards, in the same order
    server = make_task(TaskContext(0, args.workers, args.seed, batch_size=16, optimizer=spec))
    mean = make_task(TaskContext(0, args.workers, args.seed, batch_size=16, optimizer=spec))
    for task in local + shards + [mean]:  # one initial model, as the launcher's peers start from
        assert all(torch.equal(a, b) for a, b in zip(task.model.parameters(), server.model.parameters()))
    weights = [list(w.model.parameters()) for w in local]
    trackers = [[torch.zeros_like(t) for t in ws] for ws in weights]
    previous = [[torch.zeros_like(t) for t in ws] for ws in weights]
    began = time.time()
    for step in range(1, args.steps + 1):
        for worker, mine, tracker, before in zip(local, weights, trackers, previous):
            schedule.apply(worker.optimizer, step)
            worker.compute_gradients()
            if args.tracking:
                track_(mine, tracker, before)
            if oracle is None:
                worker.optimizer.step()
        if oracle is not None:
            oracle.step_(local, step)
        mixing = torch.tensor(topology.mixing_matrix(step - 1))
        mix_(weights, mixing)
        if args.tracking:
            mix_(trackers, mixing)
        if args.run_global:
            global_step(server, shards, schedule, step)
        if step % (args.steps // 4) == 0:
            average_into_(list(mean.model.parameters()), weights)
            other = f", global {server.evaluate()['loss']:.4f}" if args.run_global else ""
            print(f"step {step}: local {mean.evaluate()['loss']:.4f}{other} ({time.time() - began:.0f} s)",
                  flush=True)


class OracleSecondMoment:
    """Each worker's AdamW (its own first moment, decoupled weight decay on its groups, its scheduled lr)
    divided by the root of the second moment of the workers' exact mean gradient: what SwarmAdamW estimates,
    known here because one process holds every worker's gradient."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.betas, self.eps = betas, eps
        self.first: dict[int, torch.Tensor] = {}
        self.second: list[torch.Tensor] = []

    def step_(self, workers, t: int) -> None:
        beta1, beta2 = self.betas
        copies = [list(w.model.parameters()) for w in workers]
        with torch.no_grad():
            means = [torch.stack([c[k].grad for c in copies]).mean(dim=0) for k in range(len(copies[0]))]
            if not self.second:
                self.second = [torch.zeros_like(m) for m in means]
            for v, mean in zip(self.second, means):
                v.mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
            index = {id(p): k for c in copies for k, p in enumerate(c)}
            for worker in workers:
                for group in worker.optimizer.param_groups:
                    for p in group["params"]:
                        m = self.first.setdefault(id(p), torch.zeros_like(p))
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                        m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                        denom = (self.second[index[id(p)]] / (1 - beta2 ** t)).sqrt_().add_(self.eps)
                        p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1 ** t))


def track_(weights: list[torch.Tensor], tracker: list[torch.Tensor], previous: list[torch.Tensor]) -> None:
    """y <- y + g - g', remember g, and put y where the optimizer reads the gradient."""
    with torch.no_grad():
        for weight, y, before in zip(weights, tracker, previous):
            y.add_(weight.grad).sub_(before)
            before.copy_(weight.grad)
            weight.grad.copy_(y)


def mix_(copies: list[list[torch.Tensor]], mixing: torch.Tensor) -> None:
    """x_i <- sum_j W_ij x_j for every tensor of the workers' copies."""
    with torch.no_grad():
        for tensors in zip(*copies):
            stacked = torch.stack(tensors)
            mixed = torch.tensordot(mixing.to(stacked.dtype), stacked, dims=1)
            for tensor, new in zip(tensors, mixed):
                tensor.copy_(new)


def average_into_(target: list[torch.Tensor], copies: list[list[torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, tensors in zip(target, zip(*copies)):
            tensor.copy_(torch.stack(tensors).mean(dim=0))


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
