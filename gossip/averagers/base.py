"""What every averager shares: counting steps, deciding when to mix, sockets, hellos and statistics.

*When* to mix (every ``gossip_every`` local steps) lives here; *how* to mix lives in each subclass's
``_gossip`` (the split of PyTorch's model-averaging package). ``step()`` is called by the training thread
after each optimizer step, so parameters only ever change between two steps, never inside a
forward/backward pass.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

import topologies
from gossip.config import GossipConfig
from gossip.flat import FlatParams
from gossip.mailbox import Mailbox
from gossip.metrics import SpeedMeter
from gossip.transport import Transport
from gossip.wire import Header, encode, params_header

log = logging.getLogger("gossip.averager")


class Averager(ABC):
    """Averages one model's flat parameters with neighbours; use as a context manager or ``close()``."""

    sends_gradients = False  # True for parameter-server workers that send gradients instead of stepping

    def __init__(self, flat: FlatParams, config: GossipConfig, topology: topologies.Topology | None) -> None:
        self.flat = flat
        self.config = config
        self.topology = topology
        self.rank = config.rank
        self.local_step = 0
        self.rounds = 0  # completed mixes
        self.samples = 0
        self.speed = SpeedMeter()
        self.wait_seconds = 0.0  # blocked on neighbours
        self.mix_seconds = 0.0
        self.lost: set[int] = set()  # neighbours given up as lost: never waited for nor sent to again
        self.mailbox = self._make_mailbox()
        ranks = config.world_size + (1 if config.parameter_server else 0)  # the server is the last rank
        endpoints = [config.endpoint(r) for r in range(ranks)]
        self.transport = Transport(self.rank, config.bind_endpoint(self.rank), endpoints, self.mailbox.deliver,
                                   queue_depth=config.queue_depth, shutdown_timeout=config.shutdown_timeout,
                                   recv_queue=max(64, 4 * ranks))
        self._closed = False

    @abstractmethod
    def _make_mailbox(self) -> Mailbox: ...

    @abstractmethod
    def _gossip(self) -> None:
        """One mixing point: exchange with the neighbours and mix."""

    def _finish(self) -> None:
        """Complete whatever is in flight before the sockets close (sync: the last round)."""

    def _hello_peers(self) -> tuple[int, ...]:
        return self.topology.neighbors(self.rank, 0) if self.config.world_size > 1 else ()

    def _due(self) -> bool:
        """Is this step a mixing point? (When to mix, kept apart from how.)"""
        return self.config.world_size > 1 and self.local_step % self.config.gossip_every == 0

    def _close_flush_seconds(self) -> float:
        """How long close() may spend delivering what is queued: the final sync round must arrive."""
        return self.config.shutdown_timeout

    # -- public ----------------------------------------------------------------------------------------
    def start(self) -> Averager:
        """Bind, then wait (``startup_timeout``) until the first peers to talk to have answered."""
        self.transport.start()
        self._greet()
        return self

    def _greet(self) -> None:
        """Say hello to every first-round neighbour and wait for theirs."""
        neighbours = self._hello_peers()
        self.transport.post(neighbours, encode(Header(kind="hello", sender=self.rank)), latest_only=False,
                            timeout=self.config.send_timeout)
        self.mailbox.wait_hellos(neighbours, self.config.startup_timeout)

    def step(self, samples: int = 0) -> bool:
        """Call after every optimizer step; mixes every ``gossip_every`` steps. True when it mixed."""
        self.local_step += 1
        self.samples += samples
        self.mailbox.local_step = self.local_step
        self.speed.tick(samples)
        if not self._due():
            return False
        self._gossip()
        return True

    def close(self, finish: bool = True) -> None:
        """Complete the round in flight and flush (``finish``), or drop everything and close at once."""
        if self._closed:
            return
        self._closed = True
        try:
            if finish:
                self._finish()
        finally:
            self.transport.close(flush_timeout=self._close_flush_seconds() if finish else 0.0)

    def __enter__(self) -> Averager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(finish=exc_type is None)

    def statistics(self) -> dict[str, Any]:
        return {"step": self.local_step, "rounds": self.rounds, "samples": self.samples,
                "speed": self.speed.samples_per_second, "step_seconds": self.speed.step_seconds,
                "wait_seconds": self.wait_seconds, "mix_seconds": self.mix_seconds, "lost": sorted(self.lost),
                **self.transport.statistics()}

    # -- shared helpers --------------------------------------------------------------------------------
    def _send_snapshot(self, round: int, *, latest_only: bool, snapshot: list | None = None) -> list:
        """Queue a copy of the weights (``snapshot``, or one taken now) for this round's out-neighbours;
        returns the copy."""
        snapshot = snapshot if snapshot is not None else self.flat.snapshot()
        header = params_header("params", self.rank, self.flat.layout, self.flat.chunk_bytes, round=round,
                               step=self.local_step, samples=self.samples, speed=self.speed.samples_per_second)
        frames = encode(header, snapshot)
        dests = [dest for dest in self.topology.out_neighbors(self.rank, round) if dest not in self.lost]
        self.transport.post(dests, frames, latest_only=latest_only, timeout=self.config.send_timeout)
        return snapshot

    def _timed_mix(self) -> _Timer:
        return _Timer(self, "mix_seconds")

    def _timed_wait(self) -> _Timer:
        return _Timer(self, "wait_seconds")


class _Timer:
    def __init__(self, owner: Averager, attr: str) -> None:
        self.owner, self.attr = owner, attr

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        setattr(self.owner, self.attr, getattr(self.owner, self.attr) + time.perf_counter() - self.start)
