"""Compressed ps-avg (``--compress float16|int8`` with ``--mode ps-avg``, DiLoCo's outer step or the plain
average): both directions carry compressed differences instead of weights.

The server keeps a *public copy* P of its weights W: what every worker holds. After each version it sends
the compressed difference Q(W - P) and moves P by exactly what that decodes to, as each worker moves its
copy (CHOCO-SGD's public copy, as ``gossip/averagers/compressed.py`` keeps one per neighbour); whatever the
codec rounds away stays in W - P and goes out with the next version. A worker that holds no earlier P (it
joins, rejoins or missed a version) is sent P whole, as weights. A worker starts its local steps from P,
and with x its weights after them and r its residual it sends

    q = Q(x + r - P),   r <- x + r - (P + decode(q))

(error feedback, as INT8 pseudo-gradients are sent in INTELLECT-1): the server takes W + decode(q) as its
contribution, so the pseudo-gradient it averages, W - (W + decode(q)), is the worker's own change since P,
and W - P, not yet sent, is no part of it.

Every step runs row by row of the frame plan with the codecs of ``gossip/compression.py``, whose decoding
both sides repeat bit for bit (``add_decoded_``). P lives in float32 (float64 for float64 weights), so a
whole P sent as weights is exact only for float32 and float64 models; a model with lower-precision weights
gets every answer whole. It costs a worker two wide copies of the model (P and r) and the server one (P).
"""

from __future__ import annotations

import torch

from gossip.compression import add_decoded_, encode_difference_, scratch_numel
from gossip.flat import FlatParams
from gossip.net.wire import CODEC_KINDS, frames_per_row


def _wide(view: torch.Tensor) -> torch.Tensor:
    return view.detach().to(torch.promote_types(view.dtype, torch.float32), copy=True)


def _per_row(codec: str, frames: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    step = frames_per_row(codec)
    return [frames[i:i + step] for i in range(0, len(frames), step)]


class _Rows:
    """One wide copy of the weights per row of the frame plan, and row-sized buffers to encode with."""

    def __init__(self, flat: FlatParams) -> None:
        self.flat = flat
        self.public = [_wide(view) for view in flat.views()]
        largest = max(scratch_numel(view.numel()) for view in self.public)
        self._buffers = {p.dtype: [torch.empty(largest, dtype=p.dtype, device=p.device) for _ in range(3)]
                         for p in self.public}

    def buffers(self, public: torch.Tensor) -> list[torch.Tensor]:
        """(work, sent, scratch) for ``public``'s row, each at least its scratch length."""
        return self._buffers[public.dtype]

    def add_decoded(self, codec: str, frames: list[torch.Tensor]) -> None:
        """P += decode(frames), a whole payload's frames."""
        for public, row in zip(self.public, _per_row(codec, frames), strict=True):
            add_decoded_(public, codec, row, self.buffers(public)[2])


class ErrorFeedback:
    """A ps-avg worker's side: ``take`` every answer of the server, ``encode`` each contribution."""

    def __init__(self, flat: FlatParams, codec: str) -> None:
        self.flat, self.codec, self.kind = flat, codec, CODEC_KINDS[codec]
        self.rows = _Rows(flat)
        self.residual = [torch.zeros_like(public) for public in self.rows.public]

    @property
    def public(self) -> list[torch.Tensor]:
        return self.rows.public

    def take(self, kind: str, chunks: list[torch.Tensor]) -> None:
        """The server's answer: P whole (weights) or the difference of its next version; our weights
        become P."""
        if kind == self.kind:
            self.rows.add_decoded(self.codec, chunks)
        else:
            for public, chunk in zip(self.public, chunks, strict=True):
                public.copy_(chunk)
        for view, public in zip(self.flat.views(), self.public, strict=True):
            view.copy_(public)

    def encode(self) -> list[torch.Tensor]:
        """The frames of Q(x + r - P), every row; r becomes what they round away (P stays as it is)."""
        frames = []
        for public, residual, view in zip(self.public, self.residual, self.flat.views(), strict=True):
            work, sent, scratch = self.rows.buffers(public)
            work, sent = work[:public.numel()], sent[:public.numel()]
            torch.add(view, residual, out=work)
            sent.copy_(public)
            frames += encode_difference_(self.codec, work, sent, scratch)  # sent: P + q
            torch.sub(work, sent, out=residual)
        return frames


class Answers:
    """The server's side: its public copy P, and which version of it each worker holds."""

    def __init__(self, flat: FlatParams, codec: str, version: int) -> None:
        self.flat, self.codec, self.kind = flat, codec, CODEC_KINDS[codec]
        self.rows = _Rows(flat)
        # (a whole P is exact on the wire only in the weights' own dtype)
        self.exact = all(public.dtype == view.dtype for public, view in zip(self.rows.public, flat.views()))
        self.version, self.previous = version, None
        self.frames: list[torch.Tensor] = []
        self.holds: dict[int, int] = {}  # worker -> the version of P it was last sent

    def advance(self, version: int) -> None:
        """Our weights are at ``version``: once per version, encode Q(W - P) and move P by it."""
        if version == self.version:
            return
        self.frames = []
        for public, view in zip(self.rows.public, self.flat.views(), strict=True):
            scratch = self.rows.buffers(public)[2]
            self.frames += encode_difference_(self.codec, view, public, scratch)
        self.previous, self.version = self.version, version

    def answer(self, worker: int, whole: bool = False) -> tuple[str, list[torch.Tensor]]:
        """(kind, frames) to send ``worker``: the difference when it holds the previous version of P (and
        not ``whole``), else P whole as weights."""
        held, self.holds[worker] = self.holds.get(worker), self.version
        if self.exact and not whole and self.previous is not None and held == self.previous:
            return self.kind, self.frames
        # (a copy: the transport sends uncopied, and P moves at the next version)
        return "weights", [public.to(view.dtype, copy=True) for public, view in zip(self.rows.public, self.flat.views())]

    def decode_contribution(self, frames: list[torch.Tensor]) -> list[torch.Tensor]:
        """W plus what a worker's ``frames`` (a whole contribution) decode to, one tensor per row of the
        frame plan, in the weights' dtype."""
        chunks = []
        for view, row in zip(self.flat.views(), _per_row(self.codec, frames), strict=True):
            wide = _wide(view)
            add_decoded_(wide, self.codec, row, self.rows.buffers(wide)[2])
            chunks.append(wide.to(view.dtype))
        return chunks
