"""Has a model blown up? One cheap pass over its weights, after every server update and on every run's
product model (the server's, or the gossip peers' average) before the launcher reports it.

A model is blown up when a weight is NaN or Inf, or when the L2 norm of all its floating-point weights
reaches ``BLOWN_UP_NORM``: diverging SGD grows the weights geometrically (momentum on stale gradients
reached 1e25 on the digits task before anything overflowed), and no float32 network that still trains has
a norm of 1e12 (the spacing of float32 numbers there is about 1e5). The check is a sum of squares, one
``torch.dot`` per tensor (as cheap as the finite-sum check of ``gossip/net/wire.py``): NaN or Inf anywhere
makes it non-finite, and so does a norm beyond ~1.8e19 in float32, which is blown up either way; only
then is the exact element-wise test run, to say which of the two it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

BLOWN_UP_NORM = 1e12


def model_problem(tensors: Iterable[torch.Tensor]) -> str | None:
    """None for a healthy model, else what is wrong with it, in words (integer tensors are skipped)."""
    tensors = [t.detach().reshape(-1) for t in tensors if t.is_floating_point() and t.numel()]
    square = 0.0
    for t in tensors:
        t = t if t.element_size() >= 4 else t.float()  # half-precision squares overflow at 256
        square += float(torch.dot(t, t))
    if math.isfinite(square) and square < BLOWN_UP_NORM ** 2:
        return None
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return "its weights hold NaN or Inf"
    if not math.isfinite(square):  # (float32 overflowed: add up in float64)
        square = sum(float(t.double().square().sum()) for t in tensors)
    norm = math.sqrt(square)
    return f"its weights have blown up (L2 norm {norm:.3g}, the limit is {BLOWN_UP_NORM:.0e})"
