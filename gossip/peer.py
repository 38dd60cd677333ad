"""One peer process: ``python -m gossip.peer RUN_DIR/config.json --rank R``.

Builds the task, attaches an averager, trains for ``steps`` local steps (in the asynchronous modes until
the swarm has done ``steps`` per peer on average, ``Averager.done``), or under ``--schedule time`` for
``rounds`` rounds (with the emulated accelerator time and speed of ``--compute-ms``/``--speeds``), logs
events to ``peer-<rank>.jsonl`` and leaves ``model-<rank>.pt`` and ``trace-<rank>.npz`` (sampled weights
and push-sum weight per round, for the consensus distance and the drift of the mean).
Every ``--checkpoint-every`` steps it writes ``checkpoint-<rank>.pt`` (model, optimizer state, step,
round, samples, push-sum weight) atomically, keeping the previous one as ``checkpoint-<rank>.prev.pt``,
unless the state holds NaN or Inf; with ``--resume`` it restores the newest of the two that fits the model
(or, without one, takes its neighbours' mean model) and rejoins the others where they are.
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

from gossip import checkpoint
from gossip.api import gossip_outer, open_averager
from gossip.averagers import Averager
from gossip.checkpointer import Checkpointer
from gossip.config import RunConfig
from gossip.device import cpu_state, resolve_device
from gossip.errors import ConfigError, Diverged, GossipError, Stopped
from gossip.exit import exit_now
from gossip.flat import FlatParams
from gossip.metrics import EventLog, finite_or_none
from gossip.optim import run_schedule
from gossip.signals import raise_if_signalled, stop_on_signals
from gossip.tasks import Task, build_task, context_for

log = logging.getLogger("gossip.peer")
MAX_TRACE_RECORDS = 200
MAX_TRACE_VALUES = 1 << 21  # per peer, over all records: 8 MB of float32 (a 0.44 M-parameter charlm: 10,000 coordinates)
STEP_EXTRAS = ("staleness", "last_mix", "last_mixed_rounds", "weight", "deadline_misses",
               "stragglers", "swarm_steps", "rate_factor")  # mode-specific step fields


class Trace:
    """Sampled coordinates of the weights after every ``every``-th round (the same sample on every peer): at
    most ``MAX_TRACE_RECORDS`` rounds and ``MAX_TRACE_VALUES`` values in all."""

    def __init__(self, averager: Averager, coords: int, seed: int, rounds: int) -> None:
        self.flat = averager.flat
        numel = self.flat.numel
        self.every = max(1, math.ceil(rounds / MAX_TRACE_RECORDS))
        records = rounds // self.every + 2  # and round 0, and the final record
        size = min(coords, numel, max(1, MAX_TRACE_VALUES // records))
        picked = np.sort(np.random.default_rng(seed).choice(numel, size=size, replace=False))
        self.index = torch.from_numpy(picked)
        self.float64 = all(s.dtype == torch.float64 for s in self.flat.segments)
        self.averager = averager
        self.rounds: list[int] = []
        self.values: list[np.ndarray] = []
        self.weights: list[float] = []

    def record(self, round: int, final: bool = False) -> None:
        """Sample the weights after ``round``; ``final`` always, replacing a sample of the same round (the
        weights after close(), which may have mixed late mass in without a new round)."""
        if round % self.every and round != 0 and not final:
            return
        if final and self.rounds and self.rounds[-1] == round:
            del self.rounds[-1], self.values[-1], self.weights[-1]
        whole = torch.cat([s.detach().to("cpu", torch.float64) for s in self.flat.segments])
        self.rounds.append(round)
        self.values.append(whole[self.index].numpy().astype(np.float64 if self.float64 else np.float32))
        self.weights.append(getattr(self.averager, "weight", 1.0))  # push-sum weight (sync), else 1
        if len(self.rounds) > MAX_TRACE_RECORDS + 2:  # more rounds than planned (a swarm-wide budget): thin out
            self.every *= 2
            kept = [i for i, r in enumerate(self.rounds) if r % self.every == 0 or i == len(self.rounds) - 1]
            self.rounds = [self.rounds[i] for i in kept]
            self.values = [self.values[i] for i in kept]
            self.weights = [self.weights[i] for i in kept]

    def save(self, path: Path) -> None:
        np.savez(path, rounds=np.array(self.rounds), values=np.stack(self.values), index=self.index.numpy(),
                 weights=np.array(self.weights))


def checkpoint_path(out: Path, rank: int) -> Path:
    return out / f"checkpoint-{rank}.pt"


# What a peer's checkpoint holds besides the model and optimizer state (``gossip/checkpoint.py`` kinds)
COUNTERS = {"counters.step": checkpoint.COUNT, "counters.rounds": checkpoint.COUNT,
            "counters.samples": checkpoint.COUNT, "counters.weight": checkpoint.POSITIVE}


def checkpointer(out: Path, rank: int, events: EventLog, every: int = 0) -> Checkpointer:
    """Peer ``rank``'s checkpoint file, saved every ``every`` steps; without a usable one on ``--resume``
    the peer pulls its neighbours' models instead, as without one."""
    return Checkpointer(checkpoint_path(out, rank), f"peer {rank}", "step", COUNTERS, events, log, every,
                        fallback="resuming with the neighbours' mean model")


