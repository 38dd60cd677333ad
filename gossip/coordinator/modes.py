"""Which barrier, bound and update each parameter-server mode uses (README, "Parameter-server modes"), and
the learning rate and momentum of the server's optimizer.

The server's optimizer (``server_optimizer``). ``--lr`` and ``--momentum`` describe synchronous SGD: ps-sync
applies the mean of the N workers' gradients with them (one machine at batch N*b). The asynchronous modes
(ps-async, ps-ssp, ps-dcasgd) apply the mean of ``soft_sync`` = S gradients on arrival, so k = N / S
updates are in flight at once, and by default ("auto") the server steps with

    momentum  mu_s = max(0, mu - (1 - 1/k))
    lr        lr_s = lr * (1 - mu_s) / ((1 - mu) * k)

- Asynchrony begets momentum (Mitliagkas et al., 2016): with k updates in flight, applying each on arrival
  acts like momentum 1 - 1/k already, so the explicit momentum is reduced by that much; at the default
  mu = 0.9 that leaves 0.15 for 4 workers and 0.025 for 8, i.e. nearly the momentum-free server update of
  DC-ASGD (Zheng et al., ICML 2017). Stepping mu = 0.9 on top of the implicit momentum diverged.
- The learning rate keeps the long-run step per gradient, lr_s / (1 - mu_s), equal to synchronous SGD's,
  lr / ((1 - mu) * k): k gradients move the weights as far as one ps-sync update does. This also makes the
  lock-step rounds of ps-ssp right (when the staleness bound binds, all N workers compute on the same
  weights and the server applies their N gradients one after the other: at ps-sync's learning rate that is
  N times ps-sync's step).
- With k = 1 (one worker, or --soft-sync N) it is exactly ps-sync's optimizer.

``--server-momentum`` and ``--server-lr`` set either explicitly (an explicit momentum still gets the matched
learning rate unless ``--server-lr`` is given too). ps-sync uses ``--lr`` and ``--momentum`` unless they
are given; ps-avg has no server optimizer (its workers step their own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossip.config import CoordinatorConfig
from gossip.coordinator.averaging import ParameterAverage
from gossip.coordinator.core import ServerCore
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.sgd import GradientStep
from gossip.errors import ConfigError
from gossip.flat import FlatParams

SENDS_WEIGHTS = {"ps-avg"}  # every other mode sends gradients
ASYNCHRONOUS = ("ps-async", "ps-ssp", "ps-dcasgd")  # apply gradients on arrival: the "auto" rule adapts them


@dataclass(frozen=True)
class ServerOptimizer:
    lr: float
    momentum: float
    rule: str  # how lr and momentum were chosen, in words (logged and shown in the summary)

    def build(self, parameters) -> torch.optim.SGD:
        return torch.optim.SGD(parameters, lr=self.lr, momentum=self.momentum)


def server_optimizer(mode: str, lr: float, momentum: float, workers: int,
                     settings: CoordinatorConfig) -> ServerOptimizer:
    """The server's SGD for ``mode`` with ``workers`` workers, from the run's ``--lr`` and ``--momentum``
    and ``settings.server_lr`` / ``settings.server_momentum`` ("auto" or a number; module docstring)."""
    explicit_mu, explicit_lr = settings.server_momentum != "auto", settings.server_lr != "auto"
    if mode in ASYNCHRONOUS:
        k = workers / min(settings.soft_sync, workers)  # updates in flight at once
        mu = settings.server_momentum if explicit_mu else max(0.0, momentum - (1.0 - 1.0 / k))
        step = settings.server_lr if explicit_lr else lr * (1.0 - mu) / ((1.0 - momentum) * k)
        how_mu = "--server-momentum" if explicit_mu else f"max(0, {momentum:g} - (1 - 1/{k:g}))"
        how_lr = "--server-lr" if explicit_lr else f"{lr:g} * (1 - {mu:g}) / ((1 - {momentum:g}) * {k:g})"
        return ServerOptimizer(step, mu, f"{k:g} updates in flight: momentum = {how_mu}, lr = {how_lr}")
    mu = settings.server_momentum if explicit_mu else momentum
    step = settings.server_lr if explicit_lr else lr
    how_mu, how_lr = ("--server-momentum" if explicit_mu else "--momentum"), ("--server-lr" if explicit_lr else "--lr")
    return ServerOptimizer(step, mu, f"synchronous: momentum = {how_mu}, lr = {how_lr}")


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
