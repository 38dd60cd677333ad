"""``SwarmAdamW``: AdamW for one of N peers whose steps are averaged, normalised as one AdamW on the mean of
their N gradients would be.

Why. In ps-sync (and DDP) one AdamW steps with the mean gradient of N batches, g = (1/N) sum_i g_i, and
divides by the root of v, an average of g^2. Per coordinate, with mu the expected gradient and sigma^2 the
variance of one peer's batch gradient, E[g^2] = mu^2 + sigma^2 / N. A gossip or ps-avg peer steps its own AdamW
on its own g_i, whose second moment is E[g_i^2] = mu^2 + sigma^2: N times the noise. Where noise dominates, its
steps are up to sqrt(N) times shorter, and the mean of the peers' steps is not the step of one AdamW on
the mean gradient: on the language model that alone costs 2.3% of validation loss with 4 peers and 4.3%
with 8, with the copies averaged exactly after every step (``bench/local_adamw.py``).

What. Two gradients of the same peer at consecutive steps are drawn from different batches, so their
noise is independent, while mu barely moves in one step: E[g_t * g_{t-1}] = mu^2 (elementwise). With
that, each peer estimates the mean gradient's second moment from its own gradients, without sending
anything:

    m  <- beta1 m + (1 - beta1) g_t                   (AdamW's first moment)
    s  <- beta2 s + (1 - beta2) g_t^2                 (AdamW's second moment: mu^2 + sigma^2)
    c  <- beta2 c + (1 - beta2) g_t * g_{t-1}         (from the second step on: mu^2)
    r  = min(1, max(c', 0) / s' + z / sqrt(k))        (the signal fraction mu^2 / (mu^2 + sigma^2), at most
                                                        z standard errors below its estimate)
    v  = s' (r + (1 - r) / N)                          (mu^2 + sigma^2 / N)
    x  <- x - lr wd x - lr (m / (1 - beta1^t)) / (sqrt(v) + eps)

with s' = s / (1 - beta2^t) and c' = c / (1 - beta2^j) bias-corrected (j products of gradients so far: t -
1, or those since a state of PyTorch's AdamW was loaded), k = (1 - beta2^j)(1 + beta2) / ((1 - beta2)(1 +
beta2^j)) the number of independent products c' is worth (j at first, (1 + beta2) / (1 - beta2) in the
long run), and z = 2.

The bound. c' is an average of products of two noisy numbers: each has variance mu^4 + 2 mu^2 sigma^2 +
sigma^4 - mu^4 <= s^2, so c' / s' has a standard error of at most 1 / sqrt(k). Taken as it comes (z = 0),
a coordinate whose few products happen to come out low gets a step up to sqrt(N) times longer than the
evidence supports, and those errors land early, while the trajectory is set: on the language model, z = 0
matched z = 2 at one seed and fell 3.8% (4 peers) and 6.6% (8) behind ps-sync at others. With z = 2 the
step lengthens only as the products accumulate: AdamW's own for the first few steps (r = 1 while z /
sqrt(k) >= 1, k <= 4), then toward the mean gradient's, the bound adding 0.07 to r after 1,000 steps with
beta2 = 0.999.

So s / N <= v <= s: the step is AdamW's own times a factor between 1 (signal) and sqrt(N) (noise). With N =
1, or a constant gradient (c' = s'), it is AdamW's update. On data that differs from peer to peer c
estimates each peer's own mu_i^2, whose mean is at least the mean gradient's squared: the normaliser errs
toward the cautious side, as AdamW's does.

The idea of telling mu^2 from the noise with two independent gradients is that of the gradient noise scale
(McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training", 2018, which uses two batch
sizes); the square-root rule it restores is Malladi, Lyu, Panigrahi & Arora, "On the SDEs and Scaling
Rules for Adaptive Gradient Algorithms", NeurIPS 2022: AdamW's step at batch b matches batch Nb's with
sqrt(N) times the lr where noise dominates, and not where the signal does. This estimator is this project's
own; what it measured is in docs/architecture.md (3.11) and BENCHMARKS.md. It keeps two more buffers per
parameter than AdamW (c and the previous gradient).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class SwarmAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose second moment is estimated for the mean of ``peers`` peers'
    gradients from this peer's own consecutive gradients (module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, peers: int = 1) -> None:
        if not (isinstance(peers, int) and not isinstance(peers, bool) and peers >= 1):
            raise ValueError(f"peers must be an integer >= 1 (how many peers' steps are averaged), got {peers!r}")
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"SwarmAdamW needs lr, eps, weight_decay >= 0 and betas in [0, 1); got lr={lr}, "
                             f"eps={eps}, weight_decay={weight_decay}, betas={betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "peers": peers})

    def __setstate__(self, state: dict[str, Any]) -> None:
        """(``load_state_dict`` ends here: a state saved by PyTorch's AdamW has no ``peers``; keep ours.)"""
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("peers", self.defaults["peers"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        grad = param.grad
        if grad.is_sparse:
            raise RuntimeError("SwarmAdamW does not take sparse gradients")
        beta1, beta2 = group["betas"]
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] = t = int(state["step"]) + 1  # (an int, also where PyTorch's AdamW left a tensor)
        param.mul_(1.0 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if group["peers"] > 1:
            if "previous_grad" in state:  # c's products so far: cross_steps of them
                state["exp_avg_cross"].mul_(beta2).addcmul_(grad, state["previous_grad"], value=1.0 - beta2)
                state["previous_grad"].copy_(grad)
                state["cross_steps"] += 1
            else:  # the first step, or the first since a state of PyTorch's AdamW was loaded: no product yet
                state["exp_avg_cross"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["previous_grad"] = grad.clone(memory_format=torch.preserve_format)
                state["cross_steps"] = 0
        denom = _moment(state, group).sqrt_().add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - beta1 ** t))

    def second_moment(self, param: torch.Tensor) -> torch.Tensor:
        """v of ``param`` after its latest step, the square of what its step was divided by (less eps)."""
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        return _moment(self.state[param], group)


Z = 2.0  # how many standard errors the signal fraction is taken below its estimate (module docstring)


def _moment(state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """v, a new tensor: s' (r + (1 - r) / N), r = min(1, max(c', 0) / s' + Z / sqrt(k)) (module docstring);
    AdamW's s' = s / (1 - beta2^t) with one peer or before the first product."""
    beta2, peers, t = group["betas"][1], group["peers"], state["step"]
    own = state["exp_avg_sq"].mul(1.0 / (1.0 - beta2 ** t))
    products = state.get("cross_steps", 0)
    if peers == 1 or not products:
        return own
    decayed = beta2 ** products
    worth = (1.0 - decayed) * (1.0 + beta2) / ((1.0 - beta2) * (1.0 + decayed))
    signal = state["exp_avg_cross"].mul(1.0 / (1.0 - decayed)).clamp_(min=0.0)
    signal.div_(own.clamp(min=torch.finfo(own.dtype).tiny)).add_(Z / math.sqrt(worth)).clamp_(max=1.0)
    return own.mul_(signal.mul_(1.0 - 1.0 / peers).add_(1.0 / peers))
