"""Which barrier, bound and update each parameter-server mode uses (the modes of DESIGN section 4)."""

from __future__ import annotations

import torch

from gossip.config import CoordinatorConfig
from gossip.coordinator.averaging import ParameterAverage
from gossip.coordinator.core import ServerCore
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.sgd import GradientStep
from gossip.errors import ConfigError
from gossip.flat import FlatParams

SENDS_WEIGHTS = {"ps-avg"}  # every other mode sends gradients


def build_core(mode: str, settings: CoordinatorConfig, flat: FlatParams, optimizer: torch.optim.Optimizer,
               workers: int) -> ServerCore:
    """The server state machine for ``mode``; the optimizer steps the model that ``flat`` flattened."""
    if mode == "ps-sync":
        return ServerCore(workers, GradientStep(flat, optimizer), batch_size=workers)
    if mode == "ps-avg":
        return ServerCore(workers, ParameterAverage(flat), batch_size=workers)
    compensation = None
    if mode == "ps-dcasgd":
        compensation = DelayCompensation(list(flat.views()), settings.dc_lambda, settings.dc_adaptive,
                                         settings.dc_momentum, settings.dc_epsilon)
    elif mode not in ("ps-async", "ps-ssp"):
        raise ConfigError(f"{mode!r} is not a parameter-server mode")
    update = GradientStep(flat, optimizer, settings.staleness_lr, compensation)
    bound = settings.staleness_bound if mode == "ps-ssp" else None
    return ServerCore(workers, update, batch_size=settings.soft_sync, staleness_bound=bound)
