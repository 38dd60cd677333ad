"""Compressed contributions in ps-avg (``--compress float16|int8`` with ``--mode ps-avg``, DiLoCo's outer
step or the plain average): a worker sends the change of its weights since the server's weights it started
from, compressed, instead of the weights; the server adds what it decodes to those weights, which are still
its own (ps-avg waits for every worker's contribution to a version before it moves on).

Error feedback (as INT8 pseudo-gradients are sent in INTELLECT-1, and as CHOCO's public copy works in
``gossip/averagers/compressed.py``): what the codec rounds away from one contribution is added to the
next, so nothing is lost for good, only late by an averaging. With W_v the server's weights the worker
started from, x its weights now and r its residual,

    send q = Q(x + r - W_v),   the server takes W_v + q,   r <- x + r - (W_v + q)

computed row by row of the frame plan with the codecs of ``gossip/compression.py``, whose decoding the
server repeats bit for bit (``add_decoded_``). It costs the worker two copies of the model (W_v, kept in
float32 or wider, and r); the server decodes each contribution into a fresh copy of its weights, as an
uncompressed one arrives as a copy.
"""

from __future__ import annotations

import torch

from gossip.compression import add_decoded_, encode_difference_, scratch_numel
from gossip.flat import FlatParams


def _wide(view: torch.Tensor) -> torch.Tensor:
    return view.detach().to(torch.promote_types(view.dtype, torch.float32), copy=True)


class ErrorFeedback:
    """A ps-avg worker's side: ``start`` when it takes the server's weights, ``encode`` when it contributes."""

    def __init__(self, flat: FlatParams, codec: str) -> None:
        self.flat, self.codec = flat, codec
        self.base = [_wide(view) for view in flat.views()]  # W_v, then (once encoded) what the server rebuilt
        self.residual = [torch.zeros_like(base) for base in self.base]
        largest = max(scratch_numel(view.numel()) for view in self.base)
        self._scratch = {b.dtype: torch.empty(largest, dtype=b.dtype, device=b.device) for b in self.base}
        self._work = {b.dtype: torch.empty(largest, dtype=b.dtype, device=b.device) for b in self.base}

    def start(self) -> None:
        """The weights just taken from the server are W_v of the next contribution."""
        for base, view in zip(self.base, self.flat.views(), strict=True):
            base.copy_(view)

    def encode(self) -> list[torch.Tensor]:
        """The frames of Q(x + r - W_v), every row; r becomes what they round away."""
        frames = []
        for base, residual, view in zip(self.base, self.residual, self.flat.views(), strict=True):
            target = self._work[base.dtype][:base.numel()]
            torch.add(view, residual, out=target)
            frames += encode_difference_(self.codec, target, base, self._scratch[base.dtype])  # base: W_v + q
            torch.sub(target, base, out=residual)
        return frames


def decode_contribution(flat: FlatParams, codec: str, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """The server's side: its weights plus what ``frames`` (a whole contribution) decode to, one tensor per
    row of the frame plan, in the weights' dtype."""
    per_row = 2 if codec == "int8" else 1
    chunks = []
    for index, view in enumerate(flat.views()):
        wide = _wide(view)
        scratch = torch.empty(scratch_numel(view.numel()), dtype=wide.dtype)
        add_decoded_(wide, codec, frames[index * per_row:(index + 1) * per_row], scratch)
        chunks.append(wide.to(view.dtype))
    return chunks
