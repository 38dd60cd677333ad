"""Robust aggregation: the coordinate-wise median or trimmed mean of a peer's own model and its
neighbours' snapshots, so that one neighbour sending large but finite garbage (which passes every check
of the wire format) cannot drag the peer's model away (Yin et al., "Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates", ICML 2018, for both rules).

One rule covers both. For n values of one coordinate, sorted, drop the ``trim`` smallest and the ``trim``
largest and average the rest:

- ``trimmed-mean``: ``trim = floor(trim_fraction * n)``, but at least 1 (otherwise a fraction such as
  0.2 would trim nothing in a ring's 3 values), and at most (n - 1) // 2 so one value or, for even n, the
  two middle ones remain. On 3 or 4 values it is therefore the median.
- ``median``: the largest trim, (n - 1) // 2: the middle value, or the mean of the two middle ones.
- ``mean`` would be trim 0, but it is not computed here: the averagers keep their exact weighted path.

How many inputs, and what each count gives (the first input is always the peer's own model):

- 1 (no neighbour's model): the own model, unchanged.
- 2 (one neighbour's): their mean, the median of two values (trim 0). Nothing can be outvoted here, so
  the peer trusts that neighbour as the mean would (garbage from it reaches the model); keeping the own
  model instead would switch mixing off at the peer: a ring peer whose other neighbour died would train
  alone from then on, unnoticed. A peer gets 2 inputs only when a single in-neighbour is left alive.
- 3 or more: at least one value is trimmed from each end, so one garbage input is outvoted. The config
  refuses topologies that give a peer fewer than 2 in-neighbours, so an intact graph always gives 3.

A parameter server uses the same rule on the N contributions of one version (ps-sync: the workers'
gradients; ps-avg: their weights, or with an outer optimizer the pseudo-gradient from their aggregate;
``gossip/coordinator/sgd.py``, ``averaging.py``). It has no model of its own among the inputs, so n is the
number of workers in the batch: 4 workers give trim 1 under both rules (the mean of the middle two), and
the config refuses a robust rule with fewer than 3 workers. A batch that shrank to 2 (``--missing-worker
continue``) takes their mean, as above.

Every input counts once, whatever push-sum weight its header claims: a weight is a claim from the
network, and a message claiming weight 0 is an input like any other. gossip-sync counts every message of
the round; gossip-async waits until it holds 3 inputs as long as 2 or more in-neighbours are alive, so
that a race or a slow neighbour never leaves one snapshot to be trusted alone
(``gossip/averagers/latest.py``).

The result is clamped to the range of the values kept, so rounding can never leave it (and n equal
values give exactly that value). With b garbage inputs and trim >= b, every kept value lies between two
honest ones, so the result stays within the honest values' range however large the garbage.

What it costs. The inputs count once each, unweighted (the mixing matrix only says who the neighbours are;
push-sum masses and staleness weights do not apply), and a median is not linear: the network's mean is no
longer preserved exactly, even with no fault, and consensus is no longer the contraction x <- W x with
its spectral rate. On a regular graph with honest peers the models still agree (each is pulled toward
its neighbours' middle), a little more slowly and with noisier steps than the mean; the accuracy cost
is measured by ``bench/robust.py`` (RELIABILITY.md, "Robust aggregation").

Memory: models are lists of flat chunks (the wire's frames); each chunk is aggregated in blocks of
``BLOCK_BYTES``, so besides the inputs only O(inputs x block) is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gossip.config import COORDINATE_WISE

BLOCK_BYTES = 256 << 10  # with a few inputs, a block's rows stay in cache through the sorting network
NETWORK_MAX = 16
MIN_INPUTS = 3  # of a robust rule: with one garbage input among 3, two honest ones remain to outvote it


def trim_count(n: int, rule: str, trim_fraction: float) -> int:
    """How many values to drop from each end of ``n`` sorted values under ``rule`` (see the docstring)."""
    rules = ("mean", *COORDINATE_WISE)  # norm-clip judges whole gradients (gossip/coordinator/normbound.py)
    if rule not in rules:
        raise ValueError(f"no coordinate-wise aggregate {rule!r}; choose one of: {', '.join(rules)}")
    if rule == "mean" or n <= 2:
        return 0
    most = (n - 1) // 2
    if rule == "median":
        return most
    return min(most, max(1, math.floor(trim_fraction * n + 1e-9)))  # 0.2 * 5 is 1, not 0.999...


def sorted_rows(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The coordinate-wise order statistics of equally shaped tensors: row k holds every coordinate's
    k-th smallest value. Up to ``NETWORK_MAX`` rows by odd-even transposition (n passes of element-wise
    minimum and maximum, exact and about 20x faster than ``torch.sort`` along a short axis), else sort."""
    rows = list(rows)
    if len(rows) > NETWORK_MAX:
        return list(torch.stack(rows).sort(dim=0).values)
    for phase in range(len(rows)):
        for i in range(phase % 2, len(rows) - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows


def aggregate(inputs: Sequence[torch.Tensor], trim: int) -> torch.Tensor:
    """Coordinate-wise mean of equally shaped tensors without the ``trim`` smallest and largest values of
    each coordinate, clamped to the range of the values kept: a new tensor of their shape."""
    n = len(inputs)
    if not 0 <= 2 * trim < n:
        raise ValueError(f"cannot drop {trim} of {n} values from each end")
    kept = sorted_rows(inputs)[trim:n - trim]
    result = kept[0].clone()
    if len(kept) == 1:
        return result
    for row in kept[1:]:
        result.add_(row)
    return torch.clamp(result.div_(len(kept)), min=kept[0], max=kept[-1])


def aggregate_into_(targets: Sequence[torch.Tensor], models: Sequence[Sequence[torch.Tensor]], rule: str,
                    trim_fraction: float, relative_to: Sequence[torch.Tensor] | None = None) -> None:
    """With ``trim = trim_count(len(models), rule, trim_fraction)``, for every chunk k:
    ``targets[k] = aggregate(models' chunk k, trim)`` (with 1 model that model, with 2 their mean: see the
    module docstring), or with ``relative_to``
    ``targets[k] += aggregate(...) - relative_to[k]`` (the change the aggregate makes to that model, added
    to a model that has moved on since). ``targets`` may be one of ``models``: each block is read before
    it is written. Chunks may live on the host while a target is on a GPU."""
    trim = trim_count(len(models), rule, trim_fraction)
    for index, target in enumerate(targets):
        block = max(1, BLOCK_BYTES // target.element_size())
        for start in range(0, target.numel(), block):
            part = slice(start, start + block)
            result = aggregate([model[index][part].to(target.device) for model in models], trim)
            if relative_to is None:
                target[part].copy_(result)
            else:
                target[part].add_(result.sub_(relative_to[index][part].to(target.device)))