def checkpoint_state(task: Task, averager: Averager) -> dict:
    """What a peer's checkpoint holds: model, optimizer state and the averager's counters (and its outer
    step's state)."""
    kept = averager.state_dict()
    return {"model": cpu_state(task.model),
            "optimizer": task.optimizer.state_dict() if task.optimizer is not None else None,
            "counters": {k: v for k, v in kept.items() if k not in ("found", "outer")},
            **({"outer": kept["outer"]} if "outer" in kept else {})}


def save_checkpoint(out: Path, task: Task, averager: Averager, events: EventLog) -> None:
    """``checkpoint_state`` atomically, the previous checkpoint kept as ``.prev.pt`` (``gossip/checkpoint.py``).
    A state with NaN or Inf, or a bad counter, is not written: one warning and a ``checkpoint-skipped``
    event, and training goes on (a model that went non-finite is the run's health check's to fail)."""
    checkpointer(out, averager.rank, events).save(checkpoint_state(task, averager), averager.local_step)


def resumed_counters(state: dict) -> dict:
    """The counters of a checkpoint that ``open_averager(resume=...)`` takes."""
    return {key: state["counters"][key] for key in ("step", "rounds", "samples", "weight")}


def validate_checkpoint(state: object, path: Path, task: Task, bounds: dict[str, float] | None = None,
                        outer: bool = False) -> None:
    """``CheckpointError`` (one line: the file and what is wrong) unless ``state``, read from ``path``, is a
    checkpoint of ``task``'s model and optimizer with counters in range (``gossip/checkpoint.py``), and, with
    ``outer``, the outer step's anchor and momentum (checked against the model when loaded)."""
    keys = ("model", "optimizer", "counters", "outer") if outer else ("model", "optimizer", "counters")
    checkpoint.validate(state, path, keys=keys, counters=COUNTERS, bounds=bounds,
                        model=task.model.state_dict(),
                        optimizers={"optimizer": task.optimizer} if task.optimizer is not None else {})


def load_checkpoint(out: Path, rank: int, task: Task, events: EventLog, bounds: dict[str, float] | None = None,
                    outer: bool = False) -> dict:
    """``--resume``: restore the model and optimizer of our newest usable checkpoint into ``task`` (that
    one, else the ``.prev.pt`` before it, each checked before anything is loaded); the counters for
    ``open_averager(resume=...)``. ``bounds``: the largest counters this run allows (dotted key -> limit, 0:
    none). Each file that does not read or fit gives one warning and a ``checkpoint-rejected`` event; with
    no usable checkpoint the peer pulls its neighbours' models instead, as without one."""

    def load(state: dict) -> dict:
        task.model.load_state_dict(state["model"])
        if task.optimizer is not None and state["optimizer"] is not None:
            task.optimizer.load_state_dict(state["optimizer"])
        steps = {"outer_steps": int(state["outer"].get("steps", 0))} if outer else {}
        return {**resumed_counters(state), **steps}

    state = checkpointer(out, rank, events).resume(
        lambda state, path: validate_checkpoint(state, path, task, bounds, outer), load)
    if state is None:
        return {"found": False}
    return {**resumed_counters(state), "found": True, **({"outer": state["outer"]} if outer else {})}


