"""One peer process: ``python -m gossip.peer RUN_DIR/config.json --rank R``.

Builds the task, attaches an averager, trains for ``steps`` local steps (with the emulated accelerator
time and speed of ``--compute-ms``/``--speeds``), logs events to ``peer-<rank>.jsonl`` and leaves
``model-<rank>.pt`` and ``trace-<rank>.npz`` (sampled weights per round, for the consensus distance).
Exit status: 0 on success, 1 on an error (one line on stderr says which and why), 128 + signal number
when stopped by SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gossip.api import attach
from gossip.averagers import Averager
from gossip.config import RunConfig
from gossip.device import cpu_state, resolve_device
from gossip.errors import ConfigError, GossipError, Stopped
from gossip.metrics import EventLog, finite_or_none
from gossip.tasks import Task, TaskContext, build_task

log = logging.getLogger("gossip.peer")
MAX_TRACE_RECORDS = 200


class Trace:
    """Sampled coordinates of the weights after every ``every``-th round (the same sample on every peer)."""

    def __init__(self, averager: Averager, coords: int, seed: int, rounds: int) -> None:
        self.flat = averager.flat
        numel = self.flat.numel
        picked = np.sort(np.random.default_rng(seed).choice(numel, size=min(coords, numel), replace=False))
        self.index = torch.from_numpy(picked)
        self.every = max(1, math.ceil(rounds / MAX_TRACE_RECORDS))
        self.float64 = all(s.dtype == torch.float64 for s in self.flat.segments)
        self.rounds: list[int] = []
        self.values: list[np.ndarray] = []

    def record(self, round: int) -> None:
        if round % self.every and round != 0:
            return
        whole = torch.cat([s.detach().to("cpu", torch.float64) for s in self.flat.segments])
        self.rounds.append(round)
        self.values.append(whole[self.index].numpy().astype(np.float64 if self.float64 else np.float32))

    def save(self, path: Path) -> None:
        np.savez(path, rounds=np.array(self.rounds), values=np.stack(self.values), index=self.index.numpy())


def run(cfg: RunConfig, out: Path, local_rank: int | None = None) -> None:
    """Train as peer ``cfg.gossip.rank``; ``local_rank`` (default: the rank) picks the GPU of --device auto."""
    rank = cfg.gossip.rank
    events = EventLog(out / f"peer-{rank}.jsonl")
    events.write("start", rank=rank, pid=os.getpid(), speed=cfg.speed(rank))
    try:
        device = resolve_device(cfg.device, rank if local_rank is None else local_rank)
        task = build_task(cfg.task, TaskContext(rank, cfg.nodes, cfg.gossip.seed, cfg.lr, cfg.momentum,
                                                cfg.batch_size, cfg.dim, device))
        averager = attach(task.model, cfg.gossip, coordinator=cfg.coordinator)
    except GossipError as exc:
        events.write("stopped" if isinstance(exc, Stopped) else "error", message=str(exc))
        raise
    started = time.time()
    events.write("ready", endpoint=cfg.gossip.endpoint(rank), device=str(device))
    trace = Trace(averager, cfg.trace_coords, cfg.gossip.seed, cfg.steps // cfg.gossip.gossip_every)
    trace.record(0)
    try:
        with averager:
            train(cfg, task, averager, trace, events)
    except GossipError as exc:
        events.write("stopped" if isinstance(exc, Stopped) else "error", message=str(exc), **averager.statistics())
        raise
    trace.record(averager.rounds) if averager.rounds not in trace.rounds else None
    metrics = task.evaluate()
    torch.save(cpu_state(task.model), out / f"model-{rank}.pt")
    trace.save(out / f"trace-{rank}.npz")
    events.write("end", wall_seconds=time.time() - started, test=metrics, **averager.statistics())
    events.close()


def train(cfg: RunConfig, task: Task, averager: Averager, trace: Trace, events: EventLog) -> None:
    slowdown = 1.0 / cfg.speed(averager.rank) - 1.0
    emulated = cfg.compute_ms / 1000.0 / cfg.speed(averager.rank)
    for step in range(1, cfg.steps + 1):
        begin = time.perf_counter()
        loss = task.compute_gradients() if averager.sends_gradients else task.train_step()
        computed = time.perf_counter() - begin
        pause = emulated + computed * slowdown  # a peer at speed s takes 1/s as long per step
        if pause > 0:
            time.sleep(pause)
        rounds_before = averager.rounds
        averager.step(samples=task.samples_per_step)
        if averager.rounds != rounds_before:
            trace.record(averager.rounds)
        if step % cfg.log_every == 0 or step == cfg.steps:
            stats = averager.statistics()
            events.write("step", step=step, round=averager.rounds, loss=finite_or_none(loss),
                         bytes_sent=stats["bytes_sent"], bytes_received=stats["bytes_received"],
                         wait_seconds=stats["wait_seconds"], speed=stats["speed"],
                         **({"staleness": stats["staleness"]} if "staleness" in stats else {}))
        if task.trains and cfg.eval_every and step % cfg.eval_every == 0:
            events.write("eval", step=step, round=averager.rounds, **task.evaluate())


def _die_with_parent() -> None:
    """Linux: receive SIGTERM when the launcher dies, so no peer outlives a killed launcher."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def load_config(path: Path, rank: int) -> RunConfig:
    try:
        return RunConfig.from_dict(json.loads(path.read_text())).for_rank(rank)
    except (OSError, ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"cannot read the run configuration {path}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gossip.peer", description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="config.json written by the launcher")
    role = parser.add_mutually_exclusive_group(required=True)
    role.add_argument("--rank", type=int, help="run worker/peer RANK")
    role.add_argument("--server", action="store_true", help="run the parameter server (ps-* modes)")
    args = parser.parse_args(argv)
    if os.environ.get("GOSSIP_LAUNCHER_PID") == str(os.getppid()):
        _die_with_parent()

    def body() -> None:
        cfg = load_config(args.config, 0 if args.server else args.rank)
        torch.set_num_threads(cfg.threads_per_peer)
        run_role(cfg, args.config.parent, args.server)

    name = "server" if args.server else f"peer {args.rank}"
    return guarded(lambda: name, body)


def run_role(cfg: RunConfig, out: Path, server: bool, local_rank: int | None = None) -> None:
    if server:
        from gossip.coordinator.server import run_server

        run_server(cfg, out)
    else:
        run(cfg, out, local_rank)


def guarded(name: Callable[[], str], body: Callable[[], None]) -> int:
    """Run ``body`` as a peer process does: SIGINT/SIGTERM raise ``Stopped``, log lines carry ``name()``,
    and an error ends in one line on stderr. Returns the exit status (module docstring)."""
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_stopped)
    logging.basicConfig(level=logging.INFO)
    name_logs(name())
    try:
        body()
    except Stopped as exc:
        print(f"{name()}: stopped by {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (GossipError, OSError) as exc:
        print(f"{name()}: {exc}", file=sys.stderr)
        return 1
    return 0


def name_logs(name: str) -> None:
    """Prefix every log line with ``name`` (a peer learns its rank only at the rendezvous)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))


if __name__ == "__main__":
    sys.exit(main())
