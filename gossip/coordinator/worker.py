"""A parameter-server worker: after each local step it sends its gradients (or, in ps-avg, its weights
every ``local_steps`` steps) to the server and continues from the weights the server answers with."""

from __future__ import annotations

from gossip.averagers.base import Averager
from gossip.config import CoordinatorConfig, GossipConfig
from gossip.coordinator.modes import SENDS_WEIGHTS
from gossip.flat import FlatParams
from gossip.mailbox import ReplyMailbox
from gossip.wire import Header, encode, params_header


class PSWorker(Averager):
    """``step()`` replaces ``optimizer.step()`` in the gradient modes (``sends_gradients``): the server
    applies the update. In ps-avg the worker's own optimizer steps and ``step()`` averages every
    ``local_steps`` steps."""

    def __init__(self, flat: FlatParams, config: GossipConfig, coordinator: CoordinatorConfig) -> None:
        self.sends_gradients = config.mode not in SENDS_WEIGHTS
        self.interval = 1 if self.sends_gradients else coordinator.local_steps
        self.version = 0  # the server version of the weights we hold
        super().__init__(flat, config, topology=None)

    def _make_mailbox(self) -> ReplyMailbox:
        return ReplyMailbox(self.rank, self.config.world_size + 1, self.flat.layout, self.config.server_rank)

    def _due(self) -> bool:
        return self.local_step % self.interval == 0

    def _greet(self) -> None:
        """Say hello to the server, which answers with its weights: every worker starts from them."""
        hello = encode(Header(kind="hello", sender=self.rank))
        self.transport.post([self.config.server_rank], hello, latest_only=False, timeout=self.config.send_timeout)
        self._load(self.config.startup_timeout)

    def _gossip(self) -> None:
        kind, chunks = ("grad", self.flat.gradient_snapshot()) if self.sends_gradients else \
            ("params", self.flat.snapshot())
        header = params_header(kind, self.rank, self.flat.layout, self.flat.chunk_bytes, round=self.version,
                               step=self.local_step, samples=self.samples, speed=self.speed.samples_per_second)
        self.transport.post([self.config.server_rank], encode(header, chunks), latest_only=False,
                            timeout=self.config.send_timeout)
        self._load(self.config.round_timeout)
        self.rounds += 1

    def _load(self, timeout: float) -> None:
        with self._timed_wait():
            message = self.mailbox.wait_weights(timeout)
        self.flat.copy_(message.chunks)
        self.version = message.header.round

    def _finish(self) -> None:
        """Average the last local steps in (ps-avg), then tell the server we are done."""
        if not self.sends_gradients and self.local_step % self.interval:
            self._gossip()
        bye = encode(Header(kind="bye", sender=self.rank, step=self.local_step))
        self.transport.post([self.config.server_rank], bye, latest_only=False, timeout=self.config.send_timeout)

    def statistics(self) -> dict:
        return {**super().statistics(), "version": self.version}
