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

CODECS = ("none", "float16", "int8")
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def bits_per_value(codec: str) -> float:
    """What one weight costs on the wire (float32 weights for "none")."""
    return {"none": 32.0, "float16": 16.0, "int8": 8.0 + 32.0 / INT8_BLOCK}[codec]


def encode_difference_(codec: str, current: torch.Tensor, public: torch.Tensor) -> list[torch.Tensor]:
    """The frames of compress(current - public), for one row of the frame plan; ``public`` (float32, or
    float64 for float64 weights) then moves by exactly what the frames decode to, as every receiver's copy
    of it will."""
    difference = current.to(public.dtype) - public  # a new tensor: ours to send
    if codec == "float16":
        frames = [difference.clamp_(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)]
    elif codec == "int8":
        frames = list(_quantize_int8(difference))
    else:
        raise ValueError(f"unknown codec {codec!r}")
    add_decoded_(public, codec, frames)
    return frames


def add_decoded_(target: torch.Tensor, codec: str, frames: list[torch.Tensor]) -> None:
    """target += decode(frames): one row's frames, as ``encode_difference_`` made them (received
    frames are in host memory; a GPU target gets them copied over first)."""
    frames = [frame.to(target.device, non_blocking=True) for frame in frames]
    if codec == "float16":
        target.add_(frames[0])
        return
    values, scales = frames
    full = values.numel() // INT8_BLOCK * INT8_BLOCK
    decoded = torch.empty(values.numel(), dtype=torch.float32, device=target.device)
    if full:
        blocks = decoded[:full].view(-1, INT8_BLOCK)
        blocks.copy_(values[:full].view(-1, INT8_BLOCK)).mul_(scales[:full // INT8_BLOCK, None])
    if full < values.numel():
        decoded[full:].copy_(values[full:]).mul_(scales[-1])
    target.add_(decoded)


def _quantize_int8(difference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales) of ``difference`` (float32 or float64, consumed), block by block."""
    n = difference.numel()
    blocks = -(-n // INT8_BLOCK)
    padded = difference if n == blocks * INT8_BLOCK else torch.cat([difference, difference.new_zeros(blocks * INT8_BLOCK - n)])
    padded = padded.view(blocks, INT8_BLOCK)
    scales = padded.abs().amax(dim=1).to(torch.float32).div_(127.0).clamp_(max=MAX_INT8_SCALE)
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    values = padded.mul_(inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return values.clone() if values.numel() != blocks * INT8_BLOCK else values, scales
