"""The baseline users would otherwise pick: PyTorch DistributedDataParallel with gloo all-reduce.

    python bench/ddp.py --nodes 8 --steps 400 --speeds 1,1,1,1,1,1,1,0.25 --compute-ms 50 --out DIR
    python bench/ddp.py --task charlm --nodes 4 --compute-ms 0 --eval-every 100 --out DIR  # its recipe

Starts one real process per rank (``python bench/ddp.py --rank R ...``), each training the model of the
gossip task of the same name on its own shard with the same initial weights, minibatches, optimizer and
learning-rate schedule as a gossip peer: ``digits`` (the default) and ``digits-wide`` with SGD as in
``gossip.tasks.digits.make_task``; ``charlm`` with the pieces of ``gossip.tasks.charlm.make_task`` and, for
every flag left at auto, the same recipe as ``python -m launch --task charlm`` (``gossip/recipes.py``), its
schedule stepped by the rank's step as a gossip peer steps its own. Only the forward pass differs: it goes
through the DDP wrapper, so the runs differ only in how the gradients or weights meet.
Every step emulates the same accelerator time as ``python -m launch --compute-ms``: a sleep of
compute_ms / speed plus (1 / speed - 1) times the rank's own compute, so a rank at speed 0.25 takes four
times as long and, because every all-reduce waits for every rank, so does every step of every rank. (The
own compute is timed once on the bare model before training: timing DDP's backward would count the
all-reduce, i.e. the wait for the other ranks, as compute, and slow the slow rank further.) Rank 0
evaluates the (identical) model every ``--eval-every`` steps. Each rank writes ``peer-<rank>.jsonl`` in the
launcher's event format (``ready``, ``eval``, ``end``), so the same analysis reads both.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gossip.config import GossipConfig, RunConfig
from gossip.metrics import EventLog
from gossip.optim import run_schedule
from gossip.tasks import charlm, context_for
from gossip.tasks.corpus import read_corpus, windows
from gossip.tasks.digits import HIDDEN, WIDE_HIDDEN, batches, evaluator, load_split, make_model, shard

TASKS = {"digits": HIDDEN, "digits-wide": WIDE_HIDDEN, "charlm": None}  # hidden widths of the digits MLPs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--task", choices=TASKS, default="digits", help="the model: that of the gossip task")
    parser.add_argument("--steps", default="auto", help="auto: the task's recipe (digits 300, charlm 1000)")
    parser.add_argument("--speeds", type=lambda text: [float(s) for s in text.split(",")], default=None)
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--lr", default="auto")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch-size", default="auto")
    parser.add_argument("--partition", default="iid", help="as the launcher's --partition")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (ranks on other hosts)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=None, help="internal: run one rank")
    args = parser.parse_args(argv)
    args.speeds = args.speeds or [1.0] * args.nodes
    if len(args.speeds) != args.nodes:
        parser.error(f"--speeds lists {len(args.speeds)} values for {args.nodes} nodes")
    # the launcher's own resolution of the recipe, so that "auto" means the same here as there
    args.run = RunConfig(nodes=args.nodes, task=args.task, steps=args.steps, lr=args.lr, momentum=args.momentum,
                         batch_size=args.batch_size, partition=args.partition,
                         gossip=GossipConfig.of(world_size=args.nodes, seed=args.seed))
    return args


def one_optimizer(ctx, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer as one process steps it: DDP's gradient is already the mean of the N ranks', so
    AdamW's second moment is its own (no SwarmAdamW, which the gossip peers of the same flags get)."""
    return dataclasses.replace(ctx.optimizer, peers=1).build(model.parameters())


