"""What staleness alone costs an AdamW parameter server on charlm: ps-async's update, in one process.

    python bench/async_adam.py --workers 4                # gradients exactly 3 versions stale (ps-async's typical)
    python bench/async_adam.py --workers 4 --fresh        # the same rule, every gradient on the newest weights
    python bench/async_adam.py --workers 2 --lr 1.5e-3 --beta1 0.4    # 1 version stale
    python bench/async_adam.py --workers 4 --versions 600 --probe 100  # how far the gradient turns in 3 versions
    python bench/async_adam.py --workers 4 --soft-sync 2 --lr 1.5e-3 --beta1 0.4 --versions 2000  # pairs, 1 stale
    python bench/async_adam.py --workers 4 --changes --lr 3e-3 --beta1 0.9   # workers' own AdamW, changes sent
    python bench/async_adam.py --workers 4 --predict 0.9   # gradients on weights moved 3 steps ahead

N workers (the charlm task's shards for a world of N, its model, batches of 16 sequences) take turns: worker
``v mod N`` computes a gradient on the weights it last pulled, the server's AdamW steps with it (lr and the
cosine schedule by version, as the server's do), and the worker pulls the new weights. Every gradient is then
exactly N - 1 versions stale, the typical staleness of a real ps-async run with N workers (its histogram
peaks there), with no messages, timing or process scheduling in the way. ``--fresh`` pulls before every
gradient instead: staleness 0, otherwise the same run. ``--soft-sync S``: each version steps with the mean
of the next S workers' gradients, as ``--soft-sync`` makes the real server do (with 4 workers and S = 2 every
gradient is 1 version stale). ``--changes``: the asynchronous exchange of parameter changes instead of
gradients; each worker steps its own AdamW (``--lr``, ``--beta1``, the schedule by its own step) from the
weights it pulled and the server adds 1/N of that change, so the optimizer's state never sees a stale
gradient, only the server's weights are behind. ``--predict BETA``: weight prediction, as SpecTrain (Chen
et al., 2018) uses it against the stale weights of pipeline-parallel training: each worker computes its
gradient not on the weights it pulled but on those moved N - 1 versions further along the server's recent
step, a moving average (factor BETA) of its steps, times ``--predict-scale`` (1: the whole staleness). The
defaults are the server's "auto" rule for AdamW with 4 workers (lr 3e-3 / 4, beta1 max(0, 0.9 - 0.75) =
0.15), 4,000 versions: the samples of a default 4-peer charlm run. Prints the server model's validation
loss every quarter of the run.

``--probe K``: every K versions, also the cosine between the gradients of one fixed batch of 64 evaluation
windows at the server's weights now and at its weights N - 1 versions before (the weights a stale gradient
is computed on), over all parameters and for the three tensors where it is lowest: how far the loss has
turned under the server in the time a gradient is stale.
"""

from __future__ import annotations

import argparse
import collections
import copy
import time

import torch

