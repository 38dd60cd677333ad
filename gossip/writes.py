"""Knowing, before it happens, that the weights are about to change in place.

Overlapping gossip sends round r's weights while the next local step computes. If those weights do not
change before the next mixing point (nothing trained in between: a benchmark, the consensus task, a loop
that only mixes), the round needs no copy of them: ZeroMQ can send the weights themselves, and the next
mix is the no-overlap one. Only a write in between needs the copy, and it needs it *before* the write:
ZeroMQ may still be reading the weights, and the mix needs the values that were sent.

What writes a model's weights in a PyTorch training loop:

- ``optimizer.step()`` of an optimizer holding any of the model's parameters. PyTorch calls global
  optimizer pre-hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``) before every step of
  every ``torch.optim.Optimizer``, whatever the subclass and however it writes (``foreach``, fused, or
  through ``.data``).
- the model's forward pass, when it holds floating-point buffers that are averaged (BatchNorm's running
  statistics, updated in place during a training forward without bumping any version counter): a forward
  pre-hook on the root module.

``WriteWatch`` calls ``before_write`` once before the first such event after ``arm()``, and remembers
whether any happened since ``take_written()`` was last called. Writes that bypass both (assigning to
``p.data`` by hand, in-place updates without an optimizer) are not seen: ``attach`` documents that such a
loop turns the lazy snapshot off (``lazy_snapshot=False``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gossip.flat import FlatParams


class WriteWatch:
    """Hooks on the optimizers of ``flat``'s parameters and, when it averages buffers, on its model's forward
    pass; ``close()`` removes them."""

    def __init__(self, flat: FlatParams) -> None:
        self._parameters = [place.tensor for place in flat.parameters]
        self._ids = {id(p) for p in self._parameters}
        self._owners: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]] = (
            weakref.WeakKeyDictionary())
        self._callback: Callable[[], None] | None = None
        self.written = False
        self._handles = [register_optimizer_step_pre_hook(self._optimizer_step)]
        if flat.buffers:
            self._handles.append(flat.model.register_forward_pre_hook(self._forward))

    def arm(self, before_write: Callable[[], None]) -> None:
        """Call ``before_write`` before the next write (once)."""
        self._callback = before_write

    @property
    def armed(self) -> bool:
        """``arm``ed, and no write has come since."""
        return self._callback is not None

    def versions(self) -> int:
        """The sum of the parameters' version counters, which every in-place operation on a parameter
        increments (not one through ``.data``): a change without a hook event is a write we did not see."""
        return sum(p._version for p in self._parameters)

    def take_written(self) -> bool:
        """Whether a write came since the last call."""
        written, self.written = self.written, False
        return written

    def close(self) -> None:
        self._callback = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _write(self) -> None:
        self.written = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self._holds_ours(optimizer):
            self._write()

    def _forward(self, module: nn.Module, args: object) -> None:
        self._write()

    def _holds_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        """Does ``optimizer`` step any of our parameters? Cached per optimizer until its groups change."""
        groups = len(optimizer.param_groups)
        known = self._owners.get(optimizer)
        if known is None or known[0] != groups:
            ours = any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"])
            known = self._owners[optimizer] = (groups, ours)
        return known[1]
