"""Delay compensation for asynchronous SGD: DC-ASGD (Zheng et al., "Asynchronous Stochastic Gradient
Descent with Delay Compensation", ICML 2017).

A gradient g that worker m computed at the weights it last pulled, W_bak(m), arrives when the server holds
W. The first-order Taylor term of g(W) around W_bak(m) needs the Hessian, which the paper approximates by
lambda * g * g (element-wise outer-product diagonal), so the server applies

    g~ = g + lambda * g * g * (W - W_bak(m))                (element-wise; DC-ASGD-c)

and then backs up W_bak(m) <- W when it sends W to m. DC-ASGD-a adapts lambda element-wise:
MS <- m * MS + (1 - m) * g * g, lambda_t = lambda0 / sqrt(MS + epsilon). With lambda = 0 this is plain
ASGD. The backup is kept per worker (one per parameter tensor instead of per worker, |g| instead of g * g
and a flipped sign are the bugs seen in public ports; tests/test_coordinator.py checks a step by hand).
"""

from __future__ import annotations

import torch


class DelayCompensation:
    def __init__(self, weights: list[torch.Tensor], lam: float, adaptive: bool = False, momentum: float = 0.95,
                 epsilon: float = 1e-7) -> None:
        self.weights = weights  # the server's live weights, cut like the flat buffers
        self.lam, self.adaptive, self.momentum, self.epsilon = lam, adaptive, momentum, epsilon
        self.backups: dict[int, list[torch.Tensor]] = {}
        self.mean_square = [torch.zeros_like(w) for w in weights] if adaptive else []

    def backup(self, worker: int) -> None:
        """W_bak(worker) <- W, in place when the worker already has a backup."""
        if worker in self.backups:
            for saved, live in zip(self.backups[worker], self.weights):
                saved.copy_(live)
        else:
            self.backups[worker] = [live.clone() for live in self.weights]

    def state_dict(self) -> dict:
        return {"backups": self.backups, "mean_square": self.mean_square}

    def load_state_dict(self, state: dict) -> None:
        self.backups = {int(worker): [t.clone() for t in saved] for worker, saved in state["backups"].items()}
        for live, saved in zip(self.mean_square, state["mean_square"]):
            live.copy_(saved)

    def compensate(self, worker: int, gradient: list[torch.Tensor]) -> list[torch.Tensor]:
        """g~ for ``gradient`` from ``worker``, as new tensors (the received ones are read-only views)."""
        if self.lam == 0.0 and not self.adaptive:
            return gradient
        result = []
        for index, (g, w, bak) in enumerate(zip(gradient, self.weights, self.backups[worker])):
            square = g * g
            if self.adaptive:
                ms = self.mean_square[index]
                ms.mul_(self.momentum).add_(square, alpha=1 - self.momentum)
                square = square * self.lam / torch.sqrt(ms + self.epsilon)
            else:
                square = square * self.lam
            result.append(g + square * (w - bak))
        return result
