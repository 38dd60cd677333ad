"""A parameter-server worker: after each local step it sends its gradients (or, in ps-avg, its weights
every ``local_steps`` steps) to the server and continues from the weights the server answers with; in the
asynchronous modes until the server answers "end" (the swarm's budget of gradients is spent). A
``--byzantine`` worker sends seeded uniform garbage instead (fault injection), and trains on from the
server's answer like the others."""

from __future__ import annotations

import dataclasses
import logging

from gossip.averagers.base import Averager
from gossip.averagers.neighbours import byzantine_garbage
from gossip.config import CoordinatorConfig, GossipConfig
from gossip.coordinator.mailboxes import ReplyMailbox
from gossip.coordinator.modes import SENDS_WEIGHTS
from gossip.coordinator.pseudograd import ErrorFeedback
from gossip.errors import PeerTimeout
from gossip.flat import FlatParams
from gossip.link import Connect
from gossip.net.wire import CODEC_KINDS, Header, Message, encode, params_header

log = logging.getLogger("gossip.worker")


class PSWorker(Averager):
    """``step()`` replaces ``optimizer.step()`` in the gradient modes (``sends_gradients``): the server
    applies the update. In ps-avg the worker's own optimizer steps and ``step()`` averages every
    ``local_steps`` steps."""

    def __init__(self, flat: FlatParams, config: GossipConfig, coordinator: CoordinatorConfig,
                 connect: Connect | None = None) -> None:
        self.sends_gradients = config.mode not in SENDS_WEIGHTS
        # ps-avg with --compress: our change since the server's public weights goes out compressed, and its
        # answers come as the change of those (pseudograd.py)
        compress = config.compression.compress
        self.codec = compress if compress != "none" and not self.sends_gradients else None
        self.interval = 1 if self.sends_gradients else coordinator.local_steps
        self.retries = coordinator.server_retries
        self.rejoins = 0
        self.version = 0  # the server version of the weights we hold
        self.ended = False  # the server answered "end": the run's budget of gradients is spent
        super().__init__(flat, config, connect)
        self.feedback = ErrorFeedback(flat, self.codec) if self.codec is not None else None

    def _make_mailbox(self) -> ReplyMailbox:
        mailbox = ReplyMailbox(self.rank, self.config.world_size + 1, self.flat.layout, self.config.server_rank)
        if self.codec is not None:
            mailbox.layout = dataclasses.replace(mailbox.layout, codec=self.codec)
            mailbox.accepts = mailbox.accepts | {CODEC_KINDS[self.codec]}
        return mailbox

    def _due(self) -> bool:
        return self.local_step % self.interval == 0

    def _greet(self) -> None:
        """Say hello to the server, which answers with its weights: every worker starts from them."""
        self._hello()
        self._load(self.config.timeouts.startup_timeout)

    def _gossip(self) -> None:
        kind, chunks = ("grad", self.flat.gradient_snapshot()) if self.sends_gradients else \
            ("params", self.flat.snapshot())
        robust = self.config.robust
        if self.rank in robust.byzantine:  # fault injection: the server gets garbage; we go on from its answer
            seed = ((self.config.seed * 1_000_003 + self.rank) * 1_000_003 + self.local_step) % (1 << 63)
            chunks = byzantine_garbage(chunks, robust.byzantine_scale, seed)
            if self.feedback is not None:
                self.flat.copy_(chunks)  # (compressed: the garbage is what we encode the change of)
        if self.feedback is not None:
            kind, chunks = self.feedback.kind, self.feedback.encode()
            if self.flat.device.type != "cpu":
                chunks = [chunk.cpu() for chunk in chunks]
        header = params_header(kind, self.rank, self.flat.layout, self.flat.chunk_bytes, round=self.version,
                               step=self.local_step, samples=self.samples, speed=self.meter.samples_per_second)
        self.mailbox.expect(self.local_step)
        self.transport.post([self.config.server_rank], encode(header, chunks), latest_only=False,
                            timeout=self.config.timeouts.send_timeout)
        self._load(self.config.timeouts.round_timeout)
        self.rounds += 1

    def _load(self, timeout: float) -> None:
        with self._timed_wait():
            message = self._wait_for_server(timeout)
        if self.feedback is not None:
            self.feedback.take(message.header.kind, message.chunks)
        else:
            self.flat.copy_(message.chunks)
        self.version = message.header.version
        self.ended = self.ended or message.header.kind == "end"

    def done(self, steps: int) -> bool:
        """In the asynchronous modes once the server says the swarm's budget is spent (``core.py``); else
        after our own ``steps``."""
        if self.config.swarm_budget:
            return self.ended or self._past_horizon()
        return super().done(steps)

    def _wait_for_server(self, timeout: float) -> Message:
        """The server's answer. After ``timeout`` seconds of silence say hello: a live server that still
        holds our contribution acknowledges it (and we wait on), a restarted one answers with its weights
        (what we had sent is lost; training goes on). Unanswered hellos are retried with back-off (1, 2,
        4, ... s, at most ``timeout``), ``server_retries`` times in a row before we give up."""
        try:
            return self.mailbox.wait_weights(timeout)
        except PeerTimeout:
            if not self.retries:
                raise
        attempt = 0
        while attempt < self.retries:
            attempt += 1
            self.rejoins += 1
            self._hello()
            try:
                message = self.mailbox.wait_weights(min(timeout, float(2 ** (attempt - 1))), accept_ack=True)
            except PeerTimeout:
                log.warning("worker %d: the parameter server is silent; hello %d of %d unanswered", self.rank,
                            attempt, self.retries)
                continue
            if message is not None:
                return message
            attempt = 0  # acknowledged: the server is alive and still waiting for other workers
            try:
                return self.mailbox.wait_weights(timeout)
            except PeerTimeout:
                continue
        raise PeerTimeout(f"worker {self.rank}: the parameter server did not answer {self.retries} hellos "
                          f"(--server-retries) after {timeout:g} s of silence (--round-timeout); is it running?")

    def _hello(self) -> None:
        """Hello at our current step; the server answers it (and any re-join) with that step."""
        self.mailbox.expect(self.local_step)
        hello = encode(Header(kind="hello", sender=self.rank, step=self.local_step))
        self.transport.post([self.config.server_rank], hello, latest_only=False,
                            timeout=self.config.timeouts.send_timeout)

    def _finish(self) -> None:
        """Average the last local steps in (ps-avg), then tell the server we are done."""
        if not self.sends_gradients and self.local_step % self.interval:
            self._gossip()
        bye = encode(Header(kind="bye", sender=self.rank, step=self.local_step))
        self.transport.post([self.config.server_rank], bye, latest_only=False,
                            timeout=self.config.timeouts.send_timeout)

    def statistics(self) -> dict:
        return {**super().statistics(), "version": self.version, "rejoins": self.rejoins}