def run(cfg: RunConfig, out: Path, local_rank: int | None = None, resume: bool = False) -> None:
    """Train as peer ``cfg.gossip.rank``; ``local_rank`` (default: the rank) picks the GPU of --device auto;
    ``resume``: continue from our checkpoint and rejoin the others."""
    rank = cfg.gossip.rank
    events = EventLog(out / f"peer-{rank}.jsonl")
    events.write("start", rank=rank, pid=os.getpid(), speed=cfg.speed(rank))
    try:
        device = resolve_device(cfg.device, rank if local_rank is None else local_rank)
        task = build_task(cfg.task, context_for(cfg, rank, device))
        bounds = {"counters.step": cfg.gossip.bounds.max_steps, "counters.weight": cfg.gossip.bounds.max_weight,
                  "counters.rounds": cfg.gossip.bounds.max_rounds + 1 if cfg.gossip.bounds.max_rounds else 0}
        steps_outer = not cfg.gossip.parameter_server and gossip_outer(cfg.coordinator) is not None
        state = load_checkpoint(out, rank, task, events, bounds, outer=steps_outer) if resume else None
        flat = FlatParams(task.model, cfg.gossip.network.chunk_bytes)
        averager = open_averager(flat, cfg.gossip, cfg.coordinator, state)
    except GossipError as exc:
        events.write("stopped" if isinstance(exc, Stopped) else "error", message=str(exc))
        raise
    started = time.time()
    events.write("ready", endpoint=cfg.gossip.endpoint(rank), device=str(device), step=averager.local_step,
                 round=averager.rounds, shard=task.shard, dataset=task.dataset)
    trace = Trace(averager, cfg.trace_coords, cfg.gossip.seed, cfg.total_rounds)
    trace.record(averager.rounds, final=True)  # round 0, or the round a restarted peer rejoined in
    try:
        with averager:
            last_step_began, trained_until = train(cfg, task, averager, trace, events, out)
    except GossipError as exc:
        exc = root_error(exc)
        events.write("stopped" if isinstance(exc, Stopped) else "error", message=str(exc), **averager.statistics())
        raise exc from None
    trace.record(averager.rounds, final=True)  # after close(): the last round or the late mass is mixed in
    metrics = task.evaluate()
    torch.save(cpu_state(task.model), out / f"model-{rank}.pt")
    trace.save(out / f"trace-{rank}.npz")
    events.write("end", wall_seconds=time.time() - started, test=metrics, last_step_began=last_step_began,
                 trained_until=trained_until, **averager.statistics())
    events.close()


