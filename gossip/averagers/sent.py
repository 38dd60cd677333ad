"""What a synchronous gossip peer has sent, and when it may change it: ``SentWeights``.

A round sends either the weights themselves, uncopied (``--no-overlap``; and with overlap when nothing
writes them between mixing points), or a snapshot copied from them (overlap while training). ZeroMQ reads
what was sent until it has gone to every destination (the transport's ``Delivery``); until then it must
not change:

- Weights sent uncopied change at the next mix (``release_live``): wait ``SEND_GRACE`` for ZeroMQ to let
  go of them, else move the weights to a copy (``FlatParams.relocate``), so what it sends later is still
  that round's weights.
- With overlap, a write before the next mix (an optimizer step, a forward pass that updates averaged
  buffers; ``gossip/writes.py``) first copies the weights sent uncopied: that copy is the snapshot the mix
  reads (``copy_before_write``). If ZeroMQ still reads them, the weights move to the copy instead.
- A copied snapshot is overwritten by the next one once ZeroMQ has let go of it (``snapshot_free``).

Whether the next snapshot is copied during the mix or the weights go uncopied (``copy_next``) follows the
last interval between mixing points: written (training) or not. The values mixed are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gossip.averagers.base import log
from gossip.config import GossipConfig
from gossip.flat import FlatParams
from gossip.net.transport import Delivery
from gossip.writes import WriteWatch

SEND_GRACE = 1.0  # seconds to wait for ZeroMQ to send weights we want to change, before moving to a copy


class SentWeights:
    """The deliveries of what one peer sent last, and the watch for writes to its weights."""

    def __init__(self, flat: FlatParams, config: GossipConfig, rank: int) -> None:
        self.flat, self.rank = flat, rank
        self.grace = min(SEND_GRACE, config.timeouts.round_timeout)
        self.copies = 0  # snapshots copied from the weights (overlap); the other rounds sent them uncopied
        self.relocated = 0  # times the weights moved to a copy because ZeroMQ still sent them
        self._live: Delivery | None = None  # the weights' own uncopied send
        self._snapshot: Delivery | None = None  # the last copied snapshot's send
        self._versions = 0  # the parameters' version counters when the weights went out uncopied
        sync, robust = config.sync, config.robust
        lazy = (config.overlaps and sync.lazy_snapshot and config.world_size > 1 and flat.device.type == "cpu"
                and robust.aggregate == "mean" and sync.deadline == "fixed" and rank not in robust.byzantine)
        self._watch = WriteWatch(flat) if lazy else None

    def copy_next(self) -> bool:
        """Overlap, at a mixing point: must the next snapshot be copied? Yes when the weights were written
        since the last mixing point (training), or without a watch (GPU, adaptive deadlines, robust
        aggregates, ``lazy_snapshot`` off). If the last round's weights went uncopied and no write was seen
        since (the watch still armed) but they changed, the mix cannot know what was sent: say so and
        copy every round from now on."""
        if self._watch is None or self._watch.take_written():
            return True
        if self._watch.armed and self._watch.versions() != self._versions:
            log.warning("peer %d: the weights changed in place outside an optimizer step while being sent; "
                        "each round copies them from now on (set lazy_snapshot=False for such a loop)", self.rank)
            self.close()
            return True
        return False

    def sent_live(self, delivery: Delivery | None, before_write: Callable[[], None] | None = None) -> None:
        """The weights went out uncopied; ``before_write`` (overlap) is called before the first write."""
        self._live = delivery
        if before_write is not None:
            self._versions = self._watch.versions()
            self._watch.arm(before_write)

    def release_live(self) -> None:
        """Before the weights change in place: wait until ZeroMQ has let go of what it sends uncopied; if it
        still holds it (a neighbour not reading, or dead and not yet pruned), move the weights to a copy."""
        delivery, self._live = self._live, None
        if delivery is not None and not delivery.wait(self.grace):
            self.flat.relocate()
            self.relocated += 1

    def copy_before_write(self) -> list[torch.Tensor]:
        """The weights sent uncopied are about to be written: the snapshot of them, taken now. If ZeroMQ
        still reads them, the weights move to the copy and the sent memory is the snapshot."""
        delivery, self._live = self._live, None
        self.copies += 1
        if delivery is None or delivery.wait(0.0):
            self._snapshot = Delivery(0)  # held by nobody: the next snapshot may overwrite it
            return self.flat.snapshot()
        self._snapshot = delivery
        self.relocated += 1
        return self.flat.relocate()

    def sent_snapshot(self, delivery: Delivery | None) -> None:
        self._snapshot = delivery
        self.copies += 1

    def snapshot_free(self, wait: bool) -> bool:
        """Has ZeroMQ let go of the last snapshot (to every destination), so the next may overwrite it?
        ``wait``: up to ``SEND_GRACE`` (fixed deadlines: we have every neighbour's message of that round,
        so each is reading ours now; adaptive deadlines wait for no neighbour, nor for its reading)."""
        delivery, self._snapshot = self._snapshot, None
        return delivery is not None and delivery.wait(self.grace if wait else 0.0)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
