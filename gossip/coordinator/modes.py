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
are given. ps-avg's workers step their own optimizers; its server's is the outer optimizer of DiLoCo
(``outer_optimizer``; plain averaging by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gossip.config import CoordinatorConfig
from gossip.coordinator.averaging import OuterStep, ParameterAverage
from gossip.coordinator.core import ServerCore
from gossip.coordinator.dcasgd import DelayCompensation
from gossip.coordinator.sgd import GradientStep
from gossip.errors import ConfigError
from gossip.flat import FlatParams
from gossip.optim import OptimizerSpec, Schedule

SENDS_WEIGHTS = {"ps-avg"}  # every other mode sends gradients
ASYNCHRONOUS = ("ps-async", "ps-ssp", "ps-dcasgd")  # apply gradients on arrival: the "auto" rule adapts them


@dataclass(frozen=True)
class ServerOptimizer:
    name: str  # sgd or adamw
    lr: float  # the peak; ``schedule`` scales it by version
    momentum: float  # SGD's momentum, or AdamW's beta1
    rule: str  # how lr and momentum were chosen, in words (logged and shown in the summary)
    schedule: Schedule = Schedule()
    beta2: float = 0.999
    weight_decay: float = 0.0

    def build(self, parameters) -> torch.optim.Optimizer:
        return OptimizerSpec(self.name, self.lr, self.momentum, (self.momentum, self.beta2),
                             self.weight_decay).build(parameters)

    def describe(self) -> dict:
        """What the server's ``ready`` event and the summary show."""
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum, "rule": self.rule,
                "schedule": self.schedule.kind, "total_versions": self.schedule.total,
                "warmup_versions": self.schedule.warmup, "min_lr": self.lr * self.schedule.min_ratio}


def server_optimizer(mode: str, spec: OptimizerSpec, workers: int, settings: CoordinatorConfig,
                     schedule: Schedule = Schedule()) -> ServerOptimizer:
    """The server's optimizer for ``mode`` with ``workers`` workers, from the run's optimizer ``spec`` and
    ``settings.server_lr`` / ``settings.server_momentum`` ("auto" or a number; module docstring), with the
    run's lr ``schedule`` (over steps) carried over to versions."""
    explicit_mu, explicit_lr = settings.server_momentum != "auto", settings.server_lr != "auto"
    adamw = spec.name == "adamw"
    given_mu = spec.betas[0] if adamw else spec.momentum
    mu_name = "beta1" if adamw else "momentum"
    k = workers / min(settings.soft_sync, workers) if mode in ASYNCHRONOUS else 1.0  # updates in flight
    if mode in ASYNCHRONOUS:
        mu = settings.server_momentum if explicit_mu else max(0.0, given_mu - (1.0 - 1.0 / k))
        # AdamW's average of gradients has unit gain whatever beta1 is: only the count of updates matters
        matched = spec.lr / k if adamw else spec.lr * (1.0 - mu) / ((1.0 - given_mu) * k)
        step = settings.server_lr if explicit_lr else matched
        how_mu = "--server-momentum" if explicit_mu else f"max(0, {given_mu:g} - (1 - 1/{k:g}))"
        how_lr = "--server-lr" if explicit_lr else (f"{spec.lr:g} / {k:g}" if adamw else
                                                    f"{spec.lr:g} * (1 - {mu:g}) / ((1 - {given_mu:g}) * {k:g})")
        rule = f"{k:g} updates in flight: {mu_name} = {how_mu}, lr = {how_lr}"
    else:
        mu = settings.server_momentum if explicit_mu else given_mu
        step = settings.server_lr if explicit_lr else spec.lr
        how_mu = "--server-momentum" if explicit_mu else ("--betas" if adamw else "--momentum")
        rule = f"synchronous: {mu_name} = {how_mu}, lr = {'--server-lr' if explicit_lr else '--lr'}"
    by_version = Schedule(schedule.kind, round(schedule.total * k), round(schedule.warmup * k), schedule.min_ratio)
    return ServerOptimizer(spec.name, step, mu, rule, by_version, spec.betas[1], spec.weight_decay)


def outer_optimizer(settings: CoordinatorConfig) -> ServerOptimizer:
    """ps-avg's outer optimizer (``averaging.py``) from ``--outer-optimizer``, ``--outer-lr`` and
    ``--outer-momentum`` (``CoordinatorConfig.outer``: "auto" is ``OUTER_DEFAULTS``); constant lr, no weight
    decay. Outer SGD at lr 1 without momentum (no ``outer_step``) sets the weights to the workers' mean."""
    rule = "an outer step on the workers' mean change (DiLoCo)" if settings.outer_step else \
        "plain average of the workers' weights"
    return ServerOptimizer(*settings.outer, rule)


def build_core(mode: str, settings: CoordinatorConfig, flat: FlatParams, optimizer: torch.optim.Optimizer,
               workers: int, schedule: Schedule = Schedule(), budget: int = 0, memory: bool = False,
               aggregate: str = "mean", trim_fraction: float = 0.2) -> ServerCore:
    """The server state machine for ``mode``; the optimizer steps the model that ``flat`` flattened, its lr
    set by ``schedule`` for each version; an asynchronous mode's run ends after ``budget`` gradients (0:
    when every worker has said bye) and, with ``memory`` (rate compensation), steps with the mean of every
    worker's latest gradient (``memory.py``). ``aggregate`` and ``trim_fraction`` are ``--aggregate`` and
    ``--trim-fraction`` (the config has checked that the rule applies to ``mode``)."""
    robust = {"aggregate": aggregate, "trim_fraction": trim_fraction}
    if mode == "ps-sync":
        return ServerCore(workers, GradientStep(flat, optimizer, schedule=schedule, **robust), batch_size=workers)
    if mode == "ps-avg":
        update = OuterStep(flat, optimizer, **robust) if settings.outer_step else ParameterAverage(flat, **robust)
        return ServerCore(workers, update, batch_size=workers)
    compensation = None
    if mode == "ps-dcasgd":
        compensation = DelayCompensation(list(flat.views()), settings.dc_lambda, settings.dc_adaptive,
                                         settings.dc_momentum, settings.dc_epsilon)
    elif mode not in ("ps-async", "ps-ssp"):
        raise ConfigError(f"{mode!r} is not a parameter-server mode")
    update = GradientStep(flat, optimizer, settings.staleness_lr, compensation, schedule, memory, **robust)
    bound = settings.staleness_bound if mode == "ps-ssp" else None
    return ServerCore(workers, update, batch_size=settings.soft_sync, staleness_bound=bound, budget=budget)