def digits_parts(args: argparse.Namespace, rank: int):
    """(model, loss of the next batch through ``forward``, evaluate, optimizer, a batch for timing)."""
    cfg = args.run
    x_train, y_train, x_test, y_test = load_split()
    mine = torch.from_numpy(shard(y_train.numpy(), rank, args.nodes, args.seed, cfg.partition, cfg.batch_size))
    model = make_model(args.seed, x_train.shape[1], TASKS[args.task])
    optimizer = one_optimizer(context_for(cfg, rank), model)
    stream = batches(x_train[mine], y_train[mine], cfg.batch_size, args.seed * 1000 + rank)

    def loss(forward) -> torch.Tensor:
        inputs, targets = next(stream)
        return F.cross_entropy(forward(inputs), targets)

    first = (x_train[mine][:cfg.batch_size], y_train[mine][:cfg.batch_size])
    return model, loss, evaluator(model, x_test, y_test), optimizer, lambda: F.cross_entropy(model(first[0]), first[1])


def charlm_parts(args: argparse.Namespace, rank: int):
    ctx = context_for(args.run, rank)
    corpus = read_corpus(ctx.data)
    cut = windows(corpus, ctx.context)
    text = torch.from_numpy(corpus.text.copy())
    model = charlm.make_model(ctx)
    optimizer = one_optimizer(ctx, model)
    stream = charlm.batches(text, charlm.shard(corpus, cut, ctx), ctx.batch_size, ctx.context + 1,
                            args.seed * 1000 + rank, ctx.device)
    held_out = charlm.gather(text, torch.from_numpy(cut.eval), ctx.context + 1)
    first = next(charlm.batches(text, cut.train, ctx.batch_size, ctx.context + 1, 0, ctx.device))
    return (model, lambda forward: charlm.next_char_loss(forward, next(stream)), charlm.evaluator(model, held_out),
            optimizer, lambda: charlm.next_char_loss(model, first))


def rank_main(args: argparse.Namespace) -> None:
    rank, speed, cfg = args.rank, args.speeds[args.rank], args.run
    torch.set_num_threads(1)
    events = EventLog(args.out / f"peer-{rank}.jsonl")
    events.write("start", rank=rank, pid=os.getpid(), speed=speed)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}", rank=rank,
                            world_size=args.nodes, timeout=datetime.timedelta(seconds=120))
    model, loss, evaluate, optimizer, bare_loss = (charlm_parts if args.task == "charlm" else digits_parts)(args, rank)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights: a start barrier
    schedule = run_schedule(cfg)
    own_compute = time_compute(model, bare_loss)
    events.write("ready", endpoint=f"gloo rank {rank}")
    started = time.time()
    for step in range(1, cfg.steps + 1):
        if not schedule.trivial:
            schedule.apply(optimizer, step)
        optimizer.zero_grad()
        loss(ddp).backward()  # DDP all-reduces here, waiting for every rank
        optimizer.step()
        time.sleep(args.compute_ms / 1000 / speed + own_compute * (1 / speed - 1))
        if rank == 0 and step % args.eval_every == 0:
            events.write("eval", step=step, round=step, **evaluate())
    metrics = evaluate()
    events.write("end", wall_seconds=time.time() - started, step=cfg.steps, rounds=cfg.steps, test=metrics)
    events.close()
    dist.destroy_process_group()


def time_compute(model: torch.nn.Module, bare_loss, repeats: int = 21) -> float:
    """Median seconds of one forward and backward pass on the bare model (no all-reduce)."""
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        bare_loss().backward()
        times.append(time.perf_counter() - begin)
    model.zero_grad()
    return sorted(times)[repeats // 2]


def launch(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, __file__, "--nodes", str(args.nodes), "--task", args.task, "--steps", str(args.steps),
              "--speeds", ",".join(map(str, args.speeds)), "--compute-ms", str(args.compute_ms),
              "--eval-every", str(args.eval_every), "--lr", str(args.lr), "--momentum", str(args.momentum),
              "--batch-size", str(args.batch_size), "--partition", args.partition, "--seed", str(args.seed),
              "--port", str(args.port), "--out", str(args.out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for rank in range(args.nodes):
            with open(args.out / f"peer-{rank}.log", "wb") as log:
                procs.append(subprocess.Popen([*common, "--rank", str(rank)], env=env, stdout=log, stderr=log))
        return max(p.wait(timeout=1800) for p in procs)
    finally:
        for p in procs:  # only our own children, by handle
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(rank_main(arguments) if arguments.rank is not None else launch(arguments))
