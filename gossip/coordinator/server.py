"""The parameter-server process: one loop that receives workers' contributions in arrival order, feeds
them to the mode's ``ServerCore`` and answers with its weights.

Logs ``server.jsonl`` (``ready`` with the optimizer's learning rate, momentum and the rule that chose
them; ``update`` per applied batch with its version, workers and their staleness; ``reply`` per answer with
the worker's clock and its lead over the slowest worker; ``end`` with the staleness histogram) and leaves the
final model as ``model-final.pt``. After every update the server checks its weights (``gossip/health.py``)
and stops with ``Diverged`` once they hold NaN or Inf or have blown up, instead of serving them.
The update rules themselves are in ``modes.py`` and ``core.py``; this loop is what they
share: barriers, versions, replies, checkpoints and the plausibility checks on workers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from pathlib import Path

import torch

from gossip import checkpoint
from gossip.checkpointer import Checkpointer
from gossip.config import RunConfig, robust_rules
from gossip.connect import connector
from gossip.coordinator.averaging import ParameterAverage
from gossip.coordinator.core import Contribution, ServerCore
from gossip.coordinator.mailboxes import QueueMailbox
from gossip.coordinator.modes import ASYNCHRONOUS, SENDS_WEIGHTS, build_core, outer_optimizer, server_optimizer
from gossip.coordinator.pseudograd import Answers
from gossip.coordinator.rates import ArrivalRates
from gossip.device import cpu_state
from gossip.errors import Diverged, GossipError, PeerTimeout, Stopped, TransportError
from gossip.flat import FlatParams
from gossip.health import model_problem
from gossip.link import Connect
from gossip.metrics import EventLog
from gossip.net.wire import CODEC_KINDS, Header, Message, encode, params_header
from gossip.optim import run_schedule
from gossip.signals import raise_if_signalled
from gossip.tasks import build_task, context_for

log = logging.getLogger("gossip.server")
# The counters of the server's checkpoint (``gossip/checkpoint.py`` kinds)
CHECKPOINT_COUNTERS = {"joined": checkpoint.COUNTS, "core.contributed": checkpoint.COUNT,
                       "core.version": checkpoint.COUNT, "core.updates": checkpoint.COUNT,
                       "core.clocks": checkpoint.COUNTS, "core.active": checkpoint.COUNTS,
                       "core.staleness": checkpoint.COUNT_MAP}


class ParameterServer:
    def __init__(self, cfg: RunConfig, out: Path, events: EventLog, connect: Connect | None = None) -> None:
        """``connect(mailbox)``: the link to the workers (``gossip/link.py``; default: ZeroMQ's)."""
        self.cfg = cfg
        self.out = out
        self.config = cfg.gossip
        self.events = events
        self.workers = cfg.nodes
        self.rank = self.config.server_rank
        # on the CPU whatever --device says: its update rules take the workers' host buffers as they come
        context = context_for(cfg, 0)
        self.task = build_task(cfg.task, context)
        self.flat = FlatParams(self.task.model, self.config.chunk_bytes)
        self.optimizer = outer_optimizer(cfg.coordinator) if self.config.mode == "ps-avg" else \
            server_optimizer(self.config.mode, context.optimizer, self.workers, cfg.coordinator, run_schedule(cfg))
        self.core: ServerCore = build_core(self.config.mode, cfg.coordinator, self.flat,
                                           self.optimizer.build(self.task.model.parameters()), self.workers,
                                           self.optimizer.schedule, cfg.nodes * cfg.steps if self.config.swarm_budget else 0,
                                           memory=self._compensates("sgd"), aggregate=self.config.aggregate,
                                           trim_fraction=self.config.trim_fraction)
        # an AdamW server's rate compensation: each gradient weighted rbar / r_i (rates.py, memory.py say why)
        self.rates = ArrivalRates(self.workers) if self._compensates("adamw") else None
        contribution = "params" if self.config.mode in SENDS_WEIGHTS else "grad"
        layout = self.flat.layout
        if self.config.compress != "none":  # ps-avg: changes both ways, compressed (pseudograd.py)
            contribution = CODEC_KINDS[self.config.compress]
            layout = dataclasses.replace(layout, codec=self.config.compress)
        self.mailbox = QueueMailbox(self.rank, self.workers + 1, layout,
                                    expects=lambda sender, round: sender < self.workers, capacity=4 * self.workers,
                                    contribution=contribution)
        self.mailbox.max_steps, self.mailbox.max_weight = self.config.max_steps, 1.0  # workers send weight 1
        self.transport = (connect or connector(self.config, self.rank, self.flat.layout, server=True))(self.mailbox)
        self.joined: set[int] = set()
        self.finished: set[int] = set()  # said bye
        self.started = time.monotonic()
        self.last_heard: dict[int, float] = {}  # worker -> its last message, or our last answer to it
        self.dropped: Counter[str] = Counter()  # implausible contributions (the transport counts the rest)
        self.answers: Answers | None = None  # compressed ps-avg: our public weights (made once serving)
        # a server has no neighbours to take a model from: without a usable checkpoint it cannot resume
        self.checkpoints = Checkpointer(out / "checkpoint-server.pt", "server", "version", CHECKPOINT_COUNTERS,
                                        events, log, cfg.checkpoint_every, title="the parameter server")

    def _compensates(self, optimizer: str) -> bool:
        """Rate compensation applies, and the server steps ``optimizer``: an asynchronous gradient mode."""
        return (self.config.mode in ASYNCHRONOUS and self.config.rate_compensation == "on"
                and self.optimizer.name == optimizer)

    def serve(self) -> None:
        """Answer workers until every one has said bye."""
        self.transport.start()
        if self.config.compress != "none":  # (after a resume: the public copy starts as the weights)
            self.answers = Answers(self.flat, self.config.compress, self.core.version)
        optimizer = self.optimizer.describe() if self._steps_an_optimizer() else None
        if optimizer:
            log.info("server: %s with lr %.4g, %s %.4g (%s)", optimizer["name"], optimizer["lr"],
                     "beta1" if optimizer["name"] == "adamw" else "momentum", optimizer["momentum"], optimizer["rule"])
        self.events.write("ready", endpoint=self.config.endpoint(self.rank), mode=self.config.mode,
                          version=self.core.version, optimizer=optimizer)
        while self.core.active:
            raise_if_signalled()
            message = self.mailbox.get(min(1.0, self._wait_seconds()))
            if message is not None:
                self.last_heard[message.header.sender] = time.monotonic()
                self._handle(message)
            self._check_silent()

    def _handle(self, message: Message) -> None:
        header = message.header
        worker = header.sender
        if worker in self.finished:  # a worker says nothing after its bye
            raise TransportError(f"worker {worker} sent a {header.kind} after its bye: someone forged that bye "
                                 "in its name (run with --secure on an untrusted network)")
        if header.kind == "hello" and self._holds_contribution_of(worker):
            self._acknowledge(worker)  # it only asks whether we are alive
        elif header.kind == "hello":
            self.joined.add(worker)
            if self.rates is not None:
                self.rates.joined(worker, time.monotonic())
            self._reply(self.core.join(worker, header.step), whole=True)
        elif header.kind == "bye":
            if self._plausible_bye(message):
                self.finished.add(worker)
                self._reply(self.core.leave(worker))
        elif self._plausible(message):
            weight = 1.0 if self.rates is None else self.rates.arrived(worker, time.monotonic(),
                                                                       len(self.core.active))
            chunks = message.chunks if self.answers is None else self.answers.decode_contribution(message.chunks)
            self._reply(self.core.submit(Contribution(worker, header.version, header.step, chunks,
                                                      header.samples, weight)))

    def _holds_contribution_of(self, worker: int) -> bool:
        return worker in self.core.held or any(c.worker == worker for c in self.core.pending)

    def _acknowledge(self, worker: int) -> None:
        ack = encode(Header(kind="hello", sender=self.rank, round=self.core.version, step=self.core.clocks[worker]))
        self.transport.post([worker], ack, latest_only=False, timeout=self.config.send_timeout)

    def _check_silent(self) -> None:
        """Workers we wait for that sent nothing for a whole timeout: fail naming them, or (``--missing-worker
        continue``) give up on them and go on with the others, as soft synchronisation does."""
        now, limit = time.monotonic(), self._wait_seconds()
        silent = [w for w in self._waiting_on() if now - self.last_heard.get(w, self.started) > limit]
        if not silent:
            return
        if self.cfg.coordinator.missing_worker == "fail" or len(self.joined) < self.workers:
            raise PeerTimeout(self._silence(silent))
        for worker in silent:
            log.warning("server: worker %d sent nothing for %.0f s; going on without it", worker,
                        self.config.round_timeout)
            self.events.write("gone", worker=worker, version=self.core.version)
            self._reply(self.core.leave(worker))

    def _log_applied(self) -> None:
        if self.core.applied:
            self._check_weights(self.core.applied[-1].version)
        for applied in self.core.applied:
            self.events.write("update", version=applied.version, workers=applied.workers,
                              staleness=applied.staleness, active=len(self.core.active), lr=applied.lr)
            if self.cfg.eval_every and applied.version % self.cfg.eval_every == 0:
                self.events.write("eval", version=applied.version, contributions=self.core.contributed,
                                  **self.task.evaluate())
            if self.checkpoints.due(applied.version):
                self.save_checkpoint()
        self.core.applied = []

    def _check_weights(self, version: int) -> None:
        """Stop, before anyone is sent them, when the weights an update produced are no longer a model."""
        problem = model_problem(self.flat.segments)
        if problem is None:
            return
        if self.config.byzantine and self.config.aggregate == "mean":
            advice = ("the --byzantine workers' garbage reached the plain mean: use --aggregate "
                      f"{robust_rules(self.config.mode)}")
        elif not self._steps_an_optimizer():
            advice = f"lower --lr (now {self.cfg.lr:g}) or --local-steps"
        elif self.config.mode in SENDS_WEIGHTS:
            advice = (f"lower --lr (now {self.cfg.lr:g}), --local-steps or --outer-lr (now {self.optimizer.lr:.4g}, "
                      f"momentum {self.optimizer.momentum:.4g})")
        else:
            advice = (f"lower --lr (now {self.cfg.lr:g}; the server stepped with peak lr {self.optimizer.lr:.4g}, "
                      f"momentum {self.optimizer.momentum:.4g}) or set --server-lr")
        raise Diverged(f"the server's model diverged at version {version}: {problem}; {advice}")

    def norm_bound(self) -> dict:
        """``--aggregate norm-clip``: the gradients it clipped, dropped and left unjudged, and its last
        reference norm (``normbound.py``), for the end event; nothing under the other rules."""
        bound = getattr(self.core.update, "bound", None)
        return {"norm_bound": bound.statistics()} if bound is not None else {}

    def _steps_an_optimizer(self) -> bool:
        """Every gradient mode, and ps-avg with an outer optimizer; plain averaging has none."""
        return not isinstance(self.core.update, ParameterAverage)

    def _plausible(self, message: Message) -> bool:
        """A worker waits for our answer before its next contribution, and cannot have computed on a
        version we never sent: anything else is a replay or a lie, dropped and counted."""
        worker, version = message.header.sender, message.header.version
        waiting = {c.worker for c in self.core.pending} | self.core.held
        # (a compressed change is one from our weights of its version: only the current one is still ours)
        stale = self.config.compress != "none" and version < self.core.version
        reason = ("not-joined" if worker not in self.joined else "duplicate" if worker in waiting
                  else "version" if version > self.core.version or stale else None)
        if reason is None:
            return True
        self.dropped[reason] += 1
        log.warning("server dropped a contribution from worker %d (%s): version %d, ours %d", worker, reason,
                    version, self.core.version)
        return False

    def _plausible_bye(self, message: Message) -> bool:
        """A worker says bye once it has our answer to its last contribution, naming its step, which that
        contribution carried: a bye that does not fit is someone else's, dropped and counted."""
        worker, step = message.header.sender, message.header.step
        waiting = {c.worker for c in self.core.pending} | self.core.held
        reason = ("not-joined" if worker not in self.joined else "bye-waiting" if worker in waiting
                  else "bye-step" if step != self.core.clocks[worker] else None)
        if reason is None:
            return True
        self.dropped[reason] += 1
        log.warning("server dropped a bye from worker %d (%s): step %d, its last contribution's %s", worker,
                    reason, step, self.core.clocks[worker])
        return False

    def _reply(self, workers: list[int], whole: bool = False) -> None:
        """Send the current weights to ``workers`` (compressed ps-avg: the change of our public weights to
        those that hold their previous version, unless ``whole``), and to those the run's end stops, with
        "end"."""
        self._log_applied()
        ending = self.core.take_ending()
        if not workers and not ending:
            return
        now = time.monotonic()
        if self.answers is not None:
            self.answers.advance(self.core.version)
        # one copy of the weights for those sent them as they are (compressed ps-avg: only "end")
        snapshot = self.flat.snapshot() if ending or self.answers is None else []
        for kind, whom in (("weights", workers), ("end", ending)):
            for worker in whom:  # each header names the step it answers
                sent, payload = (kind, snapshot) if kind == "end" or self.answers is None else \
                    self.answers.answer(worker, whole)
                clock = self.core.clocks[worker]
                header = params_header(sent, self.rank, self.flat.layout, self.flat.chunk_bytes,
                                       round=self.core.version, step=clock)
                self.last_heard[worker] = now  # its silence counts from when it has our answer
                self.events.write("reply" if kind == "weights" else "end-sent", worker=worker,
                                  version=self.core.version, clock=clock, lead=self.core.lead(worker))
                self.transport.post([worker], encode(header, payload), latest_only=False,
                                    timeout=self.config.send_timeout)

    def _wait_seconds(self) -> float:
        return self.config.startup_timeout if len(self.joined) < self.workers else self.config.round_timeout

    def _silence(self, silent: list[int]) -> str:
        missing = sorted(set(range(self.workers)) - self.joined)
        if missing:
            return (f"the parameter server heard nothing from worker(s) {', '.join(map(str, missing))} within "
                    f"{self.config.startup_timeout:g} s (--startup-timeout)")
        return (f"the parameter server heard nothing from worker(s) {', '.join(map(str, silent))} for "
                f"{self.config.round_timeout:g} s (--round-timeout) while waiting for them "
                f"(--missing-worker continue goes on without them)")

    def _waiting_on(self) -> list[int]:
        return sorted(self.core.active - {c.worker for c in self.core.pending} - self.core.held)

    def save_checkpoint(self) -> None:
        """The weights and the core's state, atomically, the previous checkpoint kept as ``.prev.pt``; a
        state with NaN or Inf or a bad counter is not written (one warning, a ``checkpoint-skipped`` event)."""
        state = {"model": cpu_state(self.task.model), "core": self.core.state_dict(), "joined": sorted(self.joined)}
        self.checkpoints.save(state, self.core.version)

    def validate_checkpoint(self, state: object, path: Path) -> None:
        """``CheckpointError`` (one line: the file and what is wrong) unless ``state``, read from ``path``,
        fits this server (checked before anything is loaded)."""
        problem = self._checkpoint_problem(state)
        if problem is not None:
            raise checkpoint.unusable(path, problem)

    def _checkpoint_problem(self, state: object) -> str | None:
        update = self.core.update
        optimizer = getattr(update, "optimizer", None)
        problem = checkpoint.fit_problem(
            state, keys=("model", "core", "joined"), counters=CHECKPOINT_COUNTERS,
            model=self.task.model.state_dict(), optimizers={"core.update.optimizer": optimizer} if optimizer else {})
        if problem is not None:
            return problem
        core, workers = state["core"], self.workers
        if len(core["clocks"]) != workers:
            return f"'core.clocks' has {len(core['clocks'])} entries for {workers} workers"
        if any(worker >= workers for worker in [*core["active"], *state["joined"]]):
            return f"it names workers beyond this run's {workers}"
        if not isinstance(core["update"], dict) or set(core["update"]) != set(update.state_dict()):
            return f"'core.update' does not fit --mode {self.config.mode}"
        compensation = getattr(update, "compensation", None)
        if compensation is not None:
            saved = core["update"]["compensation"]
            if not (isinstance(saved, dict) and isinstance(saved.get("backups"), dict)
                    and all(checkpoint.is_count(w) and w < workers for w in saved["backups"])):
                return "'core.update.compensation' holds no backups per worker"
            for worker, backup in saved["backups"].items():
                problem = checkpoint.tensors_fit_problem(backup, compensation.weights,
                                                         f"the DC-ASGD backup of worker {worker}")
                if problem is not None:
                    return problem
            return checkpoint.tensors_fit_problem(saved.get("mean_square"), compensation.mean_square,
                                                  "'core.update.compensation.mean_square'")
        return None

    def resume(self) -> None:
        """Continue from our newest usable checkpoint (that one, else the ``.prev.pt`` before it, each
        checked before anything is loaded), if there is one; workers re-join and get its weights. With
        checkpoints and none usable, fail in one line naming each file and what is wrong: a server has no
        neighbours to take a model from."""
        self.checkpoints.resume(self.validate_checkpoint, self._load_checkpoint)

    def _load_checkpoint(self, state: dict) -> dict:
        """Put a checked checkpoint's weights, core and workers in place; what the ``resume`` event says."""
        self.task.model.load_state_dict(state["model"])
        self.core.load_state_dict(state["core"])
        self.joined = set(state["joined"])
        return {"version": self.core.version}

    def close(self, finish: bool) -> None:
        self.transport.close(flush_timeout=self.config.shutdown_timeout if finish else 0.0)


def run_server(cfg: RunConfig, out: Path, resume: bool = False) -> None:
    events = EventLog(out / "server.jsonl")
    started = time.time()
    server = ParameterServer(cfg, out, events)
    try:
        if resume:
            server.resume()
        server.serve()
    except GossipError as exc:
        events.write("stopped" if isinstance(exc, Stopped) else "error", message=str(exc))
        server.close(finish=False)
        raise
    server.close(finish=True)
    torch.save(cpu_state(server.task.model), out / "model-final.pt")
    core = server.core
    events.write("end", wall_seconds=time.time() - started, versions=core.version, updates=core.updates,
                 contributed=core.contributed, staleness=dict(sorted(core.staleness.items())),
                 test=server.task.evaluate(),
                 implausible=dict(server.dropped), **server.norm_bound(), **server.transport.statistics())
    events.close()
