"""The baseline users would otherwise pick: PyTorch DistributedDataParallel with gloo all-reduce.

    python bench/ddp.py --nodes 8 --steps 400 --speeds 1,1,1,1,1,1,1,0.25 --compute-ms 50 --out DIR

Starts one real process per rank (``python bench/ddp.py --rank R ...``), each training the model of the
digits task (``--task digits``, the default) or of ``digits-wide`` (``--task digits-wide``) on its own
shard with the same initial weights, minibatches, learning rate and momentum as a gossip peer (built from
the same pieces as ``gossip.tasks.digits.make_task``, but with the forward pass through the DDP wrapper),
so the runs differ only in how the gradients or weights meet.
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

from gossip.metrics import EventLog
from gossip.tasks.digits import HIDDEN, WIDE_HIDDEN, batches, evaluator, load_split, make_model, shard

TASKS = {"digits": HIDDEN, "digits-wide": WIDE_HIDDEN}  # task -> hidden widths, as the gossip task of that name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--task", choices=TASKS, default="digits", help="the model: that of the gossip task")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--speeds", type=lambda text: [float(s) for s in text.split(",")], default=None)
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (ranks on other hosts)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=None, help="internal: run one rank")
    args = parser.parse_args(argv)
    args.speeds = args.speeds or [1.0] * args.nodes
    if len(args.speeds) != args.nodes:
        parser.error(f"--speeds lists {len(args.speeds)} values for {args.nodes} nodes")
    return args


def rank_main(args: argparse.Namespace) -> None:
    rank, speed = args.rank, args.speeds[args.rank]
    torch.set_num_threads(1)
    events = EventLog(args.out / f"peer-{rank}.jsonl")
    events.write("start", rank=rank, pid=os.getpid(), speed=speed)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}", rank=rank,
                            world_size=args.nodes, timeout=datetime.timedelta(seconds=120))
    x_train, y_train, x_test, y_test = load_split()
    mine = torch.from_numpy(shard(len(x_train), rank, args.nodes, args.seed))
    model = make_model(args.seed, x_train.shape[1], TASKS[args.task])
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights: a start barrier
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    stream = batches(x_train[mine], y_train[mine], args.batch_size, args.seed * 1000 + rank)
    evaluate = evaluator(model, x_test, y_test)
    own_compute = time_compute(model, x_train[mine][:args.batch_size], y_train[mine][:args.batch_size])
    events.write("ready", endpoint=f"gloo rank {rank}")
    started = time.time()
    for step in range(1, args.steps + 1):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        F.cross_entropy(ddp(inputs), targets).backward()  # DDP all-reduces here, waiting for every rank
        optimizer.step()
        time.sleep(args.compute_ms / 1000 / speed + own_compute * (1 / speed - 1))
        if rank == 0 and step % args.eval_every == 0:
            events.write("eval", step=step, round=step, **evaluate())
    metrics = evaluate()
    events.write("end", wall_seconds=time.time() - started, step=args.steps, rounds=args.steps, test=metrics)
    events.close()
    dist.destroy_process_group()


def time_compute(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, repeats: int = 21) -> float:
    """Median seconds of one forward and backward pass on the bare model (no all-reduce)."""
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        F.cross_entropy(model(inputs), targets).backward()
        times.append(time.perf_counter() - begin)
    model.zero_grad()
    return sorted(times)[repeats // 2]


def launch(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, __file__, "--nodes", str(args.nodes), "--task", args.task, "--steps", str(args.steps),
              "--speeds", ",".join(map(str, args.speeds)), "--compute-ms", str(args.compute_ms),
              "--eval-every", str(args.eval_every), "--lr", str(args.lr), "--momentum", str(args.momentum),
              "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--port", str(args.port),
              "--out", str(args.out)]
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