from gossip.optim import OptimizerSpec, Schedule
from gossip.tasks import TaskContext
from gossip.tasks.charlm import gather, make_task, next_char_loss
from gossip.tasks.corpus import read_corpus, windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--fresh", action="store_true", help="every gradient on the newest weights (staleness 0)")
    parser.add_argument("--soft-sync", type=int, default=1, metavar="S",
                        help="each version steps with the mean of the next S workers' gradients")
    parser.add_argument("--lr", type=float, default=7.5e-4, help="the server's peak lr")
    parser.add_argument("--beta1", type=float, default=0.15)
    parser.add_argument("--changes", action="store_true",
                        help="workers step their own AdamW; the server adds 1/N of each change")
    parser.add_argument("--predict", type=float, default=0.0, metavar="BETA",
                        help="workers compute on the pulled weights moved N - 1 steps along the server's "
                             "recent step (its moving average with this factor; 0: off)")
    parser.add_argument("--predict-scale", type=float, default=1.0,
                        help="the fraction of the N - 1 steps to move ahead (--predict)")
    parser.add_argument("--versions", type=int, default=4000)
    parser.add_argument("--probe", type=int, default=0, metavar="K",
                        help="every K versions, how far the gradient turned over the last N - 1 versions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = OptimizerSpec("adamw", args.lr, 0.9, (args.beta1, 0.999), 0.1)
    workers = [make_task(TaskContext(rank, args.workers, 0, batch_size=16, optimizer=spec))
               for rank in range(args.workers)]
    server = make_task(TaskContext(0, args.workers, 0, batch_size=16, optimizer=spec))
    schedule = Schedule("cosine", args.versions, args.versions // 20, 0.1)
    weights = list(server.model.parameters())

    drift = [torch.zeros_like(w) for w in weights]  # the moving average of the server's steps (--predict)
    last = [w.detach().clone() for w in weights]
    ahead = (args.workers - 1) * args.predict_scale

    def pull(worker) -> None:
        with torch.no_grad():
            for mine, theirs, d in zip(worker.model.parameters(), weights, drift):
                mine.copy_(theirs)
                if args.predict:
                    mine.add_(d, alpha=ahead)

    def note_step() -> None:
        if not args.predict:
            return
        with torch.no_grad():
            for d, w, old in zip(drift, weights, last):
                d.mul_(args.predict).add_(w - old, alpha=1 - args.predict)
                old.copy_(w)

    for worker in workers:
        pull(worker)
    probe = Probe(server, args.workers - 1) if args.probe else None
    steps = args.versions * args.soft_sync // args.workers  # each worker's share of the run (--changes)
    worker_schedule = Schedule("cosine", steps, steps // 20, 0.1)
    began = time.time()
    for version in range(1, args.versions + 1):
        if probe is not None:
            probe.keep()
        batch = [workers[turn % args.workers] for turn in range((version - 1) * args.soft_sync,
                                                                  version * args.soft_sync)]
        if args.changes:
            exchange_change(batch, weights, args, version, worker_schedule, pull)
        else:
            step_with_gradients(batch, weights, server, schedule, version, args.fresh, pull, note_step)
        if probe is not None and version % args.probe == 0:
            print(f"version {version}: {probe.turn()}", flush=True)
        if version % (args.versions // 4) == 0:
            print(f"version {version}: validation loss {server.evaluate()['loss']:.4f} "
                  f"({time.time() - began:.0f} s)", flush=True)


def step_with_gradients(batch, weights, server, schedule, version, fresh, pull, note_step) -> None:
    """The server's AdamW steps with the mean of the batch's gradients; the batch's workers pull after."""
    for target in weights:
        target.grad = torch.zeros_like(target)
    for worker in batch:
        if fresh:
            pull(worker)
        worker.compute_gradients()
        for target, source in zip(weights, worker.model.parameters()):
            target.grad.add_(source.grad, alpha=1.0 / len(batch))
    schedule.apply(server.optimizer, version)
    server.optimizer.step()
    note_step()
    for worker in batch:
        pull(worker)


def exchange_change(batch, weights, args, version, schedule, pull) -> None:
    """Each of the batch's workers steps its own AdamW (``schedule`` by its own step) from the weights it
    pulled, the server adds 1/N of the change, and the worker pulls the server's weights."""
    for turn, worker in enumerate(batch):
        if args.fresh:
            pull(worker)
        before = [p.detach().clone() for p in worker.model.parameters()]
        worker.compute_gradients()
        schedule.apply(worker.optimizer, ((version - 1) * args.soft_sync + turn) // args.workers + 1)
        worker.optimizer.step()
        with torch.no_grad():
            for target, mine, old in zip(weights, worker.model.parameters(), before):
                target.add_(mine - old, alpha=1.0 / args.workers)
        pull(worker)


class Probe:
    """The gradient of one fixed batch at the server's weights now and ``lag`` versions before, computed on a
    copy of the model so the server's own is never touched."""

    def __init__(self, server, lag: int) -> None:
        corpus = read_corpus()
        cut = windows(corpus, 64)
        text = torch.from_numpy(corpus.text.copy())
        self.batch = gather(text, torch.from_numpy(cut.eval[:64]), 65)
        self.server = server.model
        self.model = copy.deepcopy(server.model)
        self.names = [name for name, _ in server.model.named_parameters()]
        self.lag = lag
        self.history: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=lag)

    def keep(self) -> None:
        """Before each version: the weights the next update starts from (the oldest kept, ``lag`` versions
        before the weights after it, is what a gradient ``lag`` versions stale was computed on)."""
        self.history.append([p.detach().clone() for p in self.server.parameters()])

    def _gradient(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights):
                p.copy_(w)
        self.model.zero_grad(set_to_none=True)
        next_char_loss(self.model, self.batch).backward()
        return [p.grad for p in self.model.parameters()]

    def turn(self) -> str:
        now = self._gradient([p.detach() for p in self.server.parameters()])  # new tensors: zero_grad set None
        before = self._gradient(self.history[0])
        cos = torch.nn.functional.cosine_similarity
        whole = cos(torch.cat([g.flatten() for g in now]), torch.cat([g.flatten() for g in before]), dim=0)
        lowest = sorted((cos(a.flatten(), b.flatten(), dim=0).item(), name)
                        for a, b, name in zip(now, before, self.names))[:3]
        return (f"gradient cosine with {self.lag} versions before {whole.item():.2f}; lowest "
                + ", ".join(f"{name} {value:.2f}" for value, name in lowest))


if __name__ == "__main__":
    main()
