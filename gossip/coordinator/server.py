"""The parameter-server process: one loop that receives workers' contributions in arrival order, feeds
them to the mode's ``ServerCore`` and answers with its weights.

Logs ``server.jsonl`` (``ready`` with the optimizer's learning rate, momentum and the rule that chose
them; ``update`` per applied batch with its version, workers and their staleness; ``reply`` per answer with
the worker's clock and its lead over the slowest worker; ``end`` with the staleness histogram) and leaves the
final model as ``model-final.pt``. After every update the server checks its weights (``gossip/health.py``)
and stops with ``Diverged`` once they hold NaN or Inf or have blown up, instead of serving them.
The update rules themselves are in ``modes.py`` and ``core.py``; this loop is what they
share: barriers, versions, replies, checkpoints and the plausibility checks on workers. Its parts are
modules of their own: ``roster.py`` (the workers, the checks on what they send, their silence),
``replies.py`` (what is sent back), ``applied.py`` (what follows each update) and ``server_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from gossip.config import RunConfig
from gossip.connect import connector
from gossip.coordinator.applied import AppliedUpdates, steps_an_optimizer
from gossip.coordinator.core import Contribution, ServerCore
from gossip.coordinator.mailboxes import QueueMailbox
from gossip.coordinator.modes import ASYNCHRONOUS, SENDS_WEIGHTS, build_core, outer_optimizer, server_optimizer
from gossip.coordinator.rates import ArrivalRates
from gossip.coordinator.replies import Replies
from gossip.coordinator.roster import Roster
from gossip.coordinator.server_checkpoint import ServerCheckpoint
from gossip.device import cpu_state
from gossip.errors import GossipError, Stopped, TransportError
from gossip.flat import FlatParams
from gossip.link import Connect
from gossip.metrics import EventLog
from gossip.net.wire import CODEC_KINDS, Message
from gossip.optim import run_schedule
from gossip.signals import raise_if_signalled
from gossip.tasks import build_task, context_for

log = logging.getLogger("gossip.server")


class ParameterServer:
    """The loop: it takes each message, has ``Roster`` check it, feeds ``ServerCore`` and sends what the core
    says through ``Replies``, once ``AppliedUpdates`` has logged and checked the weights."""

    def __init__(self, cfg: RunConfig, out: Path, events: EventLog, connect: Connect | None = None) -> None:
        """``connect(mailbox)``: the link to the workers (``gossip/link.py``; default: ZeroMQ's)."""
        self.cfg = cfg
        self.config = cfg.gossip
        self.events = events
        self.workers = cfg.nodes
        self.rank = self.config.server_rank
        # on the CPU whatever --device says: its update rules take the workers' host buffers as they come
        context = context_for(cfg, 0)
        self.task = build_task(cfg.task, context)
        self.flat = FlatParams(self.task.model, self.config.network.chunk_bytes)
        self.optimizer = outer_optimizer(cfg.coordinator) if self.config.mode == "ps-avg" else \
            server_optimizer(self.config.mode, context.optimizer, self.workers, cfg.coordinator, run_schedule(cfg))
        self.core: ServerCore = build_core(self.config.mode, cfg.coordinator, self.flat,
                                           self.optimizer.build(self.task.model.parameters()), self.workers,
                                           self.optimizer.schedule, cfg.nodes * cfg.steps if self.config.swarm_budget else 0,
                                           memory=self._compensates("sgd"), aggregate=self.config.robust.aggregate,
                                           trim_fraction=self.config.robust.trim_fraction)
        # an AdamW server's rate compensation: each gradient weighted rbar / r_i (rates.py, memory.py say why)
        self.rates = ArrivalRates(self.workers) if self._compensates("adamw") else None
        contribution = "params" if self.config.mode in SENDS_WEIGHTS else "grad"
        layout = self.flat.layout
        if self.config.compression.compress != "none":  # ps-avg: changes both ways, compressed (pseudograd.py)
            contribution = CODEC_KINDS[self.config.compression.compress]
            layout = dataclasses.replace(layout, codec=self.config.compression.compress)
        self.mailbox = QueueMailbox(self.rank, self.workers + 1, layout,
                                    expects=lambda sender, round: sender < self.workers, capacity=4 * self.workers,
                                    contribution=contribution)
        self.mailbox.max_steps, self.mailbox.max_weight = self.config.bounds.max_steps, 1.0  # workers send weight 1
        self.transport = (connect or connector(self.config, self.rank, self.flat.layout, server=True))(self.mailbox)
        self.roster = Roster(self.config, self.workers, self.core, cfg.coordinator.missing_worker)
        self.replies = Replies(self.config, self.rank, self.flat, self.core, self.transport, events,
                               answered=self.roster.heard)
        # a server has no neighbours to take a model from: without a usable checkpoint it cannot resume
        self.checkpoints = ServerCheckpoint(out, cfg.checkpoint_every, events, self.task, self.core, self.roster,
                                            self.config.mode)
        self.updates = AppliedUpdates(cfg, self.core, self.flat, self.task, self.optimizer, events, self.checkpoints)

    def _compensates(self, optimizer: str) -> bool:
        """Rate compensation applies, and the server steps ``optimizer``: an asynchronous gradient mode."""
        return (self.config.mode in ASYNCHRONOUS and self.config.asynchronous.rate_compensation == "on"
                and self.optimizer.name == optimizer)

    def serve(self) -> None:
        """Answer workers until every one has said bye."""
        self.transport.start()
        self.replies.start()  # (after a resume: compressed ps-avg's public copy starts as the loaded weights)
        optimizer = self.optimizer.describe() if steps_an_optimizer(self.core) else None
        if optimizer:
            log.info("server: %s with lr %.4g, %s %.4g (%s)", optimizer["name"], optimizer["lr"],
                     "beta1" if optimizer["name"] == "adamw" else "momentum", optimizer["momentum"], optimizer["rule"])
        self.events.write("ready", endpoint=self.config.endpoint(self.rank), mode=self.config.mode,
                          version=self.core.version, optimizer=optimizer)
        while self.core.active:
            raise_if_signalled()
            message = self.mailbox.get(min(1.0, self.roster.wait_seconds()))
            if message is not None:
                self.roster.heard(message.header.sender)
                self._handle(message)
            self._check_silent()

    def _handle(self, message: Message) -> None:
        header = message.header
        worker = header.sender
        if worker in self.roster.finished:  # a worker says nothing after its bye
            raise TransportError(f"worker {worker} sent a {header.kind} after its bye: someone forged that bye "
                                 "in its name (run with --secure on an untrusted network)")
        if header.kind == "hello" and self.roster.holds_contribution_of(worker):
            self.replies.acknowledge(worker)  # it only asks whether we are alive
        elif header.kind == "hello":
            self.roster.joined.add(worker)
            if self.rates is not None:
                self.rates.joined(worker, time.monotonic())
            self._reply(self.core.join(worker, header.step), whole=True)
        elif header.kind == "bye":
            if self.roster.plausible_bye(message):
                self.roster.finished.add(worker)
                self._reply(self.core.leave(worker))
        elif self.roster.plausible(message):
            weight = 1.0 if self.rates is None else self.rates.arrived(worker, time.monotonic(),
                                                                       len(self.core.active))
            self._reply(self.core.submit(Contribution(worker, header.version, header.step,
                                                      self.replies.contribution(message.chunks),
                                                      header.samples, weight)))

    def _check_silent(self) -> None:
        """Workers we wait for that sent nothing for a whole timeout: fail naming them, or (``--missing-worker
        continue``) give up on them and go on with the others, as soft synchronisation does."""
        for worker in self.roster.gone():
            log.warning("server: worker %d sent nothing for %.0f s; going on without it", worker,
                        self.config.timeouts.round_timeout)
            self.events.write("gone", worker=worker, version=self.core.version)
            self._reply(self.core.leave(worker))

    def _reply(self, workers: list[int], whole: bool = False) -> None:
        """Record the updates the core applied (``AppliedUpdates``: stops on diverged weights), then send the
        current weights to ``workers`` and "end" to those the run's end stops (``Replies.send``)."""
        self.updates.record()
        self.replies.send(workers, self.core.take_ending(), whole)

    def norm_bound(self) -> dict:
        """``--aggregate norm-clip``: the gradients it clipped, dropped and left unjudged, and its last
        reference norm (``normbound.py``), for the end event; nothing under the other rules."""
        bound = getattr(self.core.update, "bound", None)
        return {"norm_bound": bound.statistics()} if bound is not None else {}

    def save_checkpoint(self) -> None:
        """``ServerCheckpoint.save``: the weights, the core's state and the workers that joined."""
        self.checkpoints.save()

    def resume(self) -> None:
        """Continue from our newest usable checkpoint, if there is one (``ServerCheckpoint.resume``); workers
        re-join and get its weights. With checkpoints and none usable, fail in one line naming each file and
        what is wrong: a server has no neighbours to take a model from."""
        self.checkpoints.resume()

    def close(self, finish: bool) -> None:
        self.transport.close(flush_timeout=self.config.timeouts.shutdown_timeout if finish else 0.0)


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
                 implausible=dict(server.roster.dropped), **server.norm_bound(), **server.transport.statistics())
    events.close()
