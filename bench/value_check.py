"""What it costs to check every received value for NaN/Inf, per 100 MiB of float32, in one thread.

``gossip.net.wire.decode`` sums each frame (a read-only pass; NaN or Inf makes the sum non-finite) and only
falls back to ``torch.isfinite`` when the sum itself is not finite. This times both over 8 MiB frames that
are not in cache (four 100 MiB buffers cycled), the way received frames arrive.

    python bench/value_check.py
"""

from __future__ import annotations

import time

import torch

MB = 1 << 20


def per_100_mib(check, frames: list[torch.Tensor], repeats: int = 3) -> float:
    """Milliseconds per 100 MiB, the best of ``repeats`` passes over all frames."""
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        for frame in frames:
            check(frame)
        best = min(best, time.perf_counter() - begin)
    return best * 1000 / (len(frames) * 8 / 100)


def main() -> None:
    torch.set_num_threads(1)
    frames = [torch.randn(8 * MB // 4) for _ in range(4 * 13)]  # 4 x 104 MiB, well over the last-level cache
    print(f"sum (what decode does)    {per_100_mib(lambda f: float(f.sum()), frames):6.1f} ms per 100 MiB")
    print(f"isfinite().all()          {per_100_mib(lambda f: bool(torch.isfinite(f).all()), frames):6.1f} ms per 100 MiB")


if __name__ == "__main__":
    main()
