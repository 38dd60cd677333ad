"""The codecs of compressed gossip (``--compress float16|int8``): turning a difference of weights into
a message a quarter or half the size, and back.

``float16``: every value rounded to half precision, clipped to its range (+-65504). ``int8``: the values
in blocks of ``INT8_BLOCK``, each block as int8 in [-127, 127] times one float32 scale, its largest
magnitude / 127 (hivemind's blockwise 8-bit idea; round to nearest, no stochastic rounding). Neither is
unbiased on its own; the averager makes that harmless by compressing only the *difference* between a
peer's model and the public copy its neighbours already hold, and moving the public copy by exactly what
was sent (CHOCO-SGD's error feedback, ``gossip/averagers/compressed.py``): whatever one message rounds
away stays in the difference and goes out with the next.

Sender and receivers must derive bit-identical public copies from a message, so both apply it with the
same function, ``add_decoded_``: one IEEE multiply per int8 value and one add per value, exactly rounded
on every machine. The wire format of the frames (and what a receiver checks) is in ``gossip/net/wire.py``.
"""

from __future__ import annotations

import torch

from gossip.net.wire import INT8_BLOCK, MAX_INT8_SCALE

FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def scratch_numel(numel: int) -> int:
    """Elements of the scratch buffer that encoding or decoding a row of ``numel`` values needs."""
    return -(-numel // INT8_BLOCK) * INT8_BLOCK


def encode_difference_(codec: str, current: torch.Tensor, public: torch.Tensor,
                       scratch: torch.Tensor) -> list[torch.Tensor]:
    """The frames of compress(current - public), for one row of the frame plan; ``public`` (float32, or
    float64 for float64 weights) then moves by exactly what the frames decode to, as every receiver's copy
    of it will. ``scratch``: a buffer of public's dtype and device, at least ``scratch_numel`` long, so
    that a round allocates only its frames."""
    n = current.numel()
    work = scratch[:scratch_numel(n)]
    torch.sub(current, public, out=work[:n])
    if codec == "float16":
        frames = [work[:n].clamp_(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)]
    elif codec == "int8":
        work[n:].zero_()
        frames = list(_quantize_int8(work, n))
    else:
        raise ValueError(f"unknown codec {codec!r}")
    add_decoded_(public, codec, frames, scratch)
    return frames


def add_decoded_(target: torch.Tensor, codec: str, frames: list[torch.Tensor], scratch: torch.Tensor) -> None:
    """target += decode(frames): one row's frames, as ``encode_difference_`` made them (received frames
    are in host memory; a GPU target gets them copied over first). ``scratch`` as for encoding."""
    frames = [frame.to(target.device, non_blocking=True) for frame in frames]
    n = frames[0].numel()
    decoded = scratch[:scratch_numel(n)]
    decoded[:n].copy_(frames[0])  # (an add of mixed dtypes would make a converted copy of its own)
    if codec == "int8":
        decoded.view(-1, INT8_BLOCK).mul_(frames[1][:, None])  # (the padding beyond n is scaled and ignored)
    target.add_(decoded[:n])


def _quantize_int8(work: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales) of the first ``n`` of ``work`` (zero-padded to whole blocks, consumed)."""
    blocks = work.view(-1, INT8_BLOCK)
    low, high = torch.aminmax(blocks, dim=1)
    scales = torch.maximum(high, low.neg_()).to(torch.float32).div_(127.0).clamp_(max=MAX_INT8_SCALE)
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales)).to(work.dtype)
    blocks.mul_(inverse[:, None]).round_().clamp_(-127, 127)
    return work[:n].to(torch.int8), scales