def train(cfg: RunConfig, task: Task, averager: Averager, trace: Trace, events: EventLog, out: Path
          ) -> tuple[float | None, float]:
    """The training loop; returns when (wall clock) its last step began (None: it took none) and when it
    ended. It ends after ``--rounds`` mixing points (schedule "time"), or when the averager says a run of
    ``--steps`` is over (``Averager.done``: our own steps, or in the asynchronous modes the swarm's)."""
    slowdown = 1.0 / cfg.speed(averager.rank) - 1.0
    emulated = cfg.compute_ms / 1000.0 / cfg.speed(averager.rank)
    by_time = cfg.gossip.graph.schedule == "time"
    schedule = run_schedule(cfg)  # by our own step
    step = averager.local_step  # 0, or where a restarted peer rejoined
    keeper = checkpointer(out, averager.rank, events, cfg.checkpoint_every)
    last_step_began = None
    while (averager.mixing_points < cfg.rounds) if by_time else not averager.done(cfg.steps):
        raise_if_signalled()
        step += 1
        last_step_began = time.time()
        begin = time.perf_counter()
        if averager.sends_gradients:  # the server steps (with its own schedule, by version)
            loss = task.compute_gradients()
        else:
            if task.trains and not schedule.trivial:  # by our step, or the swarm's (Averager.schedule_step)
                schedule.apply(task.optimizer, averager.schedule_step() + 1)
            loss = task.train_step()
        computed = time.perf_counter() - begin
        if loss is not None and not math.isfinite(loss):  # the weights follow at once: stop now, say why
            lr = f" (now {task.optimizer.param_groups[0]['lr']:g})" if task.optimizer is not None else ""
            raise Diverged(f"peer {averager.rank} diverged: its training loss is {loss} at step {step}; lower "
                           f"--lr{lr}")
        pause = emulated + computed * slowdown  # a peer at speed s takes 1/s as long per step
        if pause > 0:
            time.sleep(pause)
        rounds_before, points_before = averager.rounds, averager.mixing_points
        averager.step(samples=task.samples_per_step)
        if averager.rounds != rounds_before:
            trace.record(averager.rounds)
        if step % cfg.log_every == 0 or step == cfg.steps:
            stats = averager.statistics()
            events.write("step", step=step, round=averager.rounds, loss=finite_or_none(loss),
                         bytes_sent=stats["bytes_sent"], bytes_received=stats["bytes_received"],
                         wait_seconds=stats["wait_seconds"], speed=stats["speed"],
                         step_seconds=stats["step_seconds"], mixed=averager.mixing_points != points_before,
                         lr=task.optimizer.param_groups[0]["lr"] if task.trains else None,
                         **{key: stats[key] for key in STEP_EXTRAS if key in stats})
        if task.trains and cfg.eval_every and step % cfg.eval_every == 0:
            events.write("eval", step=step, round=averager.rounds, **task.evaluate())
        if keeper.due(step):
            keeper.save(checkpoint_state(task, averager), averager.local_step)
    return last_step_began, time.time()


def _die_with_parent() -> None:
    """Linux: receive SIGTERM when the launcher dies, so no peer outlives a killed launcher."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


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
    parser.add_argument("--resume", action="store_true", help="continue from this process's last checkpoint")
    args = parser.parse_args(argv)
    if os.environ.get("GOSSIP_LAUNCHER_PID") == str(os.getppid()):
        _die_with_parent()

    def body() -> None:
        cfg = load_config(args.config, 0 if args.server else args.rank)
        torch.set_num_threads(cfg.threads_per_peer)
        run_role(cfg, args.config.parent, args.server, resume=args.resume)

    name = "server" if args.server else f"peer {args.rank}"
    return guarded(lambda: name, body)


def run_role(cfg: RunConfig, out: Path, server: bool, local_rank: int | None = None, resume: bool = False) -> None:
    if server:
        from gossip.coordinator.server import run_server

        run_server(cfg, out, resume=resume)
    else:
        run(cfg, out, local_rank, resume=resume)


def guarded(name: Callable[[], str], body: Callable[[], None]) -> int:
    """Run ``body`` as a peer process does: SIGINT/SIGTERM raise ``Stopped``, log lines carry ``name()``,
    and an error ends in one line on stderr. Returns the exit status (module docstring)."""
    stop_on_signals()
    logging.basicConfig(level=logging.INFO)
    name_logs(name())
    try:
        try:
            body()
        except GossipError as exc:
            raise root_error(exc) from None
    except Stopped as exc:
        print(f"{name()}: stopped by {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (GossipError, OSError) as exc:
        print(f"{name()}: {exc}", file=sys.stderr)
        return 1
    return 0


def root_error(exc: GossipError) -> GossipError:
    """The error that ended us: a stop signal that arrived while we were closing after an error of our own
    (the launcher stops every peer once one fails, and ours may be the one that did) is not the cause."""
    cause = exc.__context__
    if isinstance(exc, Stopped) and isinstance(cause, GossipError) and not isinstance(cause, Stopped):
        return cause
    return exc


def name_logs(name: str) -> None:
    """Prefix every log line with ``name`` (a peer learns its rank only at the rendezvous)."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"))


if __name__ == "__main__":
    exit_now(main())
